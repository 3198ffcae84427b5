# BLS: forwards its inputs to the `simple` model and returns its outputs (Triton's BLS docs).
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            infer_request = pb_utils.InferenceRequest(
                model_name="simple",
                requested_output_names=["OUTPUT0", "OUTPUT1"],
                preferred_memory=pb_utils.PreferredMemory(pb_utils.TRITONSERVER_MEMORY_CPU, 0),
                inputs=[pb_utils.get_input_tensor_by_name(request, "INPUT0"),
                        pb_utils.get_input_tensor_by_name(request, "INPUT1")])
            infer_response = infer_request.exec()
            if infer_response.has_error():
                raise pb_utils.TritonModelException(infer_response.error().message())
            out0 = pb_utils.get_output_tensor_by_name(infer_response, "OUTPUT0")
            out1 = pb_utils.get_output_tensor_by_name(infer_response, "OUTPUT1")
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("OUTPUT0", out0.as_numpy()), pb_utils.Tensor("OUTPUT1", out1.as_numpy())]))
        return responses
