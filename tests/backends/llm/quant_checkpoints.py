"""Quantized checkpoints built from a float tiny model, as the quantizers publish them (GPTQ v1, AWQ GEMM,
compressed-tensors pack-quantized), each beside the float model of its de-quantized weights, which
transformers runs as the reference. Written here from the formats' descriptions, independently of
Pier's readers (backends/llm/models/quantization.py)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble i of a word holds column AWQ_ORDER[i] of its eight


def is_projection(name: str) -> bool:
    return name.startswith("model.layers.") and name.endswith("_proj.weight")


def pack(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unsigned values packed 32 / bits to an int32 word along `dim`, least significant first."""
    pf = 32 // bits
    v = values.to(torch.int64).movedim(dim, -1)
    v = v.reshape(*v.shape[:-1], v.shape[-1] // pf, pf)
    word = (v << (torch.arange(pf) * bits)).sum(-1)
    word = (word + 2**31) % 2**32 - 2**31  # two's complement into int32
    return word.to(torch.int32).movedim(-1, dim).contiguous()


def _copy_folder(src: Path, dst: Path, tensors: dict[str, torch.Tensor], qconfig: dict | None) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    if qconfig is not None:
        cfg = json.loads((dst / "config.json").read_text())
        cfg["quantization_config"] = qconfig
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def int8_reference(src: Path, dst: Path) -> Path:
    """The float model whose projections are issue 34's online int8 weights: per output row, scale =
    max |w| / 127, q = round(w / scale) clamped to +-127, w' = q * scale."""
    tensors = load_file(str(src / "model.safetensors"))
    for name, w in tensors.items():
        if is_projection(name):
            scale = w.abs().amax(dim=1, keepdim=True) / 127
            tensors[name] = torch.clamp(torch.round(w / scale), -127, 127) * scale
    return _copy_folder(src, dst, tensors, None)


def _group_quantize(w: torch.Tensor, bits: int, g_idx: torch.Tensor, groups: int, sym: bool
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric (or symmetric) min/max quantization of w [N, K] by input group g_idx [K]:
    (q [N, K], scales [N, G] float16-representable, zeros [N, G] in 1 .. 2^bits - 1)."""
    top = 2**bits - 1
    n = w.shape[0]
    scales, zeros = torch.empty(n, groups), torch.empty(n, groups)
    for g in range(groups):
        cols = w[:, g_idx == g]
        lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
        if sym:
            s = torch.maximum(-lo, hi) * 2 / top
            z = torch.full((n,), float(2 ** (bits - 1)))
        else:
            s = (hi - lo) / top
            z = torch.clamp(torch.round(-lo / s), 1, top)  # >= 1: GPTQ v1 stores z - 1
        scales[:, g], zeros[:, g] = s.half().float(), z
    q = torch.clamp(torch.round(w / scales[:, g_idx]) + zeros[:, g_idx], 0, top)
    return q.to(torch.int64), scales, zeros


def _dequantized(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor) -> torch.Tensor:
    return (q.float() - zeros[:, g_idx]) * scales[:, g_idx]


def quantized_pair(src: Path, out: Path, fmt: str, bits: int = 4, group: int = 32, desc_act: bool = False,
                   sym: bool = False) -> tuple[Path, Path]:
    """(quantized folder, de-quantized reference folder) of the float model in `src`, `fmt` one of
    "gptq", "awq", "compressed-tensors"."""
    tensors = load_file(str(src / "model.safetensors"))
    quantized: dict[str, torch.Tensor] = {}
    reference: dict[str, torch.Tensor] = {}
    gen = torch.Generator().manual_seed(7)
    perms: dict[tuple[str, int], torch.Tensor] = {}  # one act-order per layer input (q, k, v share theirs)
    for name, w in tensors.items():
        if not is_projection(name):
            quantized[name] = reference[name] = w
            continue
        prefix = name[: -len(".weight")]
        n, k = w.shape
        groups = k // group
        g_idx = torch.arange(k) // group
        if desc_act:
            layer_input = (prefix.rsplit(".", 2)[0], k, prefix.endswith(("o_proj", "down_proj")))
            perm = perms.setdefault(layer_input, torch.randperm(k, generator=gen))  # type: ignore[arg-type]
            g_idx = torch.empty(k, dtype=torch.int64)
            g_idx[perm] = torch.arange(k) // group
        q, scales, zeros = _group_quantize(w, bits, g_idx, groups, sym)
        reference[name] = _dequantized(q, scales, zeros, g_idx)
        writer: Callable[..., dict[str, torch.Tensor]] = _WRITERS[fmt]
        for leaf, t in writer(q, scales, zeros, g_idx, bits).items():
            quantized[f"{prefix}.{leaf}"] = t
    qconfig = _QCONFIG[fmt](bits, group, desc_act, sym)
    return (_copy_folder(src, out / f"{fmt}-{bits}bit", quantized, qconfig),
            _copy_folder(src, out / f"{fmt}-{bits}bit-dequantized", reference, None))


def _gptq(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor, bits: int
          ) -> dict[str, torch.Tensor]:
    return {"qweight": pack(q.t(), bits, 0), "qzeros": pack(zeros.t() - 1, bits, 1),
            "scales": scales.t().half().contiguous(), "g_idx": g_idx.to(torch.int32)}


def _awq(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor, bits: int
         ) -> dict[str, torch.Tensor]:
    def awq_pack(v: torch.Tensor) -> torch.Tensor:  # [R, N] -> [R, N / 8], nibble i = column AWQ_ORDER[i]
        r, n = v.shape
        return pack(v.view(r, n // 8, 8)[:, :, AWQ_ORDER].reshape(r, n), 4, 1)

    return {"qweight": awq_pack(q.t()), "qzeros": awq_pack(zeros.t()), "scales": scales.t().half().contiguous()}


def _compressed(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor, bits: int
                ) -> dict[str, torch.Tensor]:
    assert bool((zeros == 2 ** (bits - 1)).all()), "compressed-tensors W4A16/W8A16 is symmetric"
    return {"weight_packed": pack(q, bits, 1), "weight_scale": scales.half(),
            "weight_shape": torch.tensor(list(q.shape), dtype=torch.int64)}


_WRITERS = {"gptq": _gptq, "awq": _awq, "compressed-tensors": _compressed}
_QCONFIG: dict[str, Callable[[int, int, bool, bool], dict]] = {
    "gptq": lambda bits, group, desc_act, sym: {"quant_method": "gptq", "bits": bits, "group_size": group,
                                                "desc_act": desc_act, "sym": sym, "checkpoint_format": "gptq"},
    "awq": lambda bits, group, desc_act, sym: {"quant_method": "awq", "bits": bits, "group_size": group,
                                               "zero_point": True, "version": "gemm"},
    "compressed-tensors": lambda bits, group, desc_act, sym: {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "weights": {
            "num_bits": bits, "type": "int", "symmetric": True, "strategy": "group", "group_size": group}}}},
}


# FP8 checkpoints: (quant_method or compressed-tensors strategy, scale tensor name, static activations)
FP8_STYLES = {
    "fp8-block": "vLLM's / DeepSeek's `fp8` with weight_block_size: weight_scale_inv per tile",
    "fp8-tensor-static": "vLLM's `fp8`, per-tensor weight_scale and input_scale (activation_scheme static)",
    "ct-fp8-channel": "compressed-tensors float-quantized, per-channel weight_scale, dynamic per-token activations",
    "ct-fp8-block": "compressed-tensors float-quantized, block strategy, weight_scale per tile",
}
E4M3_MAX = 448.0


def _fp8_quantize(w: torch.Tensor, style: str, block: tuple[int, int]
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(E4M3 weight [N, K], scale tensor as the style stores it, each weight's scale [N, K]): scale =
    max |w| / 448 per tile, tensor or row; the codes are w / scale rounded by torch's float8 conversion."""
    n, k = w.shape
    if style.endswith("block"):
        bn, bk = block
        rows = -(-n // bn)
        scale = torch.stack([torch.stack([w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].abs().amax()
                                          for j in range(k // bk)]) for i in range(rows)]) / E4M3_MAX
        full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)
    elif style.endswith("channel"):
        scale = w.abs().amax(dim=1, keepdim=True) / E4M3_MAX
        full = scale.expand(n, k)
    else:
        scale = (w.abs().amax() / E4M3_MAX).reshape(1)
        full = scale.expand(n, k)
    return (w / full).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale.float(), full.float()


def fp8_pair(src: Path, out: Path, style: str, block: tuple[int, int] = (48, 32)) -> tuple[Path, Path]:
    """(FP8 folder, de-quantized reference folder) of the float model in `src`, `style` a key of
    FP8_STYLES; `block` (rows, columns) for the block styles (48 rows: some projections end in a
    partial tile, as ceil(out / rows) tiles)."""
    tensors = load_file(str(src / "model.safetensors"))
    quantized: dict[str, torch.Tensor] = {}
    reference: dict[str, torch.Tensor] = {}
    for name, w in tensors.items():
        if not is_projection(name):
            quantized[name] = reference[name] = w
            continue
        prefix = name[: -len(".weight")]
        q, scale, full = _fp8_quantize(w, style, block)
        reference[name] = q.float() * full
        quantized[f"{prefix}.weight"] = q
        quantized[f"{prefix}.{'weight_scale_inv' if style == 'fp8-block' else 'weight_scale'}"] = scale
        if style == "fp8-tensor-static":
            quantized[f"{prefix}.input_scale"] = torch.tensor([0.05])
    if style.startswith("fp8"):
        qconfig: dict = {"quant_method": "fp8", "fmt": "e4m3",
                         "activation_scheme": "static" if style.endswith("static") else "dynamic"}
        if style.endswith("block"):
            qconfig["weight_block_size"] = list(block)
    else:
        weights: dict = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
                         "strategy": "block" if style.endswith("block") else "channel"}
        if style.endswith("block"):
            weights["block_structure"] = list(block)
        qconfig = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
                   "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": {
                       "num_bits": 8, "type": "float", "symmetric": True, "dynamic": True, "strategy": "token"}}}}
    return (_copy_folder(src, out / style, quantized, qconfig),
            _copy_folder(src, out / f"{style}-dequantized", reference, None))
