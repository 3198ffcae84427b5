# The config names only the backend: the model declares its tensors in auto_complete_config,
# as Triton's python backend documentation shows.
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        inputs = [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [4]},
                  {"name": "INPUT1", "data_type": "TYPE_FP32", "dims": [4]}]
        outputs = [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [4]}]
        config = auto_complete_model_config.as_dict()
        input_names = [i["name"] for i in config["input"]]
        output_names = [o["name"] for o in config["output"]]
        for i in inputs:
            if i["name"] not in input_names:
                auto_complete_model_config.add_input(i)
        for o in outputs:
            if o["name"] not in output_names:
                auto_complete_model_config.add_output(o)
        auto_complete_model_config.set_max_batch_size(8)
        auto_complete_model_config.set_dynamic_batching()
        return auto_complete_model_config

    def execute(self, requests):
        responses = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            b = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", (a * b).astype(np.float32))]))
        return responses
