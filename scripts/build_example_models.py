"""Build the example ONNX models in model_repository/ (reproducibly: same bytes every run).

    python scripts/build_example_models.py [--out model_repository]

`simple`: INPUT0, INPUT1 INT32 [-1,16] -> OUTPUT0 = sum, OUTPUT1 = difference (max_batch_size 8).
`identity_fp32`: INPUT0 -> OUTPUT0, FP32 [-1,-1], configured as the reference Triton's model.
`accumulate`: a stateful model for the sequence batcher: OUTPUT = running sum of a sequence's INPUTs,
kept as implicit state by the server (START / END / READY / CORRID control inputs).
Tests reuse `identity_model` to build an identity model for every datatype.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
IR_VERSION = 8  # readable by every onnxruntime >= 1.15

ONNX_TYPES = {
    "BOOL": TensorProto.BOOL, "UINT8": TensorProto.UINT8, "UINT16": TensorProto.UINT16,
    "UINT32": TensorProto.UINT32, "UINT64": TensorProto.UINT64, "INT8": TensorProto.INT8,
    "INT16": TensorProto.INT16, "INT32": TensorProto.INT32, "INT64": TensorProto.INT64,
    "FP16": TensorProto.FLOAT16, "FP32": TensorProto.FLOAT, "FP64": TensorProto.DOUBLE,
    "BYTES": TensorProto.STRING, "BF16": TensorProto.BFLOAT16,
}

SIMPLE_CONFIG = """\
# OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1 (Triton's classic "simple" example).
name: "simple"
platform: "onnxruntime_onnx"
max_batch_size: 8
input [
  { name: "INPUT0" data_type: TYPE_INT32 dims: [ 16 ] },
  { name: "INPUT1" data_type: TYPE_INT32 dims: [ 16 ] }
]
output [
  { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 16 ] },
  { name: "OUTPUT1" data_type: TYPE_INT32 dims: [ 16 ] }
]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""

# The same model as the reference Triton's python-backend identity_fp32 (bench/identity.py), on ONNX.
IDENTITY_FP32_CONFIG = """\
# Identity: OUTPUT0 = INPUT0, variable-length FP32 vector, batched by the dynamic batcher.
name: "identity_fp32"
platform: "onnxruntime_onnx"
max_batch_size: 64
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
dynamic_batching { max_queue_delay_microseconds: 100 }
instance_group [ { count: 1 kind: KIND_CPU } ]
"""


def _model(graph: onnx.GraphProto) -> bytes:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="pier")
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model)
    return model.SerializeToString(deterministic=True)


def simple_model() -> bytes:
    shape = [-1, 16]
    t = TensorProto.INT32
    graph = helper.make_graph(
        [helper.make_node("Add", ["INPUT0", "INPUT1"], ["OUTPUT0"]),
         helper.make_node("Sub", ["INPUT0", "INPUT1"], ["OUTPUT1"])],
        "simple",
        [helper.make_tensor_value_info("INPUT0", t, shape), helper.make_tensor_value_info("INPUT1", t, shape)],
        [helper.make_tensor_value_info("OUTPUT0", t, shape), helper.make_tensor_value_info("OUTPUT1", t, shape)],
    )
    return _model(graph)


ACCUMULATE_CONFIG = """\
# Stateful: OUTPUT = running sum of the sequence's INPUTs. The server keeps the sum between requests
# (implicit state STATE_IN <- STATE_OUT) and fills the control inputs; CTRL = [START, END, READY],
# CORR_OUT = the correlation ID, STATE_SEEN = the state the model was handed.
name: "accumulate"
platform: "onnxruntime_onnx"
max_batch_size: 8
input [ { name: "INPUT" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_FP32 dims: [ 1 ] },
         { name: "CTRL" data_type: TYPE_FP32 dims: [ 3 ] },
         { name: "CORR_OUT" data_type: TYPE_UINT64 dims: [ 1 ] },
         { name: "STATE_SEEN" data_type: TYPE_FP32 dims: [ 1 ] } ]
sequence_batching {
  max_sequence_idle_microseconds: 60000000
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },
    { name: "END" control [ { kind: CONTROL_SEQUENCE_END fp32_false_true: [ 0, 1 ] } ] },
    { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY bool_false_true: [ false, true ] } ] },
    { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 } ] }
  ]
  state [ { input_name: "STATE_IN" output_name: "STATE_OUT" data_type: TYPE_FP32 dims: [ 1 ] } ]
  direct { max_queue_delay_microseconds: 1000 }
}
instance_group [ { count: 1 kind: KIND_CPU } ]
"""


def accumulate_model(corrid: str = "UINT64") -> bytes:
    """OUTPUT = (START ? 0 : STATE_IN) + INPUT = STATE_OUT; CTRL = [START, END, READY]; CORR_OUT = CORRID
    (of datatype `corrid`); STATE_SEEN = STATE_IN."""
    f = TensorProto.FLOAT
    vi = helper.make_tensor_value_info
    nodes = [
        helper.make_node("Cast", ["START"], ["start_f"], to=f),
        helper.make_node("Sub", ["one", "start_f"], ["keep"]),
        helper.make_node("Mul", ["STATE_IN", "keep"], ["kept"]),
        helper.make_node("Add", ["kept", "INPUT"], ["OUTPUT"]),
        helper.make_node("Identity", ["OUTPUT"], ["STATE_OUT"]),
        helper.make_node("Cast", ["READY"], ["ready_f"], to=f),
        helper.make_node("Concat", ["start_f", "END", "ready_f"], ["CTRL"], axis=1),
        helper.make_node("Identity", ["CORRID"], ["CORR_OUT"]),
        helper.make_node("Identity", ["STATE_IN"], ["STATE_SEEN"]),
    ]
    graph = helper.make_graph(
        nodes, "accumulate",
        [vi("INPUT", f, ["n", 1]), vi("START", TensorProto.INT32, ["n", 1]), vi("END", f, ["n", 1]),
         vi("READY", TensorProto.BOOL, ["n", 1]), vi("CORRID", ONNX_TYPES[corrid], ["n", 1]),
         vi("STATE_IN", f, ["n", 1])],
        [vi("OUTPUT", f, ["n", 1]), vi("CTRL", f, ["n", 3]), vi("CORR_OUT", ONNX_TYPES[corrid], ["n", 1]),
         vi("STATE_OUT", f, ["n", 1]), vi("STATE_SEEN", f, ["n", 1])],
        [numpy_helper.from_array(np.array(1.0, np.float32), "one")],
    )
    return _model(graph)


def identity_model(datatype: str, shape: list[int | str], in_name: str = "INPUT0",
                   out_name: str = "OUTPUT0") -> bytes:
    """OUTPUT0 = INPUT0 for one KServe datatype; `shape` may use -1 / symbolic names."""
    t = ONNX_TYPES[datatype]
    dims = [d if isinstance(d, str) else (f"d{i}" if d == -1 else d) for i, d in enumerate(shape)]
    graph = helper.make_graph(
        [helper.make_node("Identity", [in_name], [out_name])],
        f"identity_{datatype.lower()}",
        [helper.make_tensor_value_info(in_name, t, dims)],
        [helper.make_tensor_value_info(out_name, t, dims)],
    )
    return _model(graph)


def write_model(repo: Path, name: str, config: str | None, model: bytes, version: int = 1) -> Path:
    folder = repo / name
    (folder / str(version)).mkdir(parents=True, exist_ok=True)
    if config is not None:
        (folder / "config.pbtxt").write_text(config)
    (folder / str(version) / "model.onnx").write_bytes(model)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "model_repository"))
    out = Path(parser.parse_args().out)
    write_model(out, "simple", SIMPLE_CONFIG, simple_model())
    write_model(out, "identity_fp32", IDENTITY_FP32_CONFIG, identity_model("FP32", [-1, -1]))
    write_model(out, "accumulate", ACCUMULATE_CONFIG, accumulate_model())
    print(f"wrote simple, identity_fp32 and accumulate to {out}")


if __name__ == "__main__":
    main()
