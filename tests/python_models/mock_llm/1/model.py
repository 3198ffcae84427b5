import triton_python_backend_utils as pb_utils


def _value(request, name, default):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return default if tensor is None else tensor.as_numpy()[0][0]


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            prompt = pb_utils.get_input_tensor_by_name(request, "PROMPT").as_numpy()
            repetition = int(_value(request, "REPETITION", 1))
            fail_last = bool(_value(request, "FAIL_LAST", False))
            for _ in range(repetition):
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("TEXT", prompt)]))
            if fail_last:
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError("An Error Occurred")),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            else:
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
