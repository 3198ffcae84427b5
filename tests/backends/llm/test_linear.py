"""`Linear`'s CPU methods, and the engine's CPU bfloat16: bfloat16 GEMMs under float32 activations."""

from __future__ import annotations

import json

import pytest
import torch

from pier.backends.llm.config import EngineConfig
from pier.backends.llm.engine import LLMEngine
from pier.backends.llm.layers.linear import Linear, OneDNNLinearMethod, onednn_available
from pier.backends.llm.sampling_params import SamplingParams

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(not onednn_available(torch.bfloat16, CPU), reason="torch without oneDNN here")


def test_bfloat16_gemm_on_float32_activations():
    """The weight is stored in bfloat16, the product is bfloat16's and comes back float32, with the
    bias and the residual added in float32."""
    torch.manual_seed(0)
    parts, bias = [torch.randn(32, 64), torch.randn(16, 64)], torch.randn(48)
    lin = Linear("t", 64, (32, 16), True, torch.float32, CPU, OneDNNLinearMethod(torch.bfloat16))
    for i, w in enumerate(parts):
        lin.load(i, w)
        lin.load(i, bias[:32] if i == 0 else bias[32:], "bias")
    lin.finish()
    assert lin.weight is not None and lin.weight.dtype == torch.bfloat16
    x = torch.randn(8, 64)
    w = torch.cat(parts).bfloat16().float()
    ref = x.bfloat16().float() @ w.T
    y = lin(x)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, ref + bias, rtol=1e-2, atol=1e-2)
    residual = torch.randn(8, 48)
    torch.testing.assert_close(lin(x, residual.clone()), residual + ref + bias, rtol=1e-2, atol=1e-2)


def test_engine_cpu_bfloat16_runs_bf16_projections_on_float32(llama_dir, prompts):
    """dtype bfloat16 on CPU: every projection (LM head included) a bfloat16 oneDNN GEMM, while the
    activations, the KV cache and the compiled kernels stay float32; greedy answers stay close to
    float32's (the same first token for most prompts of a random-weight model)."""
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    bf = LLMEngine(llama_dir, EngineConfig(dtype="bfloat16", kv_cache_memory_bytes=4 << 20))
    methods = [lin.method for layer in bf.model.layers for lin in layer.linears]
    assert bf.model.lm_head.linear is not None
    methods.append(bf.model.lm_head.linear.method)
    assert all(isinstance(m, OneDNNLinearMethod) and m.gemm_dtype == torch.bfloat16 for m in methods)
    assert bf.model.dtype == torch.float32 and bf.runner.kv_caches[0][0].dtype == torch.float32
    assert bf.runner.decode_op is not None
    fp = LLMEngine(llama_dir, EngineConfig(kv_cache_memory_bytes=4 << 20))
    got, want = bf.generate(prompts, greedy), fp.generate(prompts, greedy)
    assert all(len(o[0]) == 8 for o in got)
    assert sum(g[0][0] == w[0][0] for g, w in zip(got, want)) >= len(prompts) // 2


def test_dtype_auto_is_bfloat16_for_a_bfloat16_checkpoint_on_cpu(llama_dir, tmp_path):
    """A served model's default dtype, "auto": a checkpoint whose config says bfloat16 (transformers
    5's `dtype` or the older `torch_dtype`) runs CPU bfloat16; a float32 one runs float32."""
    import shutil

    params = {"kv_cache_memory_bytes": str(4 << 20)}  # a served model's parameters: no dtype set
    default = LLMEngine.from_parameters(llama_dir, params)
    assert default.model.layers[0].o_proj.method.gemm_dtype is None  # type: ignore[attr-defined]
    for key in ("dtype", "torch_dtype"):
        folder = tmp_path / key
        shutil.copytree(llama_dir, folder)
        raw = json.loads((folder / "config.json").read_text())
        raw.pop("dtype", None)
        raw[key] = "bfloat16"
        (folder / "config.json").write_text(json.dumps(raw))
        eng = LLMEngine.from_parameters(folder, params)
        assert eng.model.layers[0].o_proj.method.gemm_dtype == torch.bfloat16  # type: ignore[attr-defined]
        assert eng.model.dtype == torch.float32
        in_code = LLMEngine(folder, EngineConfig(kv_cache_memory_bytes=4 << 20))  # EngineConfig's own: float32
        assert in_code.model.layers[0].o_proj.method.gemm_dtype is None  # type: ignore[attr-defined]
