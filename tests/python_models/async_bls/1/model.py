# async execute with two concurrent BLS calls (async_exec), as in Triton's async BLS example:
# OUTPUT0 = (INPUT0 + INPUT1) from one call + (INPUT0 - INPUT1) from the other = 2 * INPUT0.
import asyncio

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        responses = []
        for request in requests:
            inputs = [pb_utils.get_input_tensor_by_name(request, "INPUT0"),
                      pb_utils.get_input_tensor_by_name(request, "INPUT1")]
            awaits = [pb_utils.InferenceRequest(model_name="add_sub_py", requested_output_names=[name],
                                                inputs=inputs).async_exec() for name in ("OUTPUT0", "OUTPUT1")]
            first, second = await asyncio.gather(*awaits)
            for r in (first, second):
                if r.has_error():
                    raise pb_utils.TritonModelException(r.error().message())
            total = (pb_utils.get_output_tensor_by_name(first, "OUTPUT0").as_numpy()
                     + pb_utils.get_output_tensor_by_name(second, "OUTPUT1").as_numpy())
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", total)]))
        return responses
