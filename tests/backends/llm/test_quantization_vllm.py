"""A GPTQ 4-bit checkpoint packed in the tests, on Pier and on vLLM's CPU build (issue 34, part 2): Pier
(float32) equals transformers on the de-quantized weights token for token; vLLM 0.32's CPU build runs
GPTQ only with 16-bit activations (float32 is refused), symmetric, without desc_act, layer widths
multiples of 32 (bench/results/quant_vllm_gptq.md has its refusals), so it is compared within a
tolerance: greedy steps equal before the first difference and prompt logprobs.

Measured here (vLLM bfloat16, 6 prompts of 3-64 tokens, 16 greedy steps): 94 of 96 steps equal (one
prompt differs from step 14), prompt logprobs 0.026 apart on average, 0.235 at most (156 positions);
float16: all 96 equal, 0.003 / 0.022. The bounds below leave room for another CPU's bfloat16 rounding.
Skips where vLLM's CPU build is not installed (~/vllm-ref)."""

from __future__ import annotations

import pytest

from pier.backends.llm.config import EngineConfig
from pier.backends.llm.engine import LLMEngine
from pier.backends.llm.sampling_params import SamplingParams

from .quant_checkpoints import quantized_pair
from .tiny_model import build_model, engine_prompt_logprobs, hf_greedy
from .vllm_reference import VLLM_PYTHON, agreement, run_vllm

pytestmark = pytest.mark.skipif(not VLLM_PYTHON.is_file(), reason=f"vLLM's CPU build is not installed ({VLLM_PYTHON}; "
                                "$PIER_REFERENCE_TOOLS/vllm-reference/install.sh ~/vllm-ref)")

# head_dim 32 (vLLM's CPU attention), every projection's width a multiple of 32 (its GPTQ kernel)
SIZE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
STEPS = 16


def test_gptq_4bit_vllm_cpu_within_tolerance(tmp_path, prompts):
    float_dir = build_model(tmp_path / "float", "llama", seed=3, **SIZE)
    quantized, dequantized = quantized_pair(float_dir, tmp_path, "gptq", 4, 32, desc_act=False, sym=True)
    eng = LLMEngine(quantized, EngineConfig(kv_cache_memory_bytes=4 << 20))
    ours = [o[0] for o in eng.generate(prompts, SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True))]
    assert ours == hf_greedy(dequantized, prompts, STEPS)
    theirs = run_vllm(quantized, prompts, STEPS, "bfloat16")
    figures = agreement(ours, theirs["tokens"], engine_prompt_logprobs(eng, prompts), theirs["prompt_logprobs"])
    assert figures["positions"] == sum(len(p) - 1 for p in prompts)
    assert figures["share_equal"] >= 0.8, figures
    assert figures["logprob_mean_diff"] < 0.06 and figures["logprob_max_diff"] < 0.5, figures
