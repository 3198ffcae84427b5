# Errors: MODE "raise" raises in execute, "error" answers with a TritonError, anything else echoes.
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            mode = pb_utils.get_input_tensor_by_name(request, "MODE").as_numpy()[0]
            if mode == b"raise":
                raise ValueError("asked to raise")
            if mode == b"error":
                responses.append(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError("bad mode: error", pb_utils.TritonError.INVALID_ARG)))
                continue
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("ECHO", np.array([mode], dtype=np.object_))]))
        return responses
