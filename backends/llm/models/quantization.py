"""Quantized weights at load: which scheme runs (the `quantization` setting, config.json's
`quantization_config`) and the checkpoint's tensors brought to `layers/quantized.PackedWeight`.

- `int8` (the setting, on an unquantized checkpoint): every decoder projection quantized at load,
  symmetric per output row (layers/quantized.quantize_int8); embeddings and the LM head stay float.
- `gptq` (4 or 8 bit): `qweight` int32 [in / pf, out] packed along the input, `qzeros` int32 [groups,
  out / pf] along the output (v1 convention: the zero point is the stored value + 1), `scales`
  [groups, out], `g_idx` [in]; with `desc_act` the input columns are stored in act-order (`perm`).
- `awq` (4 bit, GEMM layout): `qweight` and `qzeros` int32 packed along the output, nibble i holding
  column [0, 2, 4, 6, 1, 3, 5, 7][i] of its eight; `scales` [groups, out]; w = (q - z) * s.
- `compressed-tensors` W4A16 / W8A16 (`pack-quantized`, symmetric): `weight_packed` int32 [out, in /
  pf] packed along the input, values offset by 2^(bits-1); `weight_scale` [out, groups];
  `weight_shape`; optional `weight_g_idx`.
- `fp8` (vLLM's / DeepSeek's / Qwen3-FP8's): `weight` float8_e4m3fn [out, in]; with `weight_block_size`
  [bn, bk] a `weight_scale_inv` [ceil(out / bn), in / bk] that multiplies each tile (despite its name),
  else a per-tensor `weight_scale`; `activation_scheme` "static" adds a per-tensor `input_scale`.
- `compressed-tensors` `float-quantized` (FP8 W8A8 / W8A16): `weight` float8_e4m3fn, `weight_scale` per
  tensor [1], per channel [out, 1] or per block (`block_structure`), `input_scale` [1] when the activation
  scheme is static (`dynamic: false`).
  FP8 weights are held as E4M3 codes with their scales per output row (layers/quantized.PackedWeight,
  layers/fp8.py: torch._scaled_mm on CUDA sm89+, else de-quantized per call, CPU included).
Layers the checkpoint left in float (`lm_head`, `modules_to_not_convert`, `ignore`) load as floats.
The layouts are vLLM's readers' (docs/llm.md, "Quantized weights").
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..layers.fp8 import uses_scaled_mm
from ..layers.quantized import PackedLinearMethod, PackedSlices, PackedWeight

log = logging.getLogger(__name__)

METHODS = ("int8", "gptq", "awq", "compressed-tensors", "gguf", "fp8")
_AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]
# the tensors of one quantized projection, by format (the prefix is the projection's name)
_TENSORS = {"gptq": ("qweight", "qzeros", "scales", "g_idx"), "awq": ("qweight", "qzeros", "scales"),
            "compressed-tensors": ("weight_packed", "weight_scale", "weight_shape")}
_OPTIONAL = {"gptq": ("g_idx",), "compressed-tensors": ("weight_g_idx",)}


@dataclass(frozen=True)
class QuantConfig:
    """What runs: `method` (METHODS), `bits`, `group_size` (-1: one group per row); `types`: GGUF's
    tensor types and counts ("Q4_1 x210, Q8_0 x1, F32 x61"), "" for the other methods. FP8 weights
    (`fp8`): `group_size` is a block's input width, `block_rows` its output height (0: per-tensor or
    per-channel scales); `static_input`: the checkpoint carries per-tensor activation scales."""

    method: str
    bits: int
    group_size: int
    types: str = ""
    fp8: bool = False
    block_rows: int = 0
    static_input: bool = False

    def describe(self) -> str:
        if self.types:
            return f"{self.method} (tensor types {self.types})"
        if self.fp8:
            scales = (f"{self.block_rows}x{self.group_size} blocks" if self.block_rows else "per-tensor or channel")
            acts = "static" if self.static_input else "dynamic"
            return f"{self.method} (FP8 E4M3 weights, scales {scales}, {acts} activation scales)"
        group = "per output channel" if self.group_size == -1 else f"group size {self.group_size}"
        return f"{self.method} ({self.bits}-bit weights, {group})"

    @property
    def scale_name(self) -> str:
        """The FP8 weight scale's tensor name (vLLM's block-wise `fp8` says weight_scale_inv)."""
        return "weight_scale_inv" if self.method == "fp8" and self.block_rows else "weight_scale"


def resolve(setting: str | None, raw: dict[str, Any]) -> QuantConfig | None:
    """The scheme for a checkpoint (`raw`: config.json) under the `quantization` setting (None: the
    checkpoint's own, if any). ValueError where they disagree or the checkpoint's is unsupported."""
    qc = raw.get("quantization_config")
    if qc is None:
        if setting is None:
            return None
        if setting != "int8":
            raise ValueError(f"quantization {setting!r} needs a checkpoint quantized that way (config.json has no "
                             "quantization_config); 'int8' quantizes an unquantized checkpoint at load")
        return QuantConfig("int8", 8, -1)
    if not isinstance(qc, dict):
        raise ValueError("config.json: quantization_config must be an object")
    method = str(qc.get("quant_method", "")).lower()
    if setting is not None and setting != method:
        raise ValueError(f"Quantization method specified in the model config ({method}) does not match the "
                         f"quantization method specified in the `quantization` argument ({setting})")
    if method == "gptq":
        if qc.get("checkpoint_format", "gptq") != "gptq":
            raise ValueError(f"quantization_config: GPTQ checkpoint_format {qc.get('checkpoint_format')!r} is not "
                             "supported (only 'gptq', the v1 zero-point convention)")
        return QuantConfig("gptq", _int(qc, "bits", (4, 8)), _int(qc, "group_size"))
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"quantization_config: AWQ version {version!r} is not supported (only 'gemm')")
        if qc.get("zero_point", True) is not True:
            raise ValueError("quantization_config: AWQ without zero points is not supported")
        named = {"bits": qc.get("bits", qc.get("w_bit", 4)), "group_size": qc.get("group_size", qc.get("q_group_size",
                                                                                                        128))}
        return QuantConfig("awq", _int(named, "bits", (4,)), _int(named, "group_size"))
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method == "fp8":
        return _fp8_config(qc)
    raise ValueError(f"quantization_config: quant_method {method!r} is not supported; supported: "
                     f"{', '.join(m for m in METHODS if m != 'int8')}")


def _int(qc: dict[str, Any], key: str, allowed: tuple[int, ...] | None = None) -> int:
    value = qc.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or (allowed is not None and value not in allowed):
        want = " or ".join(map(str, allowed)) if allowed else "an integer"
        raise ValueError(f"quantization_config: {key} must be {want}, got {value!r}")
    return value


def _block(value: Any, key: str) -> tuple[int, int]:
    if (not isinstance(value, list) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)):
        raise ValueError(f"quantization_config: {key} must be two positive integers [rows, columns], got {value!r}")
    return value[0], value[1]


def _fp8_config(qc: dict[str, Any]) -> QuantConfig:
    """vLLM's `fp8` (serialized FP8 checkpoints; vLLM's Fp8Config reads the same keys)."""
    if str(qc.get("fmt", "e4m3")).lower() != "e4m3":
        raise ValueError(f"quantization_config: fp8 fmt {qc.get('fmt')!r} is not supported (only 'e4m3')")
    scheme = qc.get("activation_scheme")
    if scheme not in ("static", "dynamic"):
        raise ValueError(f"quantization_config: activation_scheme must be 'static' or 'dynamic', got {scheme!r}")
    block = qc.get("weight_block_size")
    if block is None:
        return QuantConfig("fp8", 8, -1, fp8=True, static_input=scheme == "static")
    rows, cols = _block(block, "weight_block_size")
    if scheme != "dynamic":
        raise ValueError("quantization_config: block-wise FP8 (weight_block_size) needs activation_scheme 'dynamic'")
    return QuantConfig("fp8", 8, cols, fp8=True, block_rows=rows)


def _compressed_fp8(weights: dict[str, Any], acts: Any) -> QuantConfig:
    """compressed-tensors `float-quantized`: FP8 weights, activations dynamic, static or unquantized."""
    if weights.get("type") != "float" or weights.get("num_bits") != 8:
        raise ValueError("quantization_config: float-quantized weights must be type 'float' with num_bits 8")
    static = False
    if acts is not None:
        if not isinstance(acts, dict) or acts.get("type") != "float" or acts.get("num_bits") != 8:
            raise ValueError("quantization_config: float-quantized input_activations must be type 'float', 8 bits")
        static = acts.get("dynamic") is False
        if static and acts.get("strategy", "tensor") != "tensor":
            raise ValueError("quantization_config: static FP8 activation scales must be per tensor")
    strategy = weights.get("strategy")
    if strategy in ("tensor", "channel"):
        return QuantConfig("compressed-tensors", 8, -1, fp8=True, static_input=static)
    if strategy != "block":
        raise ValueError(f"quantization_config: FP8 weight strategy {strategy!r} is not supported ('tensor', "
                         "'channel', 'block')")
    rows, cols = _block(weights.get("block_structure"), "block_structure")
    return QuantConfig("compressed-tensors", 8, cols, fp8=True, block_rows=rows, static_input=static)


def _compressed_tensors(qc: dict[str, Any]) -> QuantConfig:
    fmt = qc.get("format")
    if fmt not in ("pack-quantized", "float-quantized"):
        raise ValueError(f"quantization_config: compressed-tensors format {fmt!r} is not supported (only "
                         "'pack-quantized', W4A16 / W8A16, and 'float-quantized', FP8)")
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, dict) or len(groups) != 1:
        raise ValueError("quantization_config: compressed-tensors needs exactly one entry in config_groups")
    scheme = next(iter(groups.values()))
    weights = scheme.get("weights") or {}
    if fmt == "float-quantized":
        return _compressed_fp8(weights, scheme.get("input_activations"))
    if scheme.get("input_activations") is not None:
        raise ValueError("quantization_config: quantized activations are not supported (weight-only W4A16/W8A16)")
    if weights.get("type", "int") != "int" or weights.get("symmetric") is not True:
        raise ValueError("quantization_config: only symmetric integer weights are supported")
    strategy = weights.get("strategy")
    bits = _int(weights, "num_bits", (4, 8))
    if strategy == "channel":
        return QuantConfig("compressed-tensors", bits, -1)
    if strategy != "group":
        raise ValueError(f"quantization_config: weight strategy {strategy!r} is not supported ('group', 'channel')")
    return QuantConfig("compressed-tensors", bits, _int(weights, "group_size"))


def apply(model: Any, qc: QuantConfig, ops: Any | None) -> int:
    """Give every decoder projection (a `Linear` named `*_proj`: not MoE routers) the packed method;
    returns how many."""
    count = 0
    for layer in model.layers:
        for linear in getattr(layer, "linears", ()):
            if linear.name.endswith("_proj"):
                linear.method = PackedLinearMethod(online=qc.method == "int8", ops=ops)
                count += 1
    return count


def translate(weights: Iterable[tuple[str, torch.Tensor]], qc: QuantConfig | None
              ) -> Iterator[tuple[str, Any]]:
    """The checkpoint's tensors with each quantized projection's set (qweight, qzeros, ...) replaced
    by one `{prefix}.weight` PackedWeight; everything else passes through. ValueError naming the
    tensor where one is malformed or missing."""
    if qc is None or qc.method in ("int8", "gguf"):  # GGUF's reader brings its blocks as PackedWeights
        yield from weights
        return
    if qc.fp8:
        yield from _translate_fp8(weights, qc)
        return
    names, optional = _TENSORS[qc.method], _OPTIONAL.get(qc.method, ())
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        prefix, _, leaf = name.rpartition(".")
        if leaf not in names and leaf not in optional:
            yield name, tensor
            continue
        parts = pending.setdefault(prefix, {})
        parts[leaf] = tensor
        if all(n in parts for n in names) and (qc.method != "gptq" or "g_idx" in parts):
            yield f"{prefix}.weight", _convert(qc, prefix, pending.pop(prefix))
    for prefix, parts in pending.items():
        missing = [n for n in names if n not in parts] or [n for n in optional if n not in parts]
        raise ValueError(f"quantized weight {prefix}.{missing[0]} missing from the safetensors files")


_FP8_SCALES = ("weight_scale", "weight_scale_inv", "input_scale")


def _translate_fp8(weights: Iterable[tuple[str, torch.Tensor]], qc: QuantConfig) -> Iterator[tuple[str, Any]]:
    """`translate` for FP8: a `weight` in float8_e4m3fn and its scales become one PackedWeight; a
    `weight` in another dtype (a layer left in float) passes through."""
    needed = ("weight", qc.scale_name) + (("input_scale",) if qc.static_input else ())
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        prefix, _, leaf = name.rpartition(".")
        if not (leaf in _FP8_SCALES or (leaf == "weight" and tensor.dtype in (torch.float8_e4m3fn,
                                                                                torch.float8_e5m2))):
            yield name, tensor
            continue
        parts = pending.setdefault(prefix, {})
        parts[leaf] = tensor
        if all(n in parts for n in needed):
            yield f"{prefix}.weight", _convert(qc, prefix, pending.pop(prefix))
    for prefix, parts in pending.items():
        missing = [n for n in needed if n not in parts]
        raise ValueError(f"quantized weight {prefix}.{missing[0]} missing from the safetensors files")


def _convert(qc: QuantConfig, prefix: str, t: dict[str, torch.Tensor]) -> PackedWeight:
    try:
        if qc.fp8:
            return _fp8(qc, t)
        if qc.method == "gptq":
            return _gptq(qc, t)
        if qc.method == "awq":
            return _awq(qc, t)
        return _compressed(qc, t)
    except (ValueError, RuntimeError, IndexError) as exc:
        raise ValueError(f"quantized weight {prefix}: {exc}") from None


def _check(t: torch.Tensor, name: str, dtypes: tuple[torch.dtype, ...], shape: tuple[int, ...]) -> None:
    if t.dtype not in dtypes:
        raise ValueError(f"{name} has dtype {t.dtype}, expected {' or '.join(map(str, dtypes))}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} has shape {list(t.shape)}, expected {list(shape)}")


def _unpack(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> their 32 / bits values (least significant first) along `dim` (0 or 1), int32."""
    pf = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    if dim == 0:  # [R, C] -> [R * pf, C]
        vals = (packed.unsqueeze(1) >> shifts[None, :, None]) & ((1 << bits) - 1)
        return vals.reshape(packed.shape[0] * pf, packed.shape[1])
    vals = (packed.unsqueeze(2) >> shifts[None, None, :]) & ((1 << bits) - 1)
    return vals.reshape(packed.shape[0], packed.shape[1] * pf)


def _grouped(values: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int, group: int,
             g_idx: torch.Tensor | None) -> PackedWeight:
    """values [N, K], scales and zeros [N, G], g_idx [K] or None: the packed weight, in act-order
    (`perm`) where g_idx is not the natural grouping."""
    n, k = values.shape
    natural = torch.arange(k) // group
    if g_idx is None or torch.equal(g_idx.long(), natural):
        return PackedWeight.from_values(values, scales, zeros, bits, group)
    g = g_idx.long()
    if g.min() < 0 or g.max() >= scales.shape[1]:
        raise ValueError(f"g_idx has a group index outside 0..{scales.shape[1] - 1}")
    perm = torch.argsort(g, stable=True)
    if not torch.equal(g[perm], natural):  # groups of unequal size: no act-order layout fits
        raise ValueError(f"g_idx: its groups are not all group_size ({group}) columns wide")
    return PackedWeight.from_values(values[:, perm], scales, zeros, bits, group, perm)


def _gptq(qc: QuantConfig, t: dict[str, torch.Tensor]) -> PackedWeight:
    bits, pf = qc.bits, 32 // qc.bits
    qweight, qzeros, scales, g_idx = t["qweight"], t["qzeros"], t["scales"], t["g_idx"]
    if qweight.dim() != 2:
        raise ValueError(f"qweight has shape {list(qweight.shape)}, expected 2 dimensions")
    k, n = qweight.shape[0] * pf, qweight.shape[1]
    group = k if qc.group_size == -1 else qc.group_size
    if k % group:
        raise ValueError(f"input width {k} is not a multiple of group_size {group}")
    groups = k // group
    _check(qweight, "qweight", (torch.int32,), (k // pf, n))
    _check(qzeros, "qzeros", (torch.int32,), (groups, n // pf))
    _check(scales, "scales", (torch.float16, torch.bfloat16, torch.float32), (groups, n))
    _check(g_idx, "g_idx", (torch.int32, torch.int64), (k,))
    values = _unpack(qweight, bits, 0).t()  # [N, K]
    zeros = (_unpack(qzeros, bits, 1) + 1).t().float()  # v1: the stored zero point is z - 1
    return _grouped(values, scales.t().float(), zeros, bits, group, g_idx)


def _awq(qc: QuantConfig, t: dict[str, torch.Tensor]) -> PackedWeight:
    qweight, qzeros, scales = t["qweight"], t["qzeros"], t["scales"]
    if qweight.dim() != 2:
        raise ValueError(f"qweight has shape {list(qweight.shape)}, expected 2 dimensions")
    k, n = qweight.shape[0], qweight.shape[1] * 8
    group = k if qc.group_size == -1 else qc.group_size
    if k % group:
        raise ValueError(f"input width {k} is not a multiple of group_size {group}")
    _check(qweight, "qweight", (torch.int32,), (k, n // 8))
    _check(qzeros, "qzeros", (torch.int32,), (k // group, n // 8))
    _check(scales, "scales", (torch.float16, torch.bfloat16, torch.float32), (k // group, n))
    order = torch.tensor(_AWQ_REVERSE_ORDER)

    def unpack(p: torch.Tensor) -> torch.Tensor:  # [R, n / 8] -> [R, n], columns in order
        v = _unpack(p, 4, 1).view(p.shape[0], n // 8, 8)
        return v[:, :, order].reshape(p.shape[0], n)

    return _grouped(unpack(qweight).t(), scales.t().float(), unpack(qzeros).t().float(), 4, group, None)


def _compressed(qc: QuantConfig, t: dict[str, torch.Tensor]) -> PackedWeight:
    bits, pf = qc.bits, 32 // qc.bits
    packed, scale, shape = t["weight_packed"], t["weight_scale"], t["weight_shape"]
    if shape.numel() != 2:
        raise ValueError(f"weight_shape has {shape.numel()} values, expected 2")
    n, k = (int(v) for v in shape.tolist())
    group = k if qc.group_size == -1 else qc.group_size
    if k % group or k % pf:
        raise ValueError(f"input width {k} is not a multiple of the group size {group} and of {pf}")
    _check(packed, "weight_packed", (torch.int32,), (n, k // pf))
    _check(scale, "weight_scale", (torch.float16, torch.bfloat16, torch.float32), (n, k // group))
    values = _unpack(packed, bits, 1)  # stored value = signed value + 2^(bits-1)
    zeros = torch.full((n, k // group), float(1 << (bits - 1)))
    return _grouped(values, scale.float(), zeros, bits, group, t.get("weight_g_idx"))


_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e8m0fnu)  # e8m0: scale_fmt ue8m0


def _fp8(qc: QuantConfig, t: dict[str, torch.Tensor]) -> PackedWeight:
    weight, scale, name = t["weight"], t[qc.scale_name], qc.scale_name
    if weight.dim() != 2:
        raise ValueError(f"weight has shape {list(weight.shape)}, expected 2 dimensions")
    n, k = weight.shape
    if scale.dtype not in _SCALE_DTYPES:
        raise ValueError(f"{name} has dtype {scale.dtype}, expected {' or '.join(map(str, _SCALE_DTYPES))}")
    s = scale.float()
    if qc.block_rows:
        rows, cols = qc.block_rows, qc.group_size
        if k % cols:
            raise ValueError(f"input width {k} is not a multiple of the block width {cols}")
        _check(scale, name, _SCALE_DTYPES, (-(-n // rows), k // cols))
        per_row, group = s.repeat_interleave(rows, dim=0)[:n], cols
    elif s.numel() == 1:
        per_row, group = s.reshape(1, 1).expand(n, 1), k
    elif tuple(s.shape) in ((n,), (n, 1)):
        per_row, group = s.reshape(n, 1), k
    else:
        raise ValueError(f"{name} has shape {list(s.shape)}, expected [1] (per tensor) or [{n}, 1] (per channel)")
    input_scale = t.get("input_scale")
    if input_scale is not None and (input_scale.numel() != 1 or input_scale.dtype not in _SCALE_DTYPES):
        raise ValueError(f"input_scale has shape {list(input_scale.shape)} and dtype {input_scale.dtype}, expected "
                         "one float (per tensor)")
    return PackedWeight.from_fp8(weight, per_row, group, input_scale if qc.static_input else None)


def log_summary(qc: QuantConfig, model: Any, projections: int) -> str:
    """The startup line saying what runs."""
    packed = [lin.weight for layer in model.layers for lin in getattr(layer, "linears", ())
              if isinstance(lin.weight, PackedWeight | PackedSlices)]
    kernel = any(getattr(lin.method, "ops", None) is not None for layer in model.layers
                 for lin in getattr(layer, "linears", ()))
    size = sum(p.nbytes for p in packed) / 2**20
    if qc.fp8:
        parts = [q for p in packed for q in (p.parts if isinstance(p, PackedSlices) else (p,))]
        w8a8 = sum(uses_scaled_mm(p.q, p.group, p.q.device) for p in parts)
        how = (f"FP8 torch._scaled_mm for {w8a8} of {len(packed)} (W8A8), the others de-quantized per call"
               if w8a8 else "FP8 de-quantized per call (weight-only)")
    else:
        how = "packed-weight CPU kernel" if kernel else "de-quantized in torch"
    line = (f"quantization: {qc.describe()}, {len(packed)} of {projections} projections packed ({size:.1f} MiB), "
            f"activations {model.dtype}, {how}")
    log.info("%s", line)
    return line
