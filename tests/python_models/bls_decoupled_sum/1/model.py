# BLS on a decoupled model (Triton's bls_decoupled sync example): sum every OUT that square_int32
# streams back; the last response is empty and only carries the final flag.
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            infer_request = pb_utils.InferenceRequest(
                model_name="square_int32", requested_output_names=["OUT"],
                inputs=[pb_utils.get_input_tensor_by_name(request, "IN")])
            total = 0
            for infer_response in infer_request.exec(decoupled=True):
                if infer_response.has_error():
                    raise pb_utils.TritonModelException(infer_response.error().message())
                if len(infer_response.output_tensors()) > 0:
                    total += int(pb_utils.get_output_tensor_by_name(infer_response, "OUT").as_numpy()[0])
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("SUM", np.array([total], np.int32))]))
        return responses
