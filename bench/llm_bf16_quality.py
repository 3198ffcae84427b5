"""bfloat16's answers against float32's on the real model (issue 33): is CPU bfloat16 "equal quality"?

The 64 chat prompts of bench/llm_real_model.py, greedy, 128 tokens each (ignore_eos), answered by
Pier's engine in float32 (token for token transformers' float32 greedy: tests/e2e/test_llm_real_model.py),
by Pier's CPU bfloat16 (bfloat16 GEMMs on float32 activations, engine._dtypes) and by transformers
with the whole model in bfloat16 (what bfloat16 everywhere gives, as vLLM's CPU bfloat16 runs it).
Reported for each bfloat16 run against float32: answers identical token for token, and the mean
number of tokens before the first difference. Writes bench/results/llm_bf16_quality.{md,json}.

    .venv/bin/python -m bench.llm_bf16_quality
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from bench.common import loadavg, machine
from bench.llm_bench import RESULTS, log
from bench.llm_real_model import TOKENS, build_model, chats


def _pier(folder: Path, prompts: list[list[int]], dtype: str) -> list[list[int]]:
    from pier.backends.llm.config import EngineConfig
    from pier.backends.llm.engine import LLMEngine
    from pier.backends.llm.sampling_params import SamplingParams

    eng = LLMEngine(folder, EngineConfig(kv_cache_memory_bytes=1 << 30, dtype=dtype))
    out = eng.generate(prompts, SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True))
    return [o[0] for o in out]


def _hf_bf16(folder: Path, prompts: list[list[int]]) -> list[list[int]]:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    width = max(map(len, prompts))
    pad = model.config.pad_token_id or 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=TOKENS, min_new_tokens=TOKENS,
                             do_sample=False, pad_token_id=pad)
    return [row[width:].tolist() for row in out]


def _agreement(ref: list[list[int]], got: list[list[int]]) -> dict[str, Any]:
    def common(a: list[int], b: list[int]) -> int:
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return {"same": sum(a == b for a, b in zip(ref, got)), "of": len(ref),
            "mean_common_prefix": statistics.mean(common(a, b) for a, b in zip(ref, got))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    a = ap.parse_args()
    folder = build_model()
    if isinstance(folder, str):
        log(folder)
        return
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(folder)
    prompts = [list(tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=True)
                    ["input_ids"]) for c in chats(a.requests)]
    log("Pier float32")
    ref = _pier(folder, prompts, "float32")
    log("Pier CPU bfloat16")
    runs = {"Pier CPU bfloat16 (bfloat16 GEMMs, float32 activations)": _pier(folder, prompts, "bfloat16")}
    log("transformers, the whole model in bfloat16")
    runs["transformers bfloat16 everywhere"] = _hf_bf16(folder, prompts)
    res = {"machine": machine(), "load": loadavg(), "requests": a.requests, "tokens": TOKENS,
           "against_float32": {k: _agreement(ref, v) for k, v in runs.items()}}
    lines = [f"# bfloat16 against float32: SmolLM2-135M-Instruct, {a.requests} chat prompts, greedy, {TOKENS} "
             "tokens", "", "Each bfloat16 run's answers against Pier's float32 answers (which equal transformers' "
             "float32 greedy token for token).", "", "| run | answers identical | mean tokens before the first "
             "difference |", "|---|---|---|"]
    for k, v in res["against_float32"].items():
        lines.append(f"| {k} | {v['same']} of {v['of']} | {v['mean_common_prefix']:.1f} of {TOKENS} |")
    lines += ["", f"Machine: {res['machine']}. Measured with `python -m bench.llm_bf16_quality`.", ""]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "llm_bf16_quality.json").write_text(json.dumps(res, indent=2))
    (RESULTS / "llm_bf16_quality.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
