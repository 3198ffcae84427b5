import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.sums = {}

    def execute(self, requests):
        responses = []
        for request in requests:
            values, starts, ends, corrids = (pb_utils.get_input_tensor_by_name(request, name).as_numpy()
                                             for name in ("INPUT", "START", "END", "CORRID"))
            out = np.zeros_like(values)
            for row in range(values.shape[0]):  # one row per sequence in the batch
                key = corrids[row, 0].decode()
                total = (0 if starts[row, 0] else self.sums.get(key, 0)) + int(values[row, 0])
                self.sums[key] = total
                out[row, 0] = total + (int(key) if ends[row, 0] else 0)
                if ends[row, 0]:
                    del self.sums[key]
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT", out)]))
        return responses
