# Not decoupled, yet answers through response senders (Triton 23.10+): OUT = IN * 3, sent from a
# thread after execute() returned, with the FINAL flag. IN = 0 closes the sender with no response.
import threading
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            threading.Thread(target=self.answer, args=(request, request.get_response_sender())).start()
        return None

    def answer(self, request, sender):
        time.sleep(0.1)
        x = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
        if x[0] == 0:
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return
        sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x * 3)]),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
