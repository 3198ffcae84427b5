"""ONNX models that only tests need (the example ones live in scripts/build_example_models.py),
and python models of work of a known length (`write_sleep_models`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from scripts.build_example_models import _model


def slow_model(layers: int = 40, batched: bool = False) -> bytes:
    """Y = mean over 2048 copies of tanh(...tanh(X @ W)...): tens to hundreds of ms per row on a
    CPU. X and Y are FP32 [1, 256], or [-1, 256] when `batched`."""
    w = numpy_helper.from_array(np.eye(256, dtype=np.float32) * 0.5, "W")
    if batched:
        axes = numpy_helper.from_array(np.array([1], dtype=np.int64), "A")
        shape = numpy_helper.from_array(np.array([1, 2048, 1], dtype=np.int64), "S")
        nodes = [helper.make_node("Unsqueeze", ["X", "A"], ["u"]), helper.make_node("Expand", ["u", "S"], ["h0"])]
        inits, io_shape, reduce_axis = [w, axes, shape], ["batch", 256], 1
    else:
        shape = numpy_helper.from_array(np.array([2048, 256], dtype=np.int64), "S")
        nodes = [helper.make_node("Expand", ["X", "S"], ["h0"])]
        inits, io_shape, reduce_axis = [w, shape], [1, 256], 0
    for i in range(layers):
        nodes.append(helper.make_node("MatMul", [f"h{i}", "W"], [f"m{i}"]))
        nodes.append(helper.make_node("Tanh", [f"m{i}"], [f"h{i + 1}"]))
    keep = 0 if batched else 1
    nodes.append(helper.make_node("ReduceMean", [f"h{layers}"], ["Y"], axes=[reduce_axis], keepdims=keep))
    graph = helper.make_graph(nodes, "slow", [helper.make_tensor_value_info("X", TensorProto.FLOAT, io_shape)],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, io_shape)], inits)
    return _model(graph)


def add_constant_model(constant: float) -> bytes:
    """Y = X + constant, FP32 [-1, 4] (batched): the answer tells which version served it."""
    c = numpy_helper.from_array(np.full([4], constant, dtype=np.float32), "C")
    graph = helper.make_graph([helper.make_node("Add", ["X", "C"], ["Y"])], "add_constant",
                              [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["batch", 4])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["batch", 4])], [c])
    return _model(graph)


ADD_CONFIG = """name: "{name}"
backend: "onnxruntime"
max_batch_size: 8
version_policy: {policy}
input [ {{ name: "X" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ 4 ] }} ]
"""


SLEEP_MODELS = {
    # OUT = SECONDS, answered after sleeping SECONDS.
    "sleep_py": ("""name: "sleep_py"
backend: "python"
max_batch_size: 0
input [ { name: "SECONDS" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
{extra}
""", """import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            seconds = pb_utils.get_input_tensor_by_name(request, "SECONDS").as_numpy()
            print(f"sleep_py: sleeping {float(seconds[0]):g} s", flush=True)  # tests wait for this line
            time.sleep(float(seconds[0]))
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", seconds)]))
        return responses
"""),
    # Decoupled: COUNT responses OUT = 0, 1, ..., each followed by SECONDS of sleep, then the
    # final flag (a stream of a known length, or with a long sleep one left open).
    "sleep_decoupled_py": ("""name: "sleep_decoupled_py"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "SECONDS" data_type: TYPE_FP32 dims: [ 1 ] }, { name: "COUNT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
{extra}
""", """import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            seconds = float(pb_utils.get_input_tensor_by_name(request, "SECONDS").as_numpy()[0])
            count = int(pb_utils.get_input_tensor_by_name(request, "COUNT").as_numpy()[0])
            sender = request.get_response_sender()
            for i in range(count):
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([i], np.int32))]))
                time.sleep(seconds)
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""),
}


def write_sleep_models(repo: Path, extra: str = "") -> None:
    """`sleep_py` and `sleep_decoupled_py` into `repo` (`extra`: more config lines for both, such as
    an execution_mode parameter): python models whose work lasts as long as the request says."""
    for name, (config, code) in SLEEP_MODELS.items():
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "config.pbtxt").write_text(config.replace("{extra}", extra))
        (repo / name / "1" / "model.py").write_text(code)
