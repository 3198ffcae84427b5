"""The compiled paged decode-attention kernel against plain torch attention over gathered blocks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from backends.llm import kernels


@pytest.fixture(scope="module")
def op():
    fn = kernels.paged_decode_attention()
    if fn is None:
        pytest.skip("the C++ kernel did not build here (no compiler?); the engine uses torch attention")
    return fn


def reference(q, k_t, v, tables, lens, scale):
    """q [B, H, D]; k_t [KVH, NB, D, BS] (block-transposed); v [KVH, NB, BS, D]."""
    kvh, _, hd, bs = k_t.shape
    group = q.shape[1] // kvh
    rows = []
    for b in range(q.shape[0]):
        n = int(lens[b])
        ids = tables[b, : -(-n // bs)].long()
        keys = k_t[:, ids].transpose(2, 3).reshape(kvh, -1, hd)[:, :n].repeat_interleave(group, 0)
        vals = v[:, ids].reshape(kvh, -1, hd)[:, :n].repeat_interleave(group, 0)
        rows.append(F.scaled_dot_product_attention(q[b].unsqueeze(1), keys, vals, scale=scale).reshape(-1))
    return torch.stack(rows)


# (head_dim, block_size) picks the kernel's path: 64/16, 128/16, any/16, any/32 vector paths, then generic.
SHAPES = [(8, 4, 64, 16), (4, 4, 128, 16), (4, 2, 48, 16), (8, 4, 64, 32), (8, 2, 32, 8), (6, 1, 20, 5)]


@pytest.mark.parametrize("heads,kvh,hd,bs", SHAPES)
@pytest.mark.parametrize("threads", [1, 2])
def test_matches_torch_attention(op, heads, kvh, hd, bs, threads):
    gen = torch.Generator().manual_seed(heads * 1000 + hd + bs)
    num_blocks, batch = 300, 13
    k_t = torch.randn(kvh, num_blocks, hd, bs, generator=gen)
    v = torch.randn(kvh, num_blocks, bs, hd, generator=gen)
    lens = torch.randint(1, 40 * bs, (batch,), generator=gen, dtype=torch.int32)
    lens[0], lens[1] = 1, bs  # one token; exactly one full block
    width = int(-(-lens.max() // bs)) + 2  # tables padded beyond the longest context
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:width] for _ in range(batch)]).int()
    # q as the model makes it: a strided slice of a fused [B, heads + kv_heads, D] tensor
    q = torch.randn(batch, heads + kvh, hd, generator=gen)[:, :heads]
    out = torch.full((batch, heads * hd), float("nan"))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        op(out, q, k_t, v, tables, lens, hd**-0.5)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out, reference(q, k_t, v, tables, lens, hd**-0.5), rtol=1e-5, atol=2e-6)


def test_rejects_bad_inputs(op):
    k_t, v = torch.zeros(2, 4, 16, 8), torch.zeros(2, 4, 8, 16)
    q, out = torch.zeros(1, 4, 16), torch.zeros(1, 64)
    with pytest.raises(RuntimeError, match="block id out of range"):
        op(out, q, k_t, v, torch.tensor([[7]], dtype=torch.int32), torch.tensor([3], dtype=torch.int32), 0.25)
    with pytest.raises(RuntimeError, match="context length out of range"):
        op(out, q, k_t, v, torch.tensor([[1]], dtype=torch.int32), torch.tensor([9], dtype=torch.int32), 0.25)
    with pytest.raises(RuntimeError, match="float32 only"):
        op(out, q.double(), k_t, v, torch.tensor([[1]], dtype=torch.int32), torch.tensor([3], dtype=torch.int32), 0.25)


def test_engine_uses_it_on_cpu_float32(op, llama_dir):
    from backends.llm.config import EngineConfig
    from backends.llm.engine import LLMEngine

    assert LLMEngine(llama_dir, EngineConfig(kv_cache_memory_bytes=1 << 20)).runner.decode_op is op
    assert LLMEngine(llama_dir, EngineConfig(kv_cache_memory_bytes=1 << 20, attention="torch")).runner.decode_op is None
