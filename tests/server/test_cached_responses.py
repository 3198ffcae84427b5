"""The response cache (server/dataplane/response_cache.py), alone and in the data plane over a toy
model: what the key tells apart (and what it does not), least recently used entries evicted by
bytes, answers shared read-only, and through the plane: a hit runs nothing and counts as Triton
counts it, an error is never kept, a reloaded model never answers from its old load."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from pier.contract.errors import ErrorCode, PierError
from pier.contract.types import ExecuteResult, InferenceRequest, RequestedOutput, Tensor
from pier.dataplane.plane import DataPlane
from pier.dataplane.response_cache import ResponseCache, parse_cache_config
from pier.lifecycle.routing import RoutingTable
from tests.server.toy import Toy, load, outputs, serve, tensor

CACHED = """name: "m" backend: "onnxruntime" max_batch_size: 0 response_cache { enable: true }
input [ { name: "A" data_type: TYPE_FP32 dims: [ -1 ] }, { name: "B" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "SUM" data_type: TYPE_FP32 dims: [ -1 ] } ]
"""


def _request(a: list, b: list | None = None, *wanted: RequestedOutput, model: str = "m") -> InferenceRequest:
    return InferenceRequest(model, "", [tensor("A", a), tensor("B", b if b is not None else a)], list(wanted))


def test_the_key_tells_apart_what_changes_the_answer_and_only_that() -> None:
    key = ResponseCache.key
    base = key("m", 1, _request([1, 2]))
    assert key("m", 1, _request([1, 2])) == base
    swapped = InferenceRequest("m", "", list(reversed(_request([1, 2]).inputs)))
    assert key("m", 1, swapped) == base  # the order inputs come in does not matter
    as_int = InferenceRequest("m", "", [Tensor(t.name, "INT32", t.shape, t.data.view(np.int32))
                                        for t in _request([1, 2]).inputs])
    others = [key("m2", 1, _request([1, 2])), key("m", 2, _request([1, 2])),  # another model, another load
              key("m", 1, _request([1, 3])), key("m", 1, _request([1, 2], [1, 3])),  # the bytes of either input
              key("m", 1, as_int),  # the same bytes as another datatype
              key("m", 1, InferenceRequest("m", "", [tensor("A", [[1, 2]]), tensor("B", [[1, 2]])])),  # a shape
              key("m", 1, _request([1, 2], None, RequestedOutput("SUM"))),  # outputs asked for
              key("m", 1, _request([1, 2], None, RequestedOutput("SUM", {"classification": 1})))]
    assert len({base, *others}) == len(others) + 1
    binary = _request([1, 2], None, RequestedOutput("SUM", {"binary_data": True}))
    assert key("m", 1, binary) == key("m", 1, _request([1, 2], None, RequestedOutput("SUM")))  # the wire form only


def test_least_recently_used_entries_go_past_the_size_in_bytes() -> None:
    cache = ResponseCache(capacity_bytes=3 * 16)
    requests = [_request([float(n)]) for n in range(5)]
    keys = [cache.lookup("m", 1, r)[0] for r in requests]
    for n in (0, 1, 2):
        cache.insert(keys[n], [tensor("SUM", [n] * 4)])  # 16 bytes each
    assert cache.used == 48 and len(cache) == 3
    assert cache.lookup("m", 1, requests[0])[1] is not None  # a hit: 0 is now the most recently used
    cache.insert(keys[3], [tensor("SUM", [3] * 4)])
    assert cache.evictions == 1 and cache.used == 48
    cache.insert(keys[4], [tensor("SUM", [0] * 13)])  # 52 bytes: larger than the whole cache, not kept
    assert [n for n in range(5) if cache.lookup("m", 1, requests[n])[1] is not None] == [0, 2, 3]
    strings = ResponseCache(capacity_bytes=100)
    strings.insert(b"s", [tensor("OUT", [b"abc", b""], "BYTES")])
    assert strings.used == (3 + 4) + (0 + 4)  # each element with its 4-byte length, as Triton counts


def test_a_hit_is_a_copy_no_caller_can_change() -> None:
    cache = ResponseCache(capacity_bytes=1000)
    request = _request([1, 2])
    key, missed, _ = cache.lookup("m", 1, request)
    assert missed is None and cache.misses == 1
    answer = [tensor("SUM", [2, 4])]
    cache.insert(key, answer)
    answer[0].data[0] = 99  # the caller's own array, after it was kept
    _, hit, _ = cache.lookup("m", 1, _request([1, 2]))
    assert hit is not None and hit[0].data.tolist() == [2, 4] and cache.hits == 1
    with pytest.raises(ValueError):
        hit[0].data[0] = 7


def test_cache_config_flags() -> None:
    assert parse_cache_config([]) == 0
    assert parse_cache_config(["local,size=1048576"]) == 1 << 20
    assert parse_cache_config(["local,size=5", "local,other=1"]) == 5
    for item, words in (("redis,host=x", "only the 'local' cache"), ("local", "expected <cache name>,<key>=<value>"),
                        ("local,size=lots", "a number of bytes"), ("local,size=-1", "size must be >= 0")):
        with pytest.raises(ValueError, match=words):
            parse_cache_config([item])


def _adder(request: InferenceRequest) -> ExecuteResult:
    a, b = (t.data for t in request.inputs)
    if a[0] < 0:
        return PierError(ErrorCode.INTERNAL, "negative")
    return outputs(tensor("SUM", a + b))


def test_through_the_plane_a_hit_runs_nothing_and_a_reload_starts_afresh() -> None:
    async def main() -> None:
        routes, toy = RoutingTable(), Toy(_adder)
        model = load(CACHED, toy)
        serve(routes, model)
        plane = DataPlane(routes, strict_readiness=False, cache=ResponseCache(1 << 20))
        first = await plane.infer(_request([1, 2]))
        again = _request([1, 2])
        again.id = "second"
        second = await plane.infer(again)
        assert len(toy.ran) == 1 and second.id == "second"  # answered from the cache, with its own id
        assert first.outputs[0].data.tolist() == second.outputs[0].data.tolist() == [2, 4]
        s = model.stats
        assert (s.cache_hit.count, s.cache_miss.count, s.success.count, s.inference_count) == (1, 1, 2, 1)
        for _ in range(2):  # an error is never kept: each such request runs the model
            with pytest.raises(PierError, match="negative"):
                await plane.infer(_request([-1, 2]))
        assert len(toy.ran) == 3
        reloaded = load(CACHED, toy)  # the same version loaded again: a new load
        serve(routes, reloaded)
        await plane.infer(_request([1, 2]))
        assert len(toy.ran) == 4 and reloaded.stats.cache_miss.count == 1
        uncached = load(CACHED.replace("response_cache { enable: true }", "").replace('"m"', '"plain"'), toy)
        serve(routes, uncached)
        for _ in range(2):
            await plane.infer(_request([1, 2], model="plain"))
        assert len(toy.ran) == 6 and uncached.stats.cache_miss.count == 0

    asyncio.run(main())
