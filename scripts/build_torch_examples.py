"""Build the MLP examples: one tiny network, as TorchScript (`mlp_torchscript`) and as ONNX
(`mlp_onnx`), with the same seeded weights. Reproducible: same bytes every run, from any folder
(the ONNX file with any onnx; the TorchScript file with torch 2.13.0, which the tests pin).

    python scripts/build_torch_examples.py [--out model_repository]

The network: OUTPUT__0 = relu(INPUT__0 @ W1.T + b1) @ W2.T + b2, FP32 [batch, 4] -> [batch, 3].
The ONNX file needs only `onnx` (Gemm/Relu/Gemm from the weights, no torch.onnx.export, so no
onnxscript either). The TorchScript file needs torch; its source is compiled from a string under
a fixed file name, and torch's RNG is seeded, because torch.jit.save records the source file's
path and a random serialization id.
"""

from __future__ import annotations

import argparse
import io
import linecache
import sys
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from scripts.build_example_models import _model  # noqa: E402

IN_FEATURES, HIDDEN, OUT_FEATURES = 4, 16, 3
MAX_BATCH = 8

TORCHSCRIPT_CONFIG = """\
# Tiny MLP (4 -> 16 -> 3, ReLU) as TorchScript; the same network and weights as mlp_onnx.
# Triton's naming convention: INPUT__0 is forward()'s first argument, OUTPUT__0 its output.
# Built by scripts/build_torch_examples.py.
name: "mlp_torchscript"
platform: "pytorch_libtorch"
max_batch_size: 8
input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 3 ] } ]
dynamic_batching { max_queue_delay_microseconds: 1000 }
instance_group [ { count: 1 kind: KIND_CPU } ]
parameters: { key: "INTRA_OP_THREAD_COUNT" value: { string_value: "1" } }
"""

ONNX_CONFIG = """\
# Tiny MLP (4 -> 16 -> 3, ReLU) as ONNX; the same network and weights as mlp_torchscript.
# Built by scripts/build_torch_examples.py.
name: "mlp_onnx"
platform: "onnxruntime_onnx"
max_batch_size: 8
input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 3 ] } ]
dynamic_batching { max_queue_delay_microseconds: 1000 }
instance_group [ { count: 1 kind: KIND_CPU } ]
parameters: { key: "intra_op_thread_count" value: { string_value: "1" } }
"""

# The module torch.jit.script compiles. Kept in a string with a fixed file name so that the
# archive's debug info does not depend on where this checkout lives.
_SOURCE_NAME = "<pier mlp_torchscript>"
_SOURCE = '''\
class TinyMLP(torch.nn.Module):
    """OUTPUT__0 = relu(x @ w1.T + b1) @ w2.T + b2."""

    def __init__(self, w1, b1, w2, b2):
        super().__init__()
        self.w1 = torch.nn.Parameter(w1, requires_grad=False)
        self.b1 = torch.nn.Parameter(b1, requires_grad=False)
        self.w2 = torch.nn.Parameter(w2, requires_grad=False)
        self.b2 = torch.nn.Parameter(b2, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(torch.nn.functional.linear(x, self.w1, self.b1))
        return torch.nn.functional.linear(hidden, self.w2, self.b2)
'''


def mlp_weights() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(w1 [16, 4], b1 [16], w2 [3, 16], b2 [3]), FP32, from a fixed seed."""
    rng = np.random.default_rng(20240607)
    w1 = (rng.standard_normal((HIDDEN, IN_FEATURES)) * 0.5).astype(np.float32)
    b1 = (rng.standard_normal(HIDDEN) * 0.1).astype(np.float32)
    w2 = (rng.standard_normal((OUT_FEATURES, HIDDEN)) * 0.5).astype(np.float32)
    b2 = (rng.standard_normal(OUT_FEATURES) * 0.1).astype(np.float32)
    return w1, b1, w2, b2


def mlp_reference(x: np.ndarray) -> np.ndarray:
    """The network in numpy (float64 accumulation), for tests."""
    w1, b1, w2, b2 = (w.astype(np.float64) for w in mlp_weights())
    hidden = np.maximum(x.astype(np.float64) @ w1.T + b1, 0.0)
    return (hidden @ w2.T + b2).astype(np.float32)


def mlp_onnx() -> bytes:
    w1, b1, w2, b2 = mlp_weights()
    inits = [numpy_helper.from_array(w, name) for w, name in ((w1, "w1"), (b1, "b1"), (w2, "w2"), (b2, "b2"))]
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["INPUT__0", "w1", "b1"], ["pre"], transB=1),
         helper.make_node("Relu", ["pre"], ["hidden"]),
         helper.make_node("Gemm", ["hidden", "w2", "b2"], ["OUTPUT__0"], transB=1)],
        "mlp",
        [helper.make_tensor_value_info("INPUT__0", TensorProto.FLOAT, ["batch", IN_FEATURES])],
        [helper.make_tensor_value_info("OUTPUT__0", TensorProto.FLOAT, ["batch", OUT_FEATURES])],
        inits,
    )
    return _model(graph)


def mlp_torchscript() -> bytes:
    import torch

    linecache.cache[_SOURCE_NAME] = (len(_SOURCE), None, _SOURCE.splitlines(True), _SOURCE_NAME)
    namespace = {"torch": torch, "__name__": "pier_examples"}
    exec(compile(_SOURCE, _SOURCE_NAME, "exec"), namespace)
    weights = [torch.from_numpy(w.copy()) for w in mlp_weights()]
    module = torch.jit.script(namespace["TinyMLP"](*weights).eval())
    state = torch.random.get_rng_state()
    torch.manual_seed(0)  # the archive's serialization id comes from torch's RNG
    try:
        buf = io.BytesIO()
        torch.jit.save(module, buf)
    finally:
        torch.random.set_rng_state(state)
    return buf.getvalue()


def write(repo: Path, name: str, config: str, filename: str, model: bytes) -> Path:
    folder = repo / name
    (folder / "1").mkdir(parents=True, exist_ok=True)
    (folder / "config.pbtxt").write_text(config)
    (folder / "1" / filename).write_bytes(model)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "model_repository"))
    out = Path(parser.parse_args().out)
    write(out, "mlp_onnx", ONNX_CONFIG, "model.onnx", mlp_onnx())
    write(out, "mlp_torchscript", TORCHSCRIPT_CONFIG, "model.pt", mlp_torchscript())
    print(f"wrote mlp_onnx and mlp_torchscript to {out}")


if __name__ == "__main__":
    main()
