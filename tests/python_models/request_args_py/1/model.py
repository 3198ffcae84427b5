# Reports what execute() sees (requested outputs, parameters), calls the model named by its MODEL
# input through BLS with that name as bytes (as Triton's bls example does with as_numpy()[0]), and
# returns a tensor its config does not declare (which the server must drop).
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            name = pb_utils.get_input_tensor_by_name(request, "MODEL").as_numpy()[0]  # bytes
            a = np.arange(16, dtype=np.int32).reshape(1, 16)
            bls = pb_utils.InferenceRequest(
                model_name=name, requested_output_names=[b"OUTPUT0"],
                inputs=[pb_utils.Tensor("INPUT0", a), pb_utils.Tensor("INPUT1", a)]).exec()
            if bls.has_error():
                raise pb_utils.TritonModelException(bls.error().message())
            args = {"requested": sorted(request.requested_output_names()),
                    "parameters": json.loads(request.parameters())}
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("ARGS", np.array([json.dumps(args).encode()], dtype=np.object_)),
                pb_utils.Tensor("SUM", pb_utils.get_output_tensor_by_name(bls, "OUTPUT0").as_numpy()),
                pb_utils.Tensor("UNDECLARED", np.zeros(1, dtype=np.int32))]))
        return responses
