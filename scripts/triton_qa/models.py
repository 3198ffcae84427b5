"""Python-backend stand-ins for the models Triton's QA test.sh files copy from NVIDIA's prebuilt repositories.

The upstream suites copy `docs/examples/model_repository/*` (TensorFlow graphdefs), `/data/inferenceserver/...`
(ONNX, LibTorch, TensorRT) and C++ test backends (identity, repeat, square, dyna_sequence). The reference
Triton here has only the python backend, so each is rebuilt as a `backend: "python"` model with the same
name, tensors, batching and behaviour the tests check; both servers get the same repository.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

# ---------------------------------------------------------------------------------------------- model.py bodies

ADD_SUB_PY = '''\
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1 (names from the config)."""

    def initialize(self, args):
        import json

        cfg = json.loads(args["model_config"])
        self.inputs = [i["name"] for i in cfg["input"]]
        self.outputs = [(o["name"], o["data_type"]) for o in cfg["output"]]

    def execute(self, requests):
        responses = []
        for request in requests:
            a, b = (pb_utils.get_input_tensor_by_name(request, n).as_numpy() for n in self.inputs[:2])
            if a.dtype == np.object_:
                a = np.array([int(x) for x in a.flatten()], dtype=np.int64).reshape(a.shape)
                b = np.array([int(x) for x in b.flatten()], dtype=np.int64).reshape(b.shape)
            outs = []
            for (name, dtype), value in zip(self.outputs, (a + b, a - b)):
                if dtype == "TYPE_STRING":
                    value = np.array([str(x).encode() for x in value.flatten()], dtype=np.object_).reshape(value.shape)
                else:
                    value = value.astype(pb_utils.triton_string_to_numpy(dtype))
                outs.append(pb_utils.Tensor(name, value))
            responses.append(pb_utils.InferenceResponse(outs))
        return responses
'''

IDENTITY_PY = '''\
import json
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Triton's `identity` test backend: output k = input k; for an optional input left out, output k is zeros
    (L0_optional_input: "OUTPUT0 is always zero"), when its shape is fixed; honours execute_delay_ms."""

    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        self.batched = cfg.get("max_batch_size", 0) > 0
        self.pairs = [(i["name"], o["name"], o["data_type"], o["dims"]) for i, o in zip(cfg["input"], cfg["output"])]
        delay = cfg.get("parameters", {}).get("execute_delay_ms", {}).get("string_value", "0")
        self.delay_s = int(delay or 0) / 1000.0

    def execute(self, requests):
        if self.delay_s:
            time.sleep(self.delay_s)
        responses = []
        for request in requests:
            present = {n: pb_utils.get_input_tensor_by_name(request, n) for n, _, _, _ in self.pairs}
            batch = [t.as_numpy().shape[0] for t in present.values() if t is not None][:1]
            outs = []
            for in_name, out_name, dtype, dims in self.pairs:
                t = present[in_name]
                if t is not None:
                    outs.append(pb_utils.Tensor(out_name, t.as_numpy()))
                elif all(d >= 0 for d in dims) and dtype != "TYPE_STRING" and (batch or not self.batched):
                    shape = (batch if self.batched else []) + list(dims)
                    outs.append(pb_utils.Tensor(out_name, np.zeros(shape, pb_utils.triton_string_to_numpy(dtype))))
            responses.append(pb_utils.InferenceResponse(outs))
        return responses
'''

# simple_sequence / simple_dyna_sequence (TF graphdefs): OUTPUT = INPUT + START, and the dyna one adds the
# correlation id on the END request (what the client examples expect).
SEQUENCE_PY = '''\
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        names = {c["kind"]: ci["name"] for ci in cfg["sequence_batching"].get("control_input", [])
                 for c in ci["control"]}
        self.start = names.get("CONTROL_SEQUENCE_START")
        self.end = names.get("CONTROL_SEQUENCE_END")
        self.corrid = names.get("CONTROL_SEQUENCE_CORRID")

    def _get(self, request, name):
        t = pb_utils.get_input_tensor_by_name(request, name) if name else None
        return None if t is None else t.as_numpy()

    def execute(self, requests):
        responses = []
        for request in requests:
            value = self._get(request, "INPUT").astype(np.int64)
            start = self._get(request, self.start)
            out = value + (start.astype(np.int64) if start is not None else 0)
            end = self._get(request, self.end)
            corrid = self._get(request, self.corrid)
            if end is not None and corrid is not None:
                out = out + end.astype(np.int64) * corrid.astype(np.int64).reshape(end.shape)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT", out.astype(np.int32))]))
        return responses
'''

# Triton's dyna_sequence custom backend (simple_string_dyna_sequence): an accumulator per sequence, reset by
# START; the END request adds the correlation id (a string holding an integer). As the C++ backend
# (src/test/dyna_sequence, ModelInstanceState::accumulator_), each instance keeps its own accumulators: the
# config has two instances, and the sequence batcher must route all of a sequence's requests to one.
DYNA_ACCUMULATE_PY = '''\
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.accumulator = {}

    def execute(self, requests):
        responses = []
        for request in requests:
            get = lambda n: pb_utils.get_input_tensor_by_name(request, n).as_numpy()  # noqa: E731
            value = int(get("INPUT").flatten()[0])
            start, end = int(get("START").flatten()[0]), int(get("END").flatten()[0])
            corrid = get("CORRID").flatten()[0]
            corrid = corrid.decode() if isinstance(corrid, bytes) else str(corrid)
            acc = (0 if start else self.accumulator.get(corrid, 0)) + value
            self.accumulator[corrid] = acc
            out = acc
            if end:
                out += int(corrid)
                del self.accumulator[corrid]
            responses.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUTPUT", np.array([[out]], dtype=np.int32))]))
        return responses
'''

# ---------------------------------------------------------------------------------------------- configs


def _io(kind: str, name: str, dtype: str, dims: list[int], extra: str = "") -> str:
    return f'  {{ name: "{name}" data_type: {dtype} dims: [ {", ".join(map(str, dims))} ] {extra}}}'


def _config(name: str, max_batch: int, inputs: list[str], outputs: list[str], tail: str = "") -> str:
    return (f'name: "{name}"\nbackend: "python"\nmax_batch_size: {max_batch}\n'
            f"input [\n{','.join(s + chr(10) for s in inputs)}]\n"
            f"output [\n{','.join(s + chr(10) for s in outputs)}]\n{tail}")


def _write(dest: Path, config: str, model_py: str, versions: tuple[int, ...] = (1,)) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.pbtxt").write_text(config)
    for v in versions:
        (dest / str(v)).mkdir(exist_ok=True)
        (dest / str(v) / "model.py").write_text(model_py)


def add_sub(dest: Path, name: str, dtype: str = "TYPE_INT32", out_dtype: str | None = None,
            dims: int = 16, max_batch: int = 8, out_names: tuple[str, str] = ("OUTPUT0", "OUTPUT1"),
            versions: tuple[int, ...] = (1,)) -> None:
    out_dtype = out_dtype or dtype
    ins = [_io("in", f"INPUT{i}", dtype, [dims]) for i in range(2)]
    outs = [_io("out", n, out_dtype, [dims]) for n in out_names]
    _write(dest / name, _config(name, max_batch, ins, outs, 'instance_group [ { kind: KIND_CPU } ]\n'),
           ADD_SUB_PY, versions)


def identity(dest: Path, name: str, dtype: str, dims: list[int], count: int = 1, max_batch: int = 8,
             tail: str = "") -> None:
    ins = [_io("in", f"INPUT{i}", dtype, dims) for i in range(count)]
    outs = [_io("out", f"OUTPUT{i}", dtype, dims) for i in range(count)]
    _write(dest / name, _config(name, max_batch, ins, outs, tail), IDENTITY_PY)


def python_backend_for(model_dir: Path, model_py: str = IDENTITY_PY) -> None:
    """Turn a suite-shipped model of a C++ test backend (identity, ...) or of a TF/ONNX platform into a python one."""
    cfg = model_dir / "config.pbtxt"
    text = re.sub(r'^\s*(backend|platform):\s*"[^"]*"', 'backend: "python"', cfg.read_text(), flags=re.M)
    cfg.write_text(text)
    versions = [p for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit()] or [model_dir / "1"]
    for v in versions:
        v.mkdir(exist_ok=True)
        for f in v.iterdir():
            f.unlink() if f.is_file() else shutil.rmtree(f)
        (v / "model.py").write_text(model_py)


# ---------------------------------------------------------------------------------------------- docs examples

SIMPLE_SEQUENCE_CFG = '''name: "simple_sequence"
backend: "python"
max_batch_size: 8
sequence_batching {
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },
    { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY int32_false_true: [ 0, 1 ] } ] }
  ]
}
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU } ]
'''

# Kept in the layout of docs/examples/model_repository/simple_dyna_sequence/config.pbtxt, so that the
# test.sh edits (the CORRID data_type line after CONTROL_SEQUENCE_CORRID) apply to it verbatim.
SIMPLE_DYNA_SEQUENCE_CFG = '''name: "simple_dyna_sequence"
backend: "python"
max_batch_size: 8
sequence_batching {
    max_sequence_idle_microseconds: 10000000
    oldest {
      max_candidate_sequences: 1024
      max_queue_delay_microseconds: 10000
    }

  control_input [
    {
      name: "START"
      control [
        {
          kind: CONTROL_SEQUENCE_START
          int32_false_true: [ 0, 1 ]
        }
      ]
    },
    {
      name: "END"
      control [
        {
          kind: CONTROL_SEQUENCE_END
          int32_false_true: [ 0, 1 ]
        }
      ]
    },
    {
      name: "READY"
      control [
        {
          kind: CONTROL_SEQUENCE_READY
          int32_false_true: [ 0, 1 ]
        }
      ]
    },
    {
      name: "CORRID"
      control [
        {
          kind: CONTROL_SEQUENCE_CORRID
          data_type: TYPE_UINT64
        }
      ]
    }
  ]
}
input [
  {
    name: "INPUT"
    data_type: TYPE_INT32
    dims: [ 1 ]
  }
]
output [
  {
    name: "OUTPUT"
    data_type: TYPE_INT32
    dims: [ 1 ]
  }
]
parameters [
  {
    key: "execute_delay_ms"
    value: { string_value: "3" }
  }
]
instance_group [
  {
    count: 2
    kind: KIND_CPU
  }
]
'''


INCEPTION_STUB_CFG = '''name: "inception_graphdef"
backend: "python"
max_batch_size: 128
input [ { name: "input" data_type: TYPE_FP32 format: FORMAT_NHWC dims: [ 299, 299, 3 ] } ]
output [ { name: "InceptionV3/Predictions/Softmax" data_type: TYPE_FP32 dims: [ 1001 ] } ]
'''

INCEPTION_STUB_PY = '''\
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Placeholder for docs/examples/model_repository/inception_graphdef (TensorFlow): all-zero scores."""

    def execute(self, requests):
        out = []
        for request in requests:
            n = pb_utils.get_input_tensor_by_name(request, "input").as_numpy().shape[0]
            zeros = np.zeros([n, 1001], dtype=np.float32)
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("InceptionV3/Predictions/Softmax", zeros)]))
        return out
'''


def docs_example(dest: Path, name: str) -> None:
    """One of docs/examples/model_repository's models, as a python model."""
    if name == "simple":
        add_sub(dest, "simple")
    elif name == "simple_int8":
        add_sub(dest, "simple_int8", "TYPE_INT8")
    elif name == "simple_string":
        add_sub(dest, "simple_string", "TYPE_STRING")
    elif name == "simple_identity":
        identity(dest, "simple_identity", "TYPE_STRING", [-1])
    elif name == "simple_sequence":
        _write(dest / name, SIMPLE_SEQUENCE_CFG, SEQUENCE_PY)
    elif name == "simple_dyna_sequence":
        _write(dest / name, SIMPLE_DYNA_SEQUENCE_CFG, SEQUENCE_PY)
    elif name == "inception_graphdef":
        # A stand-in so the repository holds what the suites' do (the model-control examples and the aio tests
        # count 7 models); the image-client cases that would classify with it are skipped.
        _write(dest / name, INCEPTION_STUB_CFG, INCEPTION_STUB_PY)
    else:
        raise KeyError(name)


def string_dyna_sequence(models: Path) -> None:
    """test.sh: cp simple_dyna_sequence -> simple_string_dyna_sequence, rename, CORRID TYPE_STRING, and the
    dyna_sequence backend (here: its python equivalent)."""
    src, dst = models / "simple_dyna_sequence", models / "simple_string_dyna_sequence"
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    cfg = dst / "config.pbtxt"
    text = cfg.read_text().replace("simple_dyna_sequence", "simple_string_dyna_sequence")
    text = re.sub(r"(CONTROL_SEQUENCE_CORRID\n\s*)data_type:.*", r"\1data_type: TYPE_STRING", text)
    cfg.write_text(text)
    (dst / "1" / "model.py").write_text(DYNA_ACCUMULATE_PY)


# ---------------------------------------------------------------------------------------------- QA repositories


def qa_identity(dest: Path, name: str) -> None:
    """/data/inferenceserver/<ver>/qa_identity_model_repository/onnx_zero_* (max_batch 8, INPUTk -> OUTPUTk)."""
    m = re.fullmatch(r"onnx_zero_(\d)_(float32|float16|object)", name)
    if not m:
        raise KeyError(name)
    count, dt = int(m.group(1)), m.group(2)
    dtype = {"float32": "TYPE_FP32", "float16": "TYPE_FP16", "object": "TYPE_STRING"}[dt]
    dims = [-1, -1] if dt == "float16" else [-1]
    identity(dest, name, dtype, dims, count=count)


def libtorch_nobatch_int32(dest: Path) -> None:
    """qa_model_repository/libtorch_nobatch_int32_int32_int32 after L0_decoupled's sed (dims: [ 1 ]). Its served
    version is the latest, 3, which gen_qa_models.py builds with swap=True: OUTPUT__0 = difference, OUTPUT__1 = sum
    (add_sub assigns sum, difference in the config's output order)."""
    add_sub(dest, "libtorch_nobatch_int32_int32_int32", dims=1, max_batch=0, out_names=("OUTPUT__1", "OUTPUT__0"))


def onnx_int32_as_simple(dest: Path) -> None:
    """L0_logging: qa_model_repository/onnx_int32_int32_int32 copied as `simple`, versions 2 and 3 removed."""
    add_sub(dest, "simple")


def pt_identity(dest: Path) -> None:
    """L0_input_validation builds a TorchScript nn.Identity with this config; the python equivalent."""
    tail = "dynamic_batching {\n    max_queue_delay_microseconds: 1000000\n}\n"
    ins = [_io("in", "INPUT0", "TYPE_FP32", [8])]
    outs = [_io("out", "OUTPUT0", "TYPE_FP32", [8])]
    _write(dest / "pt_identity", _config("pt_identity", 8, ins, outs, tail), IDENTITY_PY)


def graphdef_object_int32_int32(dest: Path) -> None:
    """qa_model_repository/graphdef_object_int32_int32: STRING [16] inputs, INT32 [16] sum/difference."""
    add_sub(dest, "graphdef_object_int32_int32", "TYPE_STRING", out_dtype="TYPE_INT32")
