import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            value = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            params = {"count": int(value[0]), "label": "seen", "ok": True}
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", value)], parameters=params))
        return responses
