"""Each architecture beyond Llama equals transformers: greedy generate token for token over 32 tokens
on several prompts (some longer than a sliding window), through both decode paths (the compiled
kernel and the torch reference), and every prompt token's logprob within 2e-3."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from pier.backends.llm.config import EngineConfig
from pier.backends.llm.engine import LLMEngine
from pier.backends.llm.sampling_params import SamplingParams

from .tiny_model import build_model, hf_greedy


@pytest.fixture(scope="module")
def long_prompts() -> list[list[int]]:
    """Lengths around and well past the 8- and 12-token windows the tests set (and a block's 4 tokens)."""
    rng = random.Random(7)
    return [[rng.randrange(2, 320) for _ in range(n)] for n in (3, 9, 23, 50)]


def engine(folder: Path, **kw: object) -> LLMEngine:
    kw.setdefault("kv_cache_memory_bytes", 4 << 20)
    kw.setdefault("block_size", 4)
    return LLMEngine(folder, EngineConfig(**kw))  # type: ignore[arg-type]


def prompt_logprobs(eng: LLMEngine, prompts: list[list[int]]) -> list[list[float]]:
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, prompt_logprobs=0)
    for i, p in enumerate(prompts):
        eng.add_request(f"lp{i}", p, params)
    got: dict[str, list[float]] = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.prompt_logprobs is not None:
                got[out.request_id] = [lp for _, lp, _ in out.prompt_logprobs[1:]]
    return [got[f"lp{i}"] for i in range(len(prompts))]


def assert_equals_transformers(folder: Path, prompts: list[list[int]], max_tokens: int = 32,
                               **kw: object) -> LLMEngine:
    """Greedy over 32 tokens through the kernel and the torch path (with chunked prefill and prefix
    caching on the second pass), and prompt logprobs within 2e-3 of transformers' forward."""
    import transformers

    ref = hf_greedy(folder, prompts, max_tokens)
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    eng = None
    for attention in ("auto", "torch"):
        eng = engine(folder, attention=attention, max_num_batched_tokens=16, **kw)
        assert [o[0] for o in eng.generate(prompts, greedy)] == ref, attention
        assert [o[0] for o in eng.generate(prompts[::-1], greedy)] == ref[::-1], attention  # prefix-cached
    assert eng is not None
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for prompt, got in zip(prompts, prompt_logprobs(eng, prompts)):
        with torch.no_grad():
            lp = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
        want = [float(lp[i - 1, prompt[i]]) for i in range(1, len(prompt))]
        assert got == pytest.approx(want, abs=2e-3)
    return eng


def test_mistral_attends_through_its_sliding_window(tmp_path, long_prompts):
    folder = build_model(tmp_path / "mistral", "mistral", seed=11, sliding_window=8)
    eng = assert_equals_transformers(folder, long_prompts)
    assert eng.max_model_len > 8  # the window no longer caps the context
    assert [layer.attn.window for layer in eng.model.layers] == [8, 8]


def test_qwen2_slides_on_the_layers_the_config_names(tmp_path, long_prompts):
    folder = build_model(tmp_path / "qwen2", "qwen2", seed=12, use_sliding_window=True, sliding_window=12,
                         max_window_layers=1)
    eng = assert_equals_transformers(folder, long_prompts)
    assert [layer.attn.window for layer in eng.model.layers] == [0, 12]


def test_qwen3_norms_q_and_k_per_head(tmp_path, long_prompts):
    """Qwen3: q/k RMSNorm, head_dim 32 while hidden / heads is 16, o bias with attention_bias."""
    folder = build_model(tmp_path / "qwen3", "qwen3", seed=13, random_norms=True, head_dim=32, attention_bias=True)
    eng = assert_equals_transformers(folder, long_prompts)
    layer = eng.model.layers[0]
    assert type(eng.model).__name__ == "Qwen3ForCausalLM" and layer.o_proj.bias is not None


def test_gemma2_caps_scores_and_slides_on_every_other_layer(tmp_path, long_prompts):
    """Gemma 2: (1 + w) norms around both blocks, GeGLU, scaled embeddings, tied head, the scale from
    query_pre_attn_scalar, attention and final logit soft-capping, a window of 8 on layer 0 only."""
    folder = build_model(tmp_path / "gemma2", "gemma2", seed=14, random_norms=True, head_dim=32,
                         query_pre_attn_scalar=24, sliding_window=8, attn_logit_softcapping=5.0,
                         final_logit_softcapping=10.0, tie_word_embeddings=True)
    eng = assert_equals_transformers(folder, long_prompts)
    assert [(layer.attn.window, layer.attn.softcap) for layer in eng.model.layers] == [(8, 5.0), (0, 5.0)]


def test_gemma3_has_local_and_global_rope(tmp_path, long_prompts):
    """Gemma 3 (text): q/k norms, a RoPE base of its own on the sliding layer, linear scaling on the
    global one only."""
    folder = build_model(tmp_path / "gemma3", "gemma3_text", seed=15, random_norms=True, head_dim=32,
                         query_pre_attn_scalar=24, sliding_window=8, tie_word_embeddings=True,
                         layer_types=["sliding_attention", "full_attention"],
                         rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                          "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                             "rope_theta": 1000.0}})
    eng = assert_equals_transformers(folder, long_prompts)
    local, full = (layer.attn for layer in eng.model.layers)
    assert local.window == 8 and full.window == 0 and local.rope is not full.rope


def test_phi3_fused_checkpoint_partial_rotary_and_sliding_window(tmp_path, long_prompts):
    """Phi-3: fused qkv_proj and gate_up_proj tensors, half of each head rotating, a window of 8."""
    folder = build_model(tmp_path / "phi3", "phi3", seed=16, random_norms=True, partial_rotary_factor=0.5,
                         sliding_window=8, pad_token_id=0)
    eng = assert_equals_transformers(folder, long_prompts)
    assert eng.model.rope.rotary_dim == 8 and eng.model.layers[0].attn.window == 8


def test_phi3_longrope_short_and_long_factors(tmp_path):
    """LongRoPE (short and long factors, original_max_position_embeddings 32) with a partial rotary
    factor: greedy within the first 32 positions (the short factors, as transformers), and the
    rotations from position 32 on are transformers' long-factor ones. (Past that length transformers
    recomputes the whole cache with the long factors; the keys cached here keep theirs, as vLLM's.)"""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "longrope", "rope_theta": 500.0, "short_factor": [1.0, 1.5, 2.0, 3.0],
            "long_factor": [2.0, 4.0, 8.0, 16.0], "original_max_position_embeddings": 32}
    folder = build_model(tmp_path / "phi3", "phi3", seed=17, partial_rotary_factor=0.5, rope_parameters=rope,
                         original_max_position_embeddings=32, max_position_embeddings=128, pad_token_id=0)
    rng = random.Random(8)
    prompts = [[rng.randrange(2, 320) for _ in range(n)] for n in (3, 9, 20)]
    eng = assert_equals_transformers(folder, prompts, max_tokens=12)
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    expected = eng.generate(prompts, greedy)
    config = transformers.AutoConfig.from_pretrained(folder)
    short, scale = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu")
    long, _ = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=33)
    table = eng.model.rope.freqs_cis
    for pos, inv_freq in ((5, short), (31, short), (32, long), (100, long)):
        want = torch.polar(torch.full((4,), scale), pos * inv_freq)
        torch.testing.assert_close(table[pos, :4], want)
        assert bool((table[pos, 4:] == 1).all())  # the half of each head that does not rotate
    # The same checkpoint's config.json as transformers 4.x wrote it (Phi-3-mini-128k's form; "su" early on)
    raw = json.loads((folder / "config.json").read_text())
    params = raw.pop("rope_parameters")
    raw.update(rope_theta=params.pop("rope_theta"), partial_rotary_factor=params.pop("partial_rotary_factor"),
               rope_scaling={**{k: v for k, v in params.items() if k != "rope_type"}, "type": "su"})
    (folder / "config.json").write_text(json.dumps(raw))
    old = engine(folder)
    assert old.model_config.rope == eng.model_config.rope and old.generate(prompts, greedy) == expected


def test_mixtral_routes_each_token_to_its_top_2_of_4_experts(tmp_path, long_prompts):
    folder = build_model(tmp_path / "mixtral", "mixtral", seed=18, num_local_experts=4, num_experts_per_tok=2,
                         sliding_window=12)
    eng = assert_equals_transformers(folder, long_prompts)
    assert all(layer.moe is not None and layer.moe.num_experts == 4 for layer in eng.model.layers)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_qwen3_moe_sparse_and_dense_layers(tmp_path, long_prompts, norm_topk_prob):
    """Qwen3-MoE: 3 of 8 experts per token, layer 1 dense (mlp_only_layers), q/k norms; the config
    as transformers 5.x writes it (`num_local_experts`) and as 4.x did (`num_experts`)."""
    folder = build_model(tmp_path / "qwen3_moe", "qwen3_moe", seed=19, random_norms=True, num_hidden_layers=3,
                         num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, mlp_only_layers=[1],
                         norm_topk_prob=norm_topk_prob)
    if not norm_topk_prob:
        raw = json.loads((folder / "config.json").read_text())
        raw["num_experts"] = raw.pop("num_local_experts")
        (folder / "config.json").write_text(json.dumps(raw))
    eng = assert_equals_transformers(folder, long_prompts)
    assert [layer.moe is not None for layer in eng.model.layers] == [True, False, True]


def test_qwen2_moe_adds_its_gated_shared_expert(tmp_path, long_prompts):
    """Qwen2-MoE: 2 of 4 routed experts plus a shared expert of width 48 behind a sigmoid gate,
    q/k/v biases, layer 1 dense."""
    folder = build_model(tmp_path / "qwen2_moe", "qwen2_moe", seed=20, num_hidden_layers=3, num_experts=4,
                         num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                         mlp_only_layers=[1])
    eng = assert_equals_transformers(folder, long_prompts)
    assert [layer.shared is not None for layer in eng.model.layers] == [True, False, True]
    assert eng.model.layers[0].qkv_proj.bias is not None
