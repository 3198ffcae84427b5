"""Quantized projections on CPU (issue 34, part 2): the packed-weight kernel vs de-quantize-then-matmul vs
the float weight, per number of rows (a decode step's batch; a prefill's tokens).

One projection the size of a few-hundred-million-parameter model's MLP (2,048 x 5,632, float32
activations), int8 per output row and 4-bit in groups of 128, each path timed in interleaved rounds:

- float: the float32 weight through oneDNN (the engine's unquantized path, layers/linear.py);
- fused: csrc/quant_linear.cpp reading the packed bytes (de-quantized in registers);
- dequant+mm: the weight de-quantized into a float buffer (the same C++ code), then a float GEMM;
- torch int8: torch's own `_weight_int8pack_mm` (for reference).
The engine keeps whichever is faster (layers/quantized.py: the fused kernel at every row count).

    .venv/bin/python -m bench.quant_kernels      # ~2 minutes; writes bench/results/quant_kernels.{json,md}
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from pier.backends.llm import kernels
from pier.backends.llm.layers.quantized import PackedWeight, quantize_int8

RESULTS = Path(__file__).resolve().parent / "results"
N, K = 5632, 2048
ROWS = (1, 4, 8, 16, 32, 64, 128, 256)


def _time(fn: Callable[[], object], reps: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    ops = kernels.load()
    assert ops is not None, "the CPU kernels did not build"
    torch.manual_seed(0)
    w = torch.randn(N, K) * 0.05
    int8 = quantize_int8(w)
    g = 128
    lo = w.view(N, K // g, g).amin(2).clamp(max=0)
    hi = w.view(N, K // g, g).amax(2).clamp(min=0)
    s4 = (hi - lo) / 15
    z4 = torch.clamp(torch.round(-lo / s4), 0, 15)
    q4 = torch.clamp(torch.round(w / s4.repeat_interleave(g, 1)) + z4.repeat_interleave(g, 1), 0, 15)
    int4 = PackedWeight.from_values(q4, s4, z4, 4, g)
    w_onednn = torch.ops.mkldnn._reorder_linear_weight(w, 64)
    q_signed = (int8.q.to(torch.int16) - 128).to(torch.int8)
    s_row = int8.scales.view(-1).contiguous()

    def fused(p: PackedWeight, x: torch.Tensor) -> Callable[[], object]:
        out = torch.empty(x.shape[0], N)
        return lambda: ops.quant_linear(out, x, p.q, p.scales, p.zeros, p.bits, p.group, p.offset)

    buf = torch.empty(N, K)  # the engine keeps one such buffer (layers/quantized._scratch)

    def dequant(p: PackedWeight, x: torch.Tensor) -> Callable[[], object]:
        def run() -> object:
            ops.quant_dequantize(buf, p.q, p.scales, p.zeros, p.bits, p.group, p.offset)
            return torch.mm(x, buf.t())
        return run

    results: dict[str, dict[str, list[float]]] = {}
    for _ in range(args.rounds):
        for m in ROWS:
            x = torch.randn(m, K)
            reps = max(3, 200 // m)
            paths: dict[str, Callable[[], object]] = {
                "float (oneDNN)": lambda x=x: torch.ops.mkldnn._linear_pointwise(x, w_onednn, None, "none", [], ""),
                "int8 fused": fused(int8, x), "int8 dequant+mm": dequant(int8, x),
                "int4 fused": fused(int4, x), "int4 dequant+mm": dequant(int4, x),
                "int8 torch _weight_int8pack_mm": lambda x=x: torch.ops.aten._weight_int8pack_mm(x, q_signed, s_row),
            }
            for name, fn in paths.items():
                results.setdefault(str(m), {}).setdefault(name, []).append(_time(fn, reps))
    table = {m: {name: statistics.median(v) for name, v in by.items()} for m, by in results.items()}
    meta = {"shape": [N, K], "threads": torch.get_num_threads(), "rounds": args.rounds, "cpu": platform.processor(),
            "torch": torch.__version__}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "quant_kernels.json").write_text(json.dumps({"meta": meta, "us": results}, indent=1))
    names = list(next(iter(table.values())))
    lines = ["# Quantized projections on CPU: microseconds per product (median of rounds)", "",
             f"{N} x {K} weight, float32 activations, {torch.get_num_threads()} threads, {args.rounds} interleaved "
             "rounds; the 2 cores are shared with other work on this machine. int4: groups of 128.", "",
             "| rows | " + " | ".join(names) + " | int8 fused / float | int4 fused / float |",
             "|---:|" + "---:|" * (len(names) + 2)]
    for m, row in table.items():
        f = row["float (oneDNN)"]
        lines.append(f"| {m} | " + " | ".join(f"{row[n]:.0f}" for n in names)
                     + f" | {row['int8 fused'] / f:.2f} | {row['int4 fused'] / f:.2f} |")
    (RESULTS / "quant_kernels.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
