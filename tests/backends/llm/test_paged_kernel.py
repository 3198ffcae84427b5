"""The compiled CPU kernels against plain torch: paged decode attention over gathered blocks, and the
fused layer ops (RMSNorm, SiLU * up, RoPE + K/V cache write)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pier.backends.llm import kernels


@pytest.fixture(scope="module")
def op():
    fn = kernels.paged_decode_attention()
    if fn is None:
        pytest.skip("the C++ kernel did not build here (no compiler?); the engine uses torch attention")
    return fn


def test_a_lock_file_left_by_a_killed_loader_does_not_hang_the_next_load(op) -> None:
    """torch's `lock` file in the build folder, as a process killed while it loaded the kernels leaves
    it (torch would wait for it to go away, forever): the next load removes it and loads."""
    from torch.utils import cpp_extension

    folder = Path(cpp_extension._get_build_directory(f"pier_llm_kernels_{kernels._digest()}", verbose=False))
    (folder / "lock").touch()
    code = "import sys; from pier.backends.llm import kernels; sys.exit(kernels.load() is None)"
    try:
        subprocess.run([sys.executable, "-c", code], timeout=90, check=True)
    finally:
        (folder / "lock").unlink(missing_ok=True)  # a failed run leaves no hang behind for the others


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
    from pier.backends.llm.config import EngineConfig
    from pier.backends.llm.engine import LLMEngine

    eng = LLMEngine(llama_dir, EngineConfig(kv_cache_memory_bytes=1 << 20))
    assert eng.runner.decode_op is op and eng.model.kernels is not None
    eng = LLMEngine(llama_dir, EngineConfig(kv_cache_memory_bytes=1 << 20, attention="torch"))
    assert eng.runner.decode_op is None and eng.model.kernels is None


@pytest.fixture(scope="module")
def ops(op):
    return kernels.load()


@pytest.mark.parametrize("rows,hidden", [(1, 512), (7, 48), (300, 200), (2048, 64)])
@pytest.mark.parametrize("threads", [1, 2])
def test_rms_norm_and_silu_mul(ops, rows, hidden, threads):
    from pier.backends.llm.layers.norm import rms_norm

    gen = torch.Generator().manual_seed(rows + hidden)
    x = torch.randn(rows, hidden + 3, generator=gen)[:, :hidden] * 3  # strided rows, as a slice
    x[0] *= 1e-3  # a row whose mean square is near eps: eps must be added where HF adds it
    w = torch.randn(hidden, generator=gen)
    out = torch.full((rows, hidden), float("nan"))
    gate_up = torch.randn(rows, 2 * hidden, generator=gen) * 8  # wide range: exp's clamps get hit
    act = torch.full((rows, hidden), float("nan"))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ops.rms_norm(out, x, w, 1e-5)
        ops.silu_mul(act, gate_up)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out, rms_norm(x, w, 1e-5), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(act, F.silu(gate_up[:, :hidden]) * gate_up[:, hidden:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads,kvh,hd,bs", [(8, 4, 64, 16), (6, 2, 20, 5)])
def test_rope_write_kv(ops, heads, kvh, hd, bs):
    """Rotates q and k in place as the torch path's complex multiply does, and stores k
    (block-transposed) and v at their slots; nothing else in the cache changes."""
    gen = torch.Generator().manual_seed(hd)
    n, num_blocks, max_pos = 37, 20, 600
    freqs = torch.polar(torch.ones(max_pos, hd // 2), torch.randn(max_pos, hd // 2, generator=gen))
    qkv = torch.randn(n, (heads + 2 * kvh) * hd, generator=gen)
    positions = torch.randint(0, max_pos, (n,), generator=gen)
    slots = torch.randperm(num_blocks * bs, generator=gen)[:n]
    k_cache, v_cache = torch.zeros(kvh, num_blocks, hd, bs), torch.zeros(kvh, num_blocks, bs, hd)
    rotated = qkv[:, : (heads + kvh) * hd].reshape(n, heads + kvh, hd // 2, 2)
    rotated = torch.view_as_real(torch.view_as_complex(rotated.contiguous()) * freqs[positions].unsqueeze(1))
    rotated = rotated.reshape(n, -1)
    v = qkv[:, (heads + kvh) * hd :].clone()
    ops.rope_write_kv(qkv, torch.view_as_real(freqs).contiguous(), positions, k_cache, v_cache, slots, heads, kvh)
    torch.testing.assert_close(qkv[:, : (heads + kvh) * hd], rotated)
    k = rotated[:, heads * hd :].view(n, kvh, hd)
    blocks, offsets = slots // bs, slots % bs
    torch.testing.assert_close(k_cache.permute(0, 1, 3, 2)[:, blocks, offsets], k.transpose(0, 1))
    torch.testing.assert_close(v_cache[:, blocks, offsets], v.view(n, kvh, hd).transpose(0, 1))
    written = torch.zeros(num_blocks * bs, dtype=torch.bool)
    written[slots] = True
    assert not k_cache.permute(0, 1, 3, 2).reshape(kvh, -1, hd)[:, ~written].any()
    assert not v_cache.reshape(kvh, -1, hd)[:, ~written].any()
    with pytest.raises(RuntimeError, match="slot out of range"):
        ops.rope_write_kv(qkv, torch.view_as_real(freqs).contiguous(), positions, k_cache, v_cache,
                          slots + num_blocks * bs, heads, kvh)


def windowed_reference(q, k_t, v, tables, lens, scale, window, softcap):
    """`reference` with a sliding window (the last `window` tokens) and soft-capped scores, as
    transformers' eager attention computes them."""
    kvh, _, hd, bs = k_t.shape
    group = q.shape[1] // kvh
    rows = []
    for b in range(q.shape[0]):
        n = int(lens[b])
        ids = tables[b, : -(-n // bs)].long().clamp(min=0)
        keys = k_t[:, ids].transpose(2, 3).reshape(kvh, -1, hd)[:, :n].repeat_interleave(group, 0)
        vals = v[:, ids].reshape(kvh, -1, hd)[:, :n].repeat_interleave(group, 0)
        s = (q[b].unsqueeze(1) @ keys.transpose(1, 2)) * scale  # [heads, 1, n]
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        if window:
            s[..., : max(n - window, 0)] = float("-inf")
        rows.append((torch.softmax(s, dim=-1) @ vals).reshape(-1))
    return torch.stack(rows)


@pytest.mark.parametrize("heads,kvh,hd,bs", SHAPES)
@pytest.mark.parametrize("window,softcap", [(7, 0.0), (33, 0.0), (0, 5.0), (20, 3.0)])
def test_sliding_window_and_softcap_match_torch(op, heads, kvh, hd, bs, window, softcap):
    """Blocks wholly before the window are never read: their table entries here are out of range."""
    gen = torch.Generator().manual_seed(heads * 100 + hd + bs + window)
    num_blocks, batch = 200, 9
    k_t = torch.randn(kvh, num_blocks, hd, bs, generator=gen) * 3  # large scores: the cap matters
    v = torch.randn(kvh, num_blocks, bs, hd, generator=gen)
    lens = torch.randint(1, 20 * bs, (batch,), generator=gen, dtype=torch.int32)
    lens[0], lens[1], lens[2] = 1, bs, max(window, 1)
    width = int(-(-lens.max() // bs)) + 1
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:width] for _ in range(batch)]).int()
    if window:
        for b in range(batch):
            tables[b, : max(int(lens[b]) - window, 0) // bs] = -1  # given back: must not be read
    q = torch.randn(batch, heads + kvh, hd, generator=gen)[:, :heads]
    out = torch.full((batch, heads * hd), float("nan"))
    op(out, q, k_t, v, tables, lens, hd**-0.5, softcap, window)
    expected = windowed_reference(q, k_t, v, tables, lens, hd**-0.5, window, softcap)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=2e-6)
