# A rescheduled request gets None in the responses list, as Triton's docs ask.
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.runs = {}

    def execute(self, requests):
        responses = []
        for request in requests:
            corrid = request.correlation_id()
            if request.flags() & pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END:  # never sent to iterative models
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError("unexpected END flag")))
                continue
            if request.flags() & pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START:
                self.runs[corrid] = 0
            self.runs[corrid] += 1
            steps = int(pb_utils.get_input_tensor_by_name(request, "STEPS").as_numpy()[0])
            if self.runs[corrid] < steps:
                request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
                responses.append(None)
            else:
                runs = self.runs.pop(corrid)
                responses.append(pb_utils.InferenceResponse(
                    output_tensors=[pb_utils.Tensor("EXECUTIONS", np.array([runs], np.int32))]))
        return responses
