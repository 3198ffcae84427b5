"""Scheduler decisions on plain data (no model): budget, chunking, preemption order, prefix hits."""

from __future__ import annotations

from pier.backends.llm.config import EngineConfig
from pier.backends.llm.kv_cache import KVCacheManager
from pier.backends.llm.request import SeqStatus
from pier.backends.llm.request import SequenceState as Sequence
from pier.backends.llm.sampling_params import SamplingParams
from pier.backends.llm.scheduler import Scheduler


def make(num_blocks: int = 64, block_size: int = 4, **cfg: object) -> Scheduler:
    config = EngineConfig(block_size=block_size, **cfg)  # type: ignore[arg-type]
    kv = KVCacheManager(num_blocks, block_size, config.enable_prefix_caching, 16)
    return Scheduler(config, kv)


def seq(name: str, n: int, first: int = 10) -> Sequence:
    return Sequence(f"{name}#0", name, 0, list(range(first, first + n)), SamplingParams())


def decode(s: Sequence, token: int = 7) -> None:
    s.token_ids.append(token)  # what the engine does after sampling


def test_long_prefill_never_stalls_decodes():
    sch = make(max_num_batched_tokens=8)
    a, b = seq("a", 30), seq("b", 3, first=100)
    sch.add(a)
    sch.add(b)
    out = sch.schedule()  # a takes the whole budget (8 tokens); b waits
    assert [(s.seq_id, len(s.token_ids)) for s in out.scheduled] == [("a#0", 8)]
    out = sch.schedule()
    assert [(s.seq_id, len(s.token_ids)) for s in out.scheduled] == [("a#0", 8)]
    sch.config = EngineConfig(block_size=4, max_num_batched_tokens=8)
    # b is admitted once there is budget, then decodes every step while a keeps chunking
    while b.status is not SeqStatus.RUNNING:
        sch.schedule()
    for _ in range(3):
        if b.num_computed == len(b.token_ids):
            decode(b)
        out = sch.schedule()
        ids = {s.seq_id: len(s.token_ids) for s in out.scheduled}
        assert ids.get("b#0") == 1 or b.num_computed < b.num_prompt
    assert sum(len(s.token_ids) for s in out.scheduled) <= 8


def test_preempts_most_recently_admitted_and_requeues_first():
    sch = make(num_blocks=6, block_size=4, enable_prefix_caching=False)
    seqs = [seq(n, 8, first=10 * i) for i, n in enumerate("abc")]
    for s in seqs:
        sch.add(s)
    out = sch.schedule()  # 2 blocks each: all three fit (6 blocks)
    assert len(out.scheduled) == 3
    for s in seqs:
        decode(s)
    out = sch.schedule()  # each needs a third block: c is preempted (recompute), a and b go on
    assert out.preempted == ["c#0"]
    assert [s.seq_id for s in out.scheduled] == ["a#0", "b#0"]
    assert sch.waiting[0] is seqs[2] and seqs[2].num_computed == 0
    sch.kv.check()
    sch.finish(seqs[0], "abort")
    sch.finish(seqs[1], "stop")
    sch.finish(seqs[2], "abort")
    assert sch.kv.pool.num_free == 6
    sch.kv.check()


def test_prefix_hit_skips_cached_blocks():
    sch = make(block_size=4)
    a = seq("a", 10)
    sch.add(a)
    sch.schedule()
    b = Sequence("b#0", "b", 0, list(range(10, 20)) + [99], SamplingParams())
    sch.add(b)
    out = sch.schedule()
    sb = next(s for s in out.scheduled if s.seq_id == "b#0")
    assert sb.start_pos == 8 and sb.token_ids == [18, 19, 99]  # two full blocks reused
    assert sch.kv.block_table("b#0")[:2] == sch.kv.block_table("a#0")[:2]
    assert sch.kv.prefix_hits == 8


def test_max_num_seqs_counts_the_children_a_request_forks():
    """n > 1: the request takes n seats of max_num_seqs when admitted (its children fork after the
    prompt), so what runs together never passes the limit."""
    sch = make(max_num_seqs=4)
    a, b, c = seq("a", 3), seq("b", 3, first=50), seq("c", 3, first=90)
    a.pending_forks = 2  # n = 3
    b.pending_forks = 2
    for s in (a, b, c):
        sch.add(s)
    out = sch.schedule()
    assert [s.seq_id for s in out.scheduled] == ["a#0"]  # 3 seats taken; b needs 3 more: it (and c, FIFO) waits
    assert b.status is SeqStatus.WAITING and c.status is SeqStatus.WAITING
