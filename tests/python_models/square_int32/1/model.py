# Decoupled: sends IN responses, each with OUT = IN, then the final flag (Triton's square example).
import json
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.model_config = model_config = json.loads(args["model_config"])
        using_decoupled = pb_utils.using_decoupled_model_transaction_policy(model_config)
        if not using_decoupled:
            raise pb_utils.TritonModelException(
                """the model `{}` can generate any number of responses per request,
                enable decoupled transaction policy in model configuration to
                serve this model""".format(args["model_name"]))
        out_config = pb_utils.get_output_config_by_name(model_config, "OUT")
        self.out_dtype = pb_utils.triton_string_to_numpy(out_config["data_type"])
        self.inflight_thread_count = 0
        self.inflight_thread_count_lck = threading.Lock()

    def execute(self, requests):
        for request in requests:
            self.process_request(request)
        return None

    def process_request(self, request):
        thread = threading.Thread(target=self.response_thread,
                                  args=(request.get_response_sender(),
                                        pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()))
        thread.daemon = True
        with self.inflight_thread_count_lck:
            self.inflight_thread_count += 1
        thread.start()

    def response_thread(self, response_sender, in_input):
        for _ in range(in_input[0]):
            if response_sender.is_cancelled():
                break
            out_output = pb_utils.Tensor("OUT", np.array([in_input[0]], self.out_dtype))
            response = pb_utils.InferenceResponse(output_tensors=[out_output])
            response_sender.send(response)
            time.sleep(0.01)
        response_sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        with self.inflight_thread_count_lck:
            self.inflight_thread_count -= 1

    def finalize(self):
        pass
