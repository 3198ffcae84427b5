"""A GPTQ 4-bit checkpoint on Pier and on vLLM's CPU build (issue 34, part 2): the figures behind
tests/backends/llm/test_quantization_vllm.py, for both 16-bit activations vLLM's CPU GPTQ takes, and
what it refuses (float32 activations, asymmetric zero points, desc_act), in its own words.

The test's folder: a random-weight Llama (hidden 128, intermediate 256, 4 heads of 32, 2 KV heads, 2
layers, vocabulary 320) packed by the tests' packer (tests/backends/llm/quant_checkpoints.py) as GPTQ
v1, 4 bits, group 32, symmetric, no desc_act. Pier runs it in float32 (equal to transformers on the
de-quantized weights token for token); vLLM 0.32 (CPU build, ~/vllm-ref, enforce_eager, block size 32)
in bfloat16 and float16: 16 greedy steps on 6 prompts of 3-64 tokens, and each prompt token's logprob.
A correctness comparison, not a timing.

    .venv/bin/python -m bench.quant_vllm_gptq     # ~5 minutes; writes bench/results/quant_vllm_gptq.{json,md}
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def main() -> None:
    sys.path.insert(0, str(ROOT))
    from pier.backends.llm.config import EngineConfig
    from pier.backends.llm.engine import LLMEngine
    from pier.backends.llm.sampling_params import SamplingParams
    from tests.backends.llm.quant_checkpoints import quantized_pair
    from tests.backends.llm.test_quantization_vllm import SIZE, STEPS
    from tests.backends.llm.tiny_model import build_model, engine_prompt_logprobs, hf_greedy
    from tests.backends.llm.vllm_reference import VLLM_PYTHON, agreement, run_vllm

    if not VLLM_PYTHON.is_file():
        sys.exit(f"vLLM's CPU build is not installed ({VLLM_PYTHON}); nothing to compare")
    rng = random.Random(0)  # the tests' `prompts` fixture
    prompts = [[rng.randrange(2, 320) for _ in range(n)] for n in (3, 17, 40, 5, 64, 33)]
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        float_dir = build_model(base / "float", "llama", seed=3, **SIZE)
        folder, dequantized = quantized_pair(float_dir, base, "gptq", 4, 32, desc_act=False, sym=True)
        eng = LLMEngine(folder, EngineConfig(kv_cache_memory_bytes=4 << 20))
        ours = [o[0] for o in eng.generate(prompts, SamplingParams(max_tokens=STEPS, temperature=0,
                                                                   ignore_eos=True))]
        exact = ours == hf_greedy(dequantized, prompts, STEPS)
        ours_lp = engine_prompt_logprobs(eng, prompts)
        runs = {}
        for dtype in ("bfloat16", "float16"):
            got = run_vllm(folder, prompts, STEPS, dtype)
            runs[dtype] = agreement(ours, got["tokens"], ours_lp, got["prompt_logprobs"])
        refusals = {}
        variants = {"float32 activations": (folder, "float32"),
                    "asymmetric (sym false)": (quantized_pair(float_dir, base / "asym", "gptq", 4, 32, False,
                                                              False)[0], "bfloat16"),
                    "desc_act true": (quantized_pair(float_dir, base / "desc", "gptq", 4, 32, True, True)[0],
                                      "bfloat16")}
        for name, (path, dtype) in variants.items():
            try:
                run_vllm(path, prompts[:1], 2, dtype)
                refusals[name] = "runs"
            except RuntimeError as exc:
                refusals[name] = str(exc)
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "quant_vllm_gptq.json").write_text(json.dumps(
        {"when": when, "size": SIZE, "steps": STEPS, "prompts": prompts, "pier_equals_transformers": exact,
         "vllm": runs, "refusals": refusals}, indent=1))
    lines = ["# GPTQ 4-bit: Pier vs vLLM's CPU build on the same folder", "",
             f"`python -m bench.quant_vllm_gptq` ({when}). " + (__doc__ or "").split("\n\n")[1].replace("\n", " "),
             "", f"Pier float32 equals transformers on the de-quantized weights: {'yes' if exact else 'NO'}.", "",
             "| vLLM activations | prompts identical | greedy steps equal before the first difference | "
             "prompt logprob diff mean | max |", "|---|---:|---:|---:|---:|"]
    for dtype, f in runs.items():
        lines.append(f"| {dtype} | {f['identical']} of {f['prompts']} | {sum(f['steps_equal'])} of "
                     f"{STEPS * f['prompts']} ({', '.join(map(str, f['steps_equal']))}) | "
                     f"{f['logprob_mean_diff']:.4f} | {f['logprob_max_diff']:.4f} ({f['positions']} positions) |")
    lines += ["", "The test's tolerance (tests/backends/llm/test_quantization_vllm.py, bfloat16): at least 80 % of "
              "the greedy steps equal before the first difference, prompt logprobs under 0.06 apart on average "
              "and 0.5 at most.", "", "What vLLM 0.32's CPU build refuses on the same model (its words):", "",
              "| checkpoint / setting | vLLM |", "|---|---|"]
    lines += [f"| {name} | {text} |" for name, text in refusals.items()]
    (RESULTS / "quant_vllm_gptq.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
