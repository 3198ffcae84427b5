import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            outputs = []
            for i in ("0", "1"):
                tensor = pb_utils.get_input_tensor_by_name(request, "INPUT" + i)
                if tensor is not None:
                    outputs.append(pb_utils.Tensor("OUTPUT" + i, tensor.as_numpy()))
            responses.append(pb_utils.InferenceResponse(outputs))
        return responses
