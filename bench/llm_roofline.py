"""How far the hardware lets a decode step go (issue 33): FLOPs and bytes of one decode step of a
Llama-style model at M sequences, against this CPU's measured GEMM throughput (float32 and bfloat16,
torch's oneDNN/MKL matmul on all cores, at the step's own shapes and at a large square) and its
measured memory bandwidth. Writes bench/results/llm_roofline.{md,json}.

    .venv/bin/python -m bench.llm_roofline [--model FOLDER] [--seqs 64] [--context 100]

The floor it reports is the step's GEMM FLOPs at the measured decode-shape throughput plus its
attention bytes at the measured bandwidth: a lower bound on a step's time, so an upper bound on the
output tokens/s any engine can reach on this machine with that dtype. Run it with the CPU lock held.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from bench.common import loadavg, machine
from bench.llm_bench import RESULTS, log
from bench.llm_real_model import build_model


def _best(fn: Any, seconds: float = 1.5) -> float:
    """Best-of time of one call (after a warm-up), over about `seconds`."""
    fn()
    best, end = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < end:
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def gemm_gflops(m: int, k: int, n: int, dtype: Any) -> float:
    """The better of the two CPU GEMMs torch offers: oneDNN's matmul on a weight reordered once (what
    Pier's `OneDNNLinearMethod` and inductor's frozen linears run) and MKL's `mm`."""
    import torch

    from pier.backends.llm.layers.linear import ONEDNN_BATCH_HINT

    a, w = torch.randn(m, k).to(dtype), torch.randn(n, k).to(dtype)
    wt = w.t().contiguous()
    out = torch.empty(m, n, dtype=dtype)
    best = _best(lambda: torch.mm(a, wt, out=out))
    if torch.backends.mkldnn.is_available():
        packed = torch.ops.mkldnn._reorder_linear_weight(w, ONEDNN_BATCH_HINT)
        best = min(best, _best(lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], "")))
    return 2 * m * k * n / best / 1e9


def bandwidth_gbs() -> float:
    """Read bandwidth: summing a 512 MiB float32 tensor (well past every cache)."""
    import torch

    x = torch.ones(128 << 20)
    return x.numel() * 4 / _best(lambda: x.sum(), 2.0) / 1e9


def step_shapes(cfg: dict[str, Any], seqs: int) -> list[tuple[str, int, int, int, int]]:
    """(what, M, K, N, times per step) of every GEMM in one decode step."""
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    return [("QKV projection", seqs, h, q + 2 * kv, layers), ("output projection", seqs, q, h, layers),
            ("gate + up projection", seqs, h, 2 * inter, layers), ("down projection", seqs, inter, h, layers),
            ("LM head", seqs, h, cfg["vocab_size"], 1)]


def measure(folder: Path, seqs: int, context: int) -> dict[str, Any]:
    import torch

    cfg = json.loads((folder / "config.json").read_text())
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    layers, kvh, heads = cfg["num_hidden_layers"], cfg["num_key_value_heads"], cfg["num_attention_heads"]
    res: dict[str, Any] = {"model": folder.name, "seqs": seqs, "context": context, "threads": torch.get_num_threads(),
                           "machine": machine(), "load": loadavg(), "dtypes": {}}
    log("memory bandwidth")
    res["bandwidth_gbs"] = bw = bandwidth_gbs()
    for name, dt, size in (("float32", torch.float32, 4), ("bfloat16", torch.bfloat16, 2)):
        log(f"{name} GEMMs")
        shapes, flops, wbytes, secs = [], 0.0, 0.0, 0.0
        for what, m, k, n, times in step_shapes(cfg, seqs):
            g = gemm_gflops(m, k, n, dt)
            f = 2 * m * k * n * times
            shapes.append({"what": what, "m": m, "k": k, "n": n, "per_step": times, "gflops": g})
            flops += f
            wbytes += k * n * size * times
            secs += f / (g * 1e9)
        # attention at `context` tokens: read K and V of every layer; 4 FLOPs per (token, head, dim)
        att_bytes = 2 * context * kvh * hd * size * layers * seqs
        att_flops = 4 * context * heads * hd * layers * seqs
        floor = secs + att_bytes / (bw * 1e9)
        res["dtypes"][name] = {
            "square_gflops": gemm_gflops(2048, 2048, 2048, dt), "gemms": shapes, "gemm_flops": flops,
            "weight_bytes": wbytes, "attention_bytes": att_bytes, "attention_flops": att_flops,
            "gemm_s": secs, "floor_s": floor, "max_tok_s": seqs / floor}
    return res


def write(res: dict[str, Any], name: str) -> Path:
    lines = [f"# Roofline of a decode step: {res['model']}, {res['seqs']} sequences, ~{res['context']} tokens of "
             "context each", "", f"Machine: {res['machine']}, torch on {res['threads']} threads — the 2 cores are "
             f"the whole machine (load average {res['load']} at the start; other work shares them).", "",
             f"Measured read bandwidth: {res['bandwidth_gbs']:.1f} GB/s.", "",
             "| dtype | GEMM GFLOP/s, 2048² square | GFLOP per step (GEMMs) | weight MB per step | attention MB per "
             "step | floor per step | max output tok/s |", "|---|---|---|---|---|---|---|"]
    for dt, d in res["dtypes"].items():
        lines.append(f"| {dt} | {d['square_gflops']:.0f} | {d['gemm_flops'] / 1e9:.1f} | {d['weight_bytes'] / 1e6:.0f}"
                     f" | {d['attention_bytes'] / 1e6:.0f} | {d['floor_s'] * 1e3:.0f} ms | {d['max_tok_s']:.0f} |")
    lines += ["", "GEMM throughput at the step's own shapes (GFLOP/s):", "",
              "| GEMM | M×K×N | per step | " + " | ".join(res["dtypes"]) + " |", "|---|---|---|" + "---|" *
              len(res["dtypes"])]
    dts = list(res["dtypes"].values())
    for i, g in enumerate(dts[0]["gemms"]):
        lines.append(f"| {g['what']} | {g['m']}×{g['k']}×{g['n']} | {g['per_step']} | " +
                     " | ".join(f"{d['gemms'][i]['gflops']:.0f}" for d in dts) + " |")
    lines += ["", "The floor is the GEMMs at those measured rates plus reading every layer's K and V at the measured "
              "bandwidth; norms, rotary, sampling, scheduling and serving come on top, so no engine's step on this "
              "machine is shorter and no engine's output tok/s (at this batch and dtype) is higher.", "",
              "Measured with `python -m bench.llm_roofline`.", ""]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(res, indent=2))
    md = RESULTS / f"{name}.md"
    md.write_text("\n".join(lines))
    return md


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path)
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--context", type=int, default=100, help="mean tokens of context per sequence")
    ap.add_argument("--name", default="llm_roofline")
    a = ap.parse_args()
    folder = a.model or build_model()
    if isinstance(folder, str):
        log(folder)
        return
    print(write(measure(folder, a.seqs, a.context), a.name).read_text())


if __name__ == "__main__":
    main()
