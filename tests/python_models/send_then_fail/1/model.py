import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        raise_after = False
        for request in requests:
            mode = int(pb_utils.get_input_tensor_by_name(request, "MODE").as_numpy().flat[0])
            sender = request.get_response_sender()
            sender.send(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUT", np.array([7], np.int32))]))
            if mode == 0:
                raise_after = True
            elif mode == 1:
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError("failed after sending")),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            else:
                request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
        if raise_after:
            raise pb_utils.TritonModelException("failed after sending")
        return None
