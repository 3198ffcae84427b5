"""Tensor parallelism (backends/llm/parallel/): two ranks give what one rank gives, token for token
(float32 greedy), with preemption and prefix caching, logprobs within 2e-3; the step's delta is what
travels; a model whose heads do not divide fails with the reason."""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import pytest
import torch

from pier.backends.llm.config import EngineConfig
from pier.backends.llm.engine import LLMEngine
from pier.backends.llm.parallel.delta import Receiver, Shipper
from pier.backends.llm.parallel.shm_allreduce import SHM, remove_stale
from pier.backends.llm.sampling_params import SamplingParams
from pier.backends.llm.scheduler_output import ScheduledSeq, SchedulerOutput

from .gguf_files import HEADS, HIDDEN, KV_HEADS, LAYERS, write_gguf
from .quant_checkpoints import fp8_pair, quantized_pair
from .tiny_model import ARCHITECTURES, build_adapter, build_model, hf_greedy, peft_greedy, truncated_copy

TOKENS = 16
BLOCKS = 40  # of 4 tokens: the prompts below do not all fit at once, so the scheduler preempts
SMALL = dict(block_size=4, enable_prefix_caching=True, num_threads=1)


def _kv_bytes(folder: Path, ranks: int) -> int:
    """kv_cache_memory_bytes for BLOCKS blocks on each of `ranks` ranks (the setting is per rank, as
    vLLM's is per device: a rank holds its share of the KV heads)."""
    if not (folder / "config.json").exists():  # a GGUF file of gguf_files.py's sizes
        cfg = {"num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "hidden_size": HIDDEN,
               "num_hidden_layers": LAYERS}
    else:
        cfg = json.loads((folder / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    kv_heads = max(cfg.get("num_key_value_heads", heads) // ranks, 1)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return BLOCKS * cfg["num_hidden_layers"] * 2 * 4 * kv_heads * head_dim * 4


def _prompts() -> list[list[int]]:
    rng = random.Random(3)
    system = [rng.randrange(2, 320) for _ in range(24)]  # a shared prefix: prefix-cache hits
    return [system + [rng.randrange(2, 320) for _ in range(n)] for n in (1, 9, 30)] + \
        [[rng.randrange(2, 320) for _ in range(n)] for n in (3, 40, 17)]


def _run(eng: LLMEngine, prompts: list[list[int]]) -> list[tuple[list[int], list, list]]:
    """Per prompt: the greedy tokens, their logprobs (with 2 alternatives) and the prompt logprobs;
    the prompts twice, one wave after the other (the second, without prompt logprobs, hits the prefix cache)."""
    return _wave(eng, prompts, "a") + _wave(eng, prompts, "b")


def _wave(eng: LLMEngine, prompts: list[list[int]], wave: str) -> list[tuple[list[int], list, list]]:
    params = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True, logprobs=2,
                            prompt_logprobs=1 if wave == "a" else None)
    for i, p in enumerate(prompts):
        eng.add_request(f"{wave}{i}", p, params)
    got: dict[str, tuple[list[int], list, list]] = {f"{wave}{i}": ([], [], []) for i in range(len(prompts))}
    while eng.has_unfinished():
        for out in eng.step():
            tokens, lps, plps = got[out.request_id]
            tokens.extend(out.token_ids)
            lps.extend(out.logprobs or [])
            plps.extend(out.prompt_logprobs or [])
    return [got[f"{wave}{i}"] for i in range(len(prompts))]


def _close(a: list[tuple[list[int], list, list]], b: list[tuple[list[int], list, list]]) -> None:
    for (ta, la, pa), (tb, lb, pb) in zip(a, b):
        assert ta == tb
        for (va, topa), (vb, topb) in zip(la, lb):
            assert va == pytest.approx(vb, abs=2e-3)
            assert topa.keys() == topb.keys()
            assert list(topa.values()) == pytest.approx(list(topb.values()), abs=2e-3)
        assert len(pa) == len(pb)
        for (ia, va, _), (ib, vb, _) in zip(pa, pb):
            assert ia == ib
            assert (va is None and vb is None) or va == pytest.approx(vb, abs=2e-3)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """head_dim 32 x 4 heads != hidden 64, one KV head (replicated on both ranks), the LM head tied."""
    return build_model(tmp_path_factory.mktemp("qwen3") / "model", "qwen3", head_dim=32, num_key_value_heads=1,
                       tie_word_embeddings=True, random_norms=True)


@pytest.fixture(scope="module")
def phi3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """q/k/v and gate/up fused in the checkpoint, a partial rotary factor, a sliding window of 32 (the
    prompts pass it; a smaller one gives back so many blocks that the 40 no longer preempt)."""
    arch, settings = ARCHITECTURES["phi3"]
    return build_model(tmp_path_factory.mktemp("phi3") / "model", arch, **{**settings, "sliding_window": 32})


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Mixtral (4 experts, 2 per token; its sliding window widened to 32, as phi3_dir's), Qwen3-MoE
    (8 experts of width 32, 3 per token, layer 1 dense) and Qwen2-MoE (a shared expert of width 64)."""
    mixtral, qwen3_moe = ARCHITECTURES["mixtral"], ARCHITECTURES["qwen3_moe"]
    return {"mixtral": build_model(tmp_path_factory.mktemp("mixtral") / "model", mixtral[0],
                                   **{**mixtral[1], "sliding_window": 32}),
            "qwen3_moe": build_model(tmp_path_factory.mktemp("qwen3_moe") / "model", qwen3_moe[0], **qwen3_moe[1]),
            "qwen2_moe": build_model(tmp_path_factory.mktemp("qwen2_moe") / "model", "qwen2_moe", num_experts=4,
                                     num_experts_per_tok=2, moe_intermediate_size=32,
                                     shared_expert_intermediate_size=64)}


@pytest.mark.parametrize("arch", ["llama", "qwen3", "phi3", "mixtral", "qwen3_moe", "qwen2_moe"])
def test_two_ranks_equal_one(arch, llama_dir, qwen3_dir, phi3_dir, moe_dirs):
    """The experts split too: each rank half of every expert's width (and of Qwen2-MoE's shared expert)."""
    folder = {"llama": llama_dir, "qwen3": qwen3_dir, "phi3": phi3_dir, **moe_dirs}[arch]
    prompts = _prompts()
    one = LLMEngine(folder, EngineConfig(kv_cache_memory_bytes=_kv_bytes(folder, 1), **SMALL))  # type: ignore[arg-type]
    ref = _run(one, prompts)
    assert one.stats().num_preemptions > 0
    two = LLMEngine(folder, EngineConfig(tensor_parallel_size=2, kv_cache_memory_bytes=_kv_bytes(folder, 2),
                                         **SMALL))  # type: ignore[arg-type]
    try:
        got = _run(two, prompts)
        stats = two.stats()
        assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
        assert two.runner.model.config.num_kv_heads == one.model.config.num_kv_heads
        moe = getattr(two.model.layers[0], "moe", None)  # type: ignore[attr-defined]
        if moe is not None:  # [E, hidden, 2 * width / 2] on this rank
            assert moe.w13.shape[2] == one.model.layers[0].moe.w13.shape[2] // 2  # type: ignore[attr-defined]
        specs = two.model.kv_cache_specs()  # each rank holds its share of the KV heads (or the one it reads)
        assert specs[0].num_kv_heads == max(one.model.kv_cache_specs()[0].num_kv_heads // 2, 1)
        assert two.kv.pool.num_blocks == BLOCKS
        assert not list(SHM.glob(f"pier-tp-*-{os.getpid()}"))  # the segment's name went once both ranks mapped it
        two.kv.check()
        assert two.kv.pool.num_free == two.kv.pool.num_blocks
    finally:
        two.close()
    assert [t for t, _, _ in ref] == hf_greedy(folder, prompts, TOKENS) * 2
    _close(ref, got)


@pytest.mark.parametrize("fmt", ["gptq", "awq", "int8", "fp8-block", "gguf-Q4_K", "gguf-Q6_K", "gguf-phi3-Q4_K"])
def test_quantized_weights_split_across_two_ranks(fmt, llama_dir, tmp_path):
    """A quantized checkpoint on two ranks gives what it gives on one: each rank keeps its rows of the
    column-parallel projections and whole groups of the row-parallel ones' columns, still packed
    (GPTQ/AWQ 4-bit in groups of 32, FP8 in 48x32 blocks, GGUF's Q4_K and Q6_K blocks, Phi-3's fused
    ones too; int8 is quantized before the split, per row)."""
    from pier.backends.llm.layers.quantized import PackedWeight

    settings: dict[str, object] = {}
    if fmt in ("gptq", "awq"):
        folder, _ = quantized_pair(llama_dir, tmp_path, fmt, 4)
    elif fmt == "fp8-block":
        folder, _ = fp8_pair(llama_dir, tmp_path, fmt)
    elif fmt == "int8":
        folder, settings = llama_dir, {"quantization": "int8"}
    else:
        folder = write_gguf(tmp_path / fmt / "model.gguf", fmt.split("-")[-1],  # Phi-3's: q/k/v, gate/up fused
                            arch="phi3" if "phi3" in fmt else "llama").parent
    prompts = _prompts()
    one = LLMEngine(folder, EngineConfig(kv_cache_memory_bytes=_kv_bytes(folder, 1), **SMALL, **settings))  # type: ignore[arg-type]
    ref = _run(one, prompts)
    two = LLMEngine(folder, EngineConfig(tensor_parallel_size=2, kv_cache_memory_bytes=_kv_bytes(folder, 2),
                                         **SMALL, **settings))  # type: ignore[arg-type]
    try:
        got = _run(two, prompts)
        layer = two.runner.model.layers[0]  # type: ignore[attr-defined]
        qkv, o = layer.qkv_proj.weight, layer.o_proj.weight
        assert isinstance(qkv, PackedWeight) and isinstance(o, PackedWeight)  # this rank's share, still packed
        full = one.model.layers[0]  # type: ignore[attr-defined]
        assert qkv.shape[0] * 2 == full.qkv_proj.weight.shape[0] and o.input_size * 2 == full.o_proj.weight.input_size
    finally:
        two.close()
    _close(ref, got)


def test_lora_adapters_split_across_two_ranks(llama_dir, tmp_path):
    """LoRA with 2 ranks: each rank holds its share of every adapter (B's rows of the column-parallel
    projections, A's columns of the row-parallel ones), installed and evicted as rank 0 does them
    (StepDelta.lora): a startup adapter, one loaded at run time, one read again after its eviction
    (max_cpu_loras 2 of 3 served), base rows beside adapter rows in one step. Outputs equal 1 rank's
    (logprobs within 2e-3) and PEFT's greedy tokens."""
    from pier.backends.llm.config import LoRAModulePath

    a1 = build_adapter(llama_dir, tmp_path / "a1", 1, r=8, alpha=16)
    a2 = build_adapter(llama_dir, tmp_path / "a2", 2, r=4, alpha=8, use_rslora=True,
                       targets=("q_proj", "v_proj", "down_proj"))
    a3 = build_adapter(llama_dir, tmp_path / "a3", 3, r=8, alpha=8, targets=("k_proj", "o_proj", "gate_proj"))
    prompts = _prompts()[:3]
    names = [None, "a1", "a2", "a3"]
    settings = dict(SMALL, enable_lora=True, max_loras=2, max_cpu_loras=2,
                    lora_modules=(LoRAModulePath("a1", str(a1)),))

    def run(eng: LLMEngine) -> list[tuple[list[int], list, list]]:
        eng.load_lora("a2", a2)
        eng.load_lora("a3", a3)
        out = []
        for wave in range(2):  # the second wave reads the evicted adapters again
            for i, p in enumerate(prompts):
                for n in names[i:] + names[:i]:
                    eng.add_request(f"{wave}{i}{n}", p, SamplingParams(max_tokens=TOKENS, temperature=0,
                                                                     ignore_eos=True, logprobs=2, lora_name=n))
            got: dict[str, tuple[list[int], list, list]] = {}
            while eng.has_unfinished():
                for o in eng.step():
                    t, lp, _ = got.setdefault(o.request_id, ([], [], []))
                    t.extend(o.token_ids)
                    lp.extend(o.logprobs or [])
            out += [got[k] for k in sorted(got)]
        return out

    one = LLMEngine(llama_dir, EngineConfig(kv_cache_memory_bytes=_kv_bytes(llama_dir, 1), **settings))  # type: ignore[arg-type]
    ref = run(one)
    two = LLMEngine(llama_dir, EngineConfig(tensor_parallel_size=2, kv_cache_memory_bytes=_kv_bytes(llama_dir, 2),
                                            **settings))  # type: ignore[arg-type]
    shipped: list[tuple[int, str]] = []
    assert two.executor is not None
    take = two.executor.lora_ops

    def noted() -> list[tuple[int, str]]:
        ops = take()
        shipped.extend(ops)
        return ops

    two.executor.lora_ops = noted
    try:
        got = run(two)
        first = next(i for i, (_, path) in enumerate(shipped) if not path)  # an eviction, and that adapter read again
        assert (shipped[first][0], "") in shipped and any(lid == shipped[first][0] and path
                                                           for lid, path in shipped[first:])
        shares = two.lora.layers.methods  # type: ignore[union-attr]
        qkv = two.model.layers[0].qkv_proj  # type: ignore[attr-defined]
        down = two.model.layers[0].down_proj  # type: ignore[attr-defined]
        assert shares[id(qkv)].weights and shares[id(down)].weights  # the adapters resident now
        for a, b in shares[id(qkv)].weights.values():  # column-parallel: all 64 inputs, half of q/k/v's 128 outputs
            assert a.shape[0] == 64 and b.shape[1] == qkv.output_size == 64
        for a, b in shares[id(down)].weights.values():  # row-parallel: half of its 128 inputs, all 64 outputs
            assert a.shape[0] == down.input_size == 64 and b.shape[1] == 64
    finally:
        two.close()
    _close(ref, got)
    order = sorted(f"{w}{i}{n}" for w in range(2) for i in range(3) for n in names)
    want = {n: peft_greedy(llama_dir, {"a1": a1, "a2": a2, "a3": a3}.get(n or ""), prompts, TOKENS) for n in names}
    assert [t for t, _, _ in got] == [want[None if k[2:] == "None" else k[2:]][int(k[1])] for k in order]


def test_a_draft_model_on_rank_0_drafts_for_two_ranks(llama_dir, tmp_path):
    """Speculative decoding with a draft model (a one-layer copy of the target) on 2 ranks: rank 0
    runs the draft model whole and ships the step with its drafts filled in; every rank budgets the
    draft's KV blocks alike. Greedy output equals 1 rank's and transformers', drafts accepted and
    rejected, with preemption."""
    from pier.backends.llm.spec_decode import SpeculativeConfig

    folder = tmp_path / "model"
    folder.mkdir()
    for f in llama_dir.iterdir():
        if f.is_file():
            shutil.copy(f, folder / f.name)
    truncated_copy(folder, folder / "trunc", 1)
    spec = SpeculativeConfig(3, method="draft_model", model="trunc")
    prompts = _prompts()
    greedy = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
    settings = dict(SMALL, speculative_config=spec)
    one = LLMEngine(folder, EngineConfig(kv_cache_memory_bytes=_kv_bytes(folder, 1), **settings))  # type: ignore[arg-type]
    ref = [o[0] for o in one.generate(prompts, greedy)]
    two = LLMEngine(folder, EngineConfig(tensor_parallel_size=2, kv_cache_memory_bytes=_kv_bytes(folder, 2),
                                         **settings))  # type: ignore[arg-type]
    try:
        got = [o[0] for o in two.generate(prompts, greedy)]
        stats = two.stats()
        assert stats.spec_decode is not None and 0 < stats.spec_decode.num_accepted_tokens < \
            stats.spec_decode.num_draft_tokens, stats.spec_decode
        assert stats.num_preemptions > 0
        assert two.runner.drafter is not None  # rank 0 drafts
    finally:
        two.close()
    assert got == ref == hf_greedy(folder, prompts, TOKENS)


def test_an_act_order_checkpoint_does_not_split_its_row_parallel_inputs(llama_dir, tmp_path):
    folder, _ = quantized_pair(llama_dir, tmp_path, "gptq", 4, desc_act=True)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.(self_attn\.o|mlp\.down)_proj: an act-order "
                                         r"\(desc_act / g_idx\) weight stores its input columns out of order"):
        LLMEngine(folder, EngineConfig(tensor_parallel_size=2, kv_cache_memory_bytes=_kv_bytes(folder, 2), **SMALL))  # type: ignore[arg-type]


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs 2 CUDA devices (NCCL, one rank per GPU): scripts/gpu_check.sh runs it on a GPU box")
def test_nccl_two_gpus_equal_one(llama_dir):
    prompts = _prompts()
    one = LLMEngine(llama_dir, EngineConfig(device="cuda", kv_cache_memory_bytes=_kv_bytes(llama_dir, 1), **SMALL))
    ref = _run(one, prompts)
    two = LLMEngine(llama_dir, EngineConfig(device="cuda", tensor_parallel_size=2,  # type: ignore[arg-type]
                                            kv_cache_memory_bytes=_kv_bytes(llama_dir, 2), **SMALL))
    try:
        assert two.executor is not None and two.executor.group.backend == "nccl"
        got = _run(two, prompts)
    finally:
        two.close()
    _close(ref, got)


def test_stale_segments_removed():
    """A segment whose engine process died before it removed the name goes at the next start; a live
    one stays."""
    import subprocess

    gone = subprocess.Popen(["true"])
    gone.wait()
    stale, live = SHM / f"pier-tp-{os.getpid()}-{gone.pid}", SHM / f"pier-tp-{os.getpid()}-{os.getpid()}"
    stale.write_bytes(b"x")
    live.write_bytes(b"x")
    try:
        remove_stale()
        assert not stale.exists() and live.exists()
    finally:
        stale.unlink(missing_ok=True)
        live.unlink(missing_ok=True)


def test_heads_that_do_not_divide(llama_dir):
    with pytest.raises(ValueError, match=r"tensor_parallel_size 3 does not divide its 4 attention heads"):
        LLMEngine(llama_dir, EngineConfig(tensor_parallel_size=3))


def test_widths_that_do_not_divide_are_named(tmp_path):
    folder = build_model(tmp_path / "model", "qwen2_moe", num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=50, shared_expert_intermediate_size=40)
    with pytest.raises(ValueError, match=r"tensor_parallel_size 3 does not divide its 4 attention heads.* nor its "
                                         r"experts' width 50 \(moe_intermediate_size\) nor its shared expert's width "
                                         r"40 \(shared_expert_intermediate_size\)"):
        LLMEngine(folder, EngineConfig(tensor_parallel_size=3))


def test_thread_engine_core_refused():
    with pytest.raises(ValueError, match="needs engine_core 'process'"):
        EngineConfig.from_parameters({"tensor_parallel_size": "2", "engine_core": "thread"})


def test_step_ships_the_delta():
    """A sequence's block table travels once; then only what changed (a new block, a rollback, a
    replacement after preemption), and the workers rebuild the same SchedulerOutput."""
    shipper, receiver = Shipper(), Receiver()

    def step(table: list[int], pos: int, finished: list[str] | None = None) -> list[int]:
        so = SchedulerOutput([ScheduledSeq("a", [7], pos, table, True)], finished_seq_ids=finished or [])
        delta = shipper.delta(so)
        rebuilt = receiver.output(delta)
        assert rebuilt.scheduled[0].block_table == table
        return delta.scheduled[0].blocks

    assert step([3, 4], 5) == [3, 4]  # new: whole
    assert step([3, 4], 6) == []  # a decode in the same block: nothing
    assert step([3, 4, 9], 8) == [9]  # a new block: that block
    assert step([3, 4], 7) == []  # rolled back: kept 2
    assert step([5, 6], 0) == [5, 6]  # preempted and scheduled anew
    assert step([5], 0, finished=["a"]) == [5]  # the id finished and came back: whole again
