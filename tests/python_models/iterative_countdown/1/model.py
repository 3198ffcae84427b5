# Each execution sends one response (the executions left) and reschedules the request until
# none are left. Keyed by correlation ID: the START flag opens a sequence, later executions
# must come without it and with the same ID (no ID at all: a scheduler without sequences).
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.left = {}

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            corrid = request.correlation_id()
            if request.flags() & pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START or not corrid:
                self.left[corrid] = int(pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy().flat[0])
            elif corrid not in self.left:
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                    f"execution without START for unknown sequence {corrid}")),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            self.left[corrid] -= 1
            out = pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor("OUTPUT", np.array([[self.left[corrid]]], np.int32))])
            if self.left[corrid] <= 0:
                del self.left[corrid]
                sender.send(out, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            else:
                request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
                sender.send(out)
        return None
