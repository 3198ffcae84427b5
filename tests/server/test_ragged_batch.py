"""Ragged batching (Triton's allow_ragged_batch, batch_input, batch_output): compatibility keys,
merge (ragged inputs flattened to 1-D, batch inputs computed), each batch-input kind's values,
scatter back, the dynamic batcher with a toy ragged backend, config validation and spec."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from pier.contract.backend import ModelInstance
from pier.contract.errors import PierError
from pier.contract.policies import BatchingPolicy
from pier.contract.types import BatchInputSpec, InferenceRequest, Outputs, RequestedOutput, Tensor
from pier.observability.statistics import ModelStatistics
from pier.protocol import model_config_pb2 as mc
from pier.repository import model_config
from pier.repository import spec as spec_of
from pier.scheduling.base import WorkItem
from pier.scheduling.batch import compat_key, merge, split
from pier.scheduling.direct import DirectScheduler
from pier.scheduling.dynamic_batcher import DynamicBatcher
from pier.scheduling.ragged import BatchLayout, ScatterOutput, batch_input_value
from pier.tensors.validation import validate_request

SUM_INDEX = BatchInputSpec("BATCH_ACCUMULATED_ELEMENT_COUNT", ("INDEX",), "FP32", ("INPUT",))
LAYOUT = BatchLayout(
    ragged_inputs=frozenset({"INPUT"}),
    batch_inputs=(SUM_INDEX,),
    scatter_outputs=(ScatterOutput("DOUBLED", "INPUT", (-1, -1)),),
)


def ragged_request(values: list[float] | np.ndarray, rows: int = 1, **extra: np.ndarray) -> InferenceRequest:
    x = np.asarray(values, dtype=np.float32).reshape(rows, -1)
    inputs = [Tensor("INPUT", "FP32", list(x.shape), x)]
    inputs += [Tensor(name, "FP32", list(v.shape), v) for name, v in extra.items()]
    return InferenceRequest("ragged", "", inputs)


def shaped(*shape: int, name: str = "INPUT") -> InferenceRequest:
    x = np.zeros(shape, dtype=np.float32)
    return InferenceRequest("ragged", "", [Tensor(name, "FP32", list(shape), x)])


# ---- compatibility and merge ---------------------------------------------------------------


def test_ragged_inputs_do_not_take_part_in_shape_compatibility():
    a, b = ragged_request([1, 2, 3]), ragged_request([1, 2, 3, 4])
    assert compat_key(a) != compat_key(b)  # plain batching: different shapes never share a batch
    assert compat_key(a, frozenset({"INPUT"})) == compat_key(b, frozenset({"INPUT"}))
    # a non-ragged input still has to match
    c = ragged_request([1, 2], OTHER=np.zeros((1, 2), np.float32))
    d = ragged_request([1, 2, 3], OTHER=np.zeros((1, 3), np.float32))
    e = ragged_request([1, 2, 3], OTHER=np.zeros((1, 2), np.float32))
    assert compat_key(c, frozenset({"INPUT"})) != compat_key(d, frozenset({"INPUT"}))
    assert compat_key(c, frozenset({"INPUT"})) == compat_key(e, frozenset({"INPUT"}))
    # and datatypes / names still count for a ragged input
    f = InferenceRequest("ragged", "", [Tensor("INPUT", "INT32", [1, 3], np.zeros((1, 3), np.int32))])
    assert compat_key(a, frozenset({"INPUT"})) != compat_key(f, frozenset({"INPUT"}))


def test_merge_concatenates_ragged_inputs_to_1d_and_adds_the_batch_input():
    """Triton's documented example: requests [1,3], [1,4], [1,5] -> INPUT [12], INDEX [3,7,12]."""
    reqs = [ragged_request(np.arange(n, dtype=np.float32) + 10 * n) for n in (3, 4, 5)]
    reqs[0].outputs = [RequestedOutput("SUM")]
    reqs[1].outputs = [RequestedOutput("DOUBLED")]
    reqs[2].outputs = [RequestedOutput("SUM")]
    merged = merge(reqs, LAYOUT)
    by_name = {t.name: t for t in merged.inputs}
    assert set(by_name) == {"INPUT", "INDEX"}
    assert by_name["INPUT"].shape == [12] and by_name["INPUT"].data.shape == (12,)
    np.testing.assert_array_equal(by_name["INPUT"].data, np.concatenate([r.inputs[0].data.ravel() for r in reqs]))
    assert by_name["INDEX"].datatype == "FP32" and by_name["INDEX"].data.dtype == np.float32
    assert by_name["INDEX"].shape == [3]
    np.testing.assert_array_equal(by_name["INDEX"].data, [3, 7, 12])
    assert sorted(merged.output_names()) == ["DOUBLED", "SUM"]
    # the requests themselves are untouched (their shapes are what scatter needs later)
    assert [r.inputs[0].data.shape for r in reqs] == [(1, 3), (1, 4), (1, 5)]
    assert all(len(r.inputs) == 1 for r in reqs)


def test_non_ragged_inputs_still_concatenate_along_dim0():
    layout = BatchLayout(ragged_inputs=frozenset({"INPUT"}))
    reqs = [ragged_request([1, 2], OTHER=np.full((1, 2), 1.0, np.float32)),
            ragged_request([3, 4, 5, 6], rows=2, OTHER=np.full((2, 2), 2.0, np.float32))]
    by_name = {t.name: t for t in merge(reqs, layout).inputs}
    np.testing.assert_array_equal(by_name["INPUT"].data, [1, 2, 3, 4, 5, 6])
    assert by_name["OTHER"].data.shape == (3, 2)


def test_a_batch_of_one_is_shaped_as_triton_shapes_it():
    """Triton's backends flatten ragged inputs and add batch inputs whatever the batch size."""
    req = ragged_request([1, 2, 3, 4], rows=2)
    req.id = "r1"
    merged = merge([req], LAYOUT)
    by_name = {t.name: t for t in merged.inputs}
    assert by_name["INPUT"].data.shape == (4,)
    np.testing.assert_array_equal(by_name["INDEX"].data, [4])
    assert merged.id == "r1"
    assert merge([req]) is req  # without a layout a batch of one is the request itself


# ---- each batch input kind -----------------------------------------------------------------

# Source shapes [2,3] (batch 2, 6 elements), [1,4] (4), [1,1] (1)
KNOWN = [shaped(2, 3), shaped(1, 4), shaped(1, 1)]


@pytest.mark.parametrize("kind,expected", [
    ("BATCH_ELEMENT_COUNT", [6, 4, 1]),
    ("BATCH_ACCUMULATED_ELEMENT_COUNT", [6, 10, 11]),
    ("BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO", [0, 6, 10, 11]),
    ("BATCH_ITEM_SHAPE", [[3], [3], [4], [1]]),
    ("BATCH_ITEM_SHAPE_FLATTEN", [3, 3, 4, 1]),
])
@pytest.mark.parametrize("datatype,dtype", [("INT32", np.int32), ("FP32", np.float32)])
def test_batch_input_values(kind, expected, datatype, dtype):
    value = batch_input_value(BatchInputSpec(kind, ("T",), datatype, ("INPUT",)), KNOWN)
    assert value.dtype == dtype
    assert value.shape == np.asarray(expected).shape
    np.testing.assert_array_equal(value, expected)


def test_max_element_count_as_shape_carries_the_count_in_its_shape():
    for datatype, dtype in (("INT32", np.int32), ("FP32", np.float32)):
        spec = BatchInputSpec("BATCH_MAX_ELEMENT_COUNT_AS_SHAPE", ("T",), datatype, ("INPUT",))
        value = batch_input_value(spec, KNOWN)
        assert value.shape == (6,) and value.dtype == dtype


def test_item_shape_matches_the_model_config_proto_example():
    """model_config.proto: a batch-2 input [3, 1] and a batch-1 input [2, 2] give [[3,1],[3,1],[2,2]]."""
    reqs = [shaped(2, 3, 1), shaped(1, 2, 2)]
    item = batch_input_value(BatchInputSpec("BATCH_ITEM_SHAPE", ("T",), "INT32", ("INPUT",)), reqs)
    np.testing.assert_array_equal(item, [[3, 1], [3, 1], [2, 2]])
    flat = batch_input_value(BatchInputSpec("BATCH_ITEM_SHAPE_FLATTEN", ("T",), "INT32", ("INPUT",)), reqs)
    np.testing.assert_array_equal(flat, [3, 1, 3, 1, 2, 2])


def test_every_target_name_gets_the_batch_input():
    spec = BatchInputSpec("BATCH_ELEMENT_COUNT", ("A", "B"), "INT32", ("INPUT",))
    merged = merge([ragged_request([1, 2]), ragged_request([3])], BatchLayout(frozenset({"INPUT"}), (spec,)))
    by_name = {t.name: t.data.tolist() for t in merged.inputs}
    assert by_name["A"] == by_name["B"] == [2, 1]


# ---- scatter back --------------------------------------------------------------------------


def test_split_scatters_batch_outputs_by_the_source_shape_and_rows_the_rest():
    reqs = [ragged_request([1, 2, 3]), ragged_request([4, 5, 6, 7]), ragged_request([8, 9], rows=2)]
    sizes = [1, 1, 2]
    doubled = np.arange(1, 10, dtype=np.float32) * 2  # the model's 1-D output over the flat batch
    sums = np.array([[6], [22], [8], [9]], dtype=np.float32)  # one row per batch item
    result = Outputs([Tensor("SUM", "FP32", [4, 1], sums), Tensor("DOUBLED", "FP32", [9], doubled)])
    parts = split(result, sizes, reqs, LAYOUT)
    assert len(parts) == 3
    got = [{t.name: t for t in p.tensors} for p in parts]  # type: ignore[union-attr]
    assert [g["DOUBLED"].shape for g in got] == [[1, 3], [1, 4], [2, 1]]
    np.testing.assert_array_equal(got[0]["DOUBLED"].data, [[2, 4, 6]])
    np.testing.assert_array_equal(got[1]["DOUBLED"].data, [[8, 10, 12, 14]])
    np.testing.assert_array_equal(got[2]["DOUBLED"].data, [[16], [18]])
    assert [g["SUM"].data.tolist() for g in got] == [[[6]], [[22]], [[8], [9]]]


def test_scatter_of_a_single_request_reshapes_to_its_input_shape():
    req = ragged_request([1, 2, 3])
    (part,) = split(Outputs([Tensor("DOUBLED", "FP32", [3], np.array([2, 4, 6], np.float32))]), [1], [req], LAYOUT)
    assert isinstance(part, Outputs) and part.tensors[0].shape == [1, 3]


def test_scatter_fails_the_batch_when_the_output_is_too_short():
    reqs = [ragged_request([1, 2, 3]), ragged_request([4, 5])]
    out = split(Outputs([Tensor("DOUBLED", "FP32", [4], np.zeros(4, np.float32))]), [1, 1], reqs, LAYOUT)
    assert all(isinstance(r, PierError) and "has 4 elements" in r.message for r in out)


def test_fixed_dims_in_the_output_shape_are_kept():
    layout = BatchLayout(frozenset({"INPUT"}), (), (ScatterOutput("PAIRS", "INPUT", (-1, -1, 2)),))
    reqs = [ragged_request([1, 2]), ragged_request([3])]
    out = split(Outputs([Tensor("PAIRS", "FP32", [6], np.arange(6, dtype=np.float32))]), [1, 1], reqs, layout)
    assert [p.tensors[0].data.tolist() for p in out] == [[[[0, 1], [2, 3]]], [[[4, 5]]]]  # type: ignore[union-attr]


# ---- through the dynamic batcher with a toy ragged backend ---------------------------------


class RaggedSum(ModelInstance):
    """What a ragged model does: INPUT is 1-D over the batch, INDEX its accumulated counts.
    SUM [n, 1]: each request's sum (requests of batch 1); DOUBLED: INPUT * 2 (batch output)."""

    def __init__(self, delay: float = 0.0, gate: threading.Event | None = None) -> None:
        self.batches: list[list[int]] = []
        self.delay = delay
        self.gate = gate

    def execute(self, requests):
        (req,) = requests
        if self.gate is not None:
            self.gate.wait(10)
        if self.delay:
            time.sleep(self.delay)
        by_name = {t.name: t.data for t in req.inputs}
        x, index = by_name["INPUT"], by_name["INDEX"]
        assert x.ndim == 1, x.shape  # a ragged input reaches the backend as one 1-D tensor
        ends = index.astype(np.int64)
        starts = np.concatenate([[0], ends[:-1]])
        self.batches.append([int(e - s) for s, e in zip(starts, ends)])
        sums = np.array([[x[s:e].sum()] for s, e in zip(starts, ends)], dtype=np.float32)
        return [Outputs([Tensor("SUM", "FP32", list(sums.shape), sums),
                         Tensor("DOUBLED", "FP32", list(x.shape), x * 2)])]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_dynamic_batcher_batches_different_lengths_and_answers_each_its_own():
    async def main():
        inst = RaggedSum(delay=0.002)
        stats = ModelStatistics()
        policy = BatchingPolicy(max_batch_size=8, max_queue_delay_us=5000)
        b = DynamicBatcher([inst], stats, "ragged", policy, LAYOUT)
        rng = np.random.default_rng(0)
        items = [WorkItem(ragged_request(rng.integers(0, 100, size=1 + i % 7).astype(np.float32)), 1)
                 for i in range(40)]
        results = await asyncio.gather(*(b.enqueue(it) for it in items))
        for it, res in zip(items, results):
            assert not isinstance(res, Exception), res
            x = it.request.inputs[0].data
            got = {t.name: t.data for t in res.tensors}
            np.testing.assert_array_equal(got["SUM"], [[x.sum()]])
            assert got["DOUBLED"].shape == x.shape
            np.testing.assert_array_equal(got["DOUBLED"], x * 2)
        await b.stop()
        assert stats.execution_count < len(items)
        # batches really mixed lengths
        assert any(len(set(batch)) > 1 for batch in inst.batches), inst.batches
    run(main())


def test_without_ragged_config_different_lengths_never_share_a_batch():
    """The control for the test above: it is allow_ragged_batch that lets them share."""
    async def main():
        gate = threading.Event()
        inst = RaggedSum(gate=gate)
        layout = BatchLayout(ragged_inputs=frozenset(), batch_inputs=(SUM_INDEX,))
        b = DynamicBatcher([inst], ModelStatistics(), "plain", BatchingPolicy(8, max_queue_delay_us=50_000), layout)
        items = [WorkItem(ragged_request(np.ones(n, np.float32)), 1) for n in (3, 3, 4, 4, 5)]
        tasks = [asyncio.ensure_future(b.enqueue(it)) for it in items]
        await asyncio.sleep(0.01)
        gate.set()
        await asyncio.gather(*tasks)
        await b.stop()
        assert all(len(set(batch)) == 1 for batch in inst.batches), inst.batches
    run(main())


def test_a_batch_that_cannot_be_formed_fails_its_requests_and_the_batcher_goes_on():
    """A batch input whose source a request lacks (validation stops this earlier in the server)."""
    async def main():
        layout = BatchLayout(frozenset({"INPUT"}), (BatchInputSpec("BATCH_ELEMENT_COUNT", ("N",), "INT32",
                                                                   ("MISSING",)),))
        b = DynamicBatcher([RaggedSum()], ModelStatistics(), "broken", BatchingPolicy(8), layout)
        for _ in range(2):  # the first failure leaves the batcher serving (the instance is idle again)
            res = await asyncio.wait_for(b.enqueue(WorkItem(ragged_request([1, 2]), 1)), 5)
            assert isinstance(res, PierError) and "input 'MISSING' is needed to form the batch" in res.message
        await asyncio.wait_for(b.stop(), 5)  # nothing left hanging
    run(main())


def test_direct_scheduler_with_a_layout_shapes_a_batch_of_one():
    async def main():
        d = DirectScheduler([RaggedSum()], ModelStatistics(), "direct", LAYOUT)
        res = await d.enqueue(WorkItem(ragged_request([1, 2, 3, 4]), 1))
        await d.stop()
        assert not isinstance(res, Exception), res
        got = {t.name: t.data for t in res.tensors}
        np.testing.assert_array_equal(got["SUM"], [[10]])
        np.testing.assert_array_equal(got["DOUBLED"], [[2, 4, 6, 8]])
    run(main())


# ---- config: spec, batching policy, validation ---------------------------------------------

RAGGED_CONFIG = """
name: "m"
platform: "onnxruntime_onnx"
max_batch_size: 8
input [ { name: "INPUT" data_type: TYPE_FP32 dims: [ -1 ] allow_ragged_batch: true },
        { name: "OPT" data_type: TYPE_FP32 dims: [ -1 ] optional: true } ]
output [ { name: "SUM" data_type: TYPE_FP32 dims: [ 1 ] },
         { name: "DOUBLED" data_type: TYPE_FP32 dims: [ -1 ] } ]
batch_input [ { kind: BATCH_ACCUMULATED_ELEMENT_COUNT target_name: "INDEX" data_type: TYPE_FP32
                source_input: "INPUT" } ]
batch_output [ { kind: BATCH_SCATTER_WITH_INPUT_SHAPE target_name: "DOUBLED" source_input: "INPUT" } ]
dynamic_batching { max_queue_delay_microseconds: 100 }
"""


def _complete(text: str) -> mc.ModelConfig:
    raw = model_config.parse_config_text(text, "/repo/m/config.pbtxt")
    return model_config.complete_config(raw, "m", [], "/repo/m/config.pbtxt", False, lambda e, p: None)


def test_spec_and_policy_carry_the_ragged_config():
    config = _complete(RAGGED_CONFIG)
    spec = spec_of.build_spec(config)
    assert spec.input("INPUT").allow_ragged_batch and not spec.input("OPT").allow_ragged_batch
    assert spec.batch_inputs == (SUM_INDEX,)
    assert spec.batch_outputs[0].target_names == ("DOUBLED",) and spec.batch_outputs[0].source_inputs == ("INPUT",)
    assert spec.batching is not None and BatchLayout.from_spec(spec) == LAYOUT
    plain = _complete(RAGGED_CONFIG.split("batch_input")[0].replace("allow_ragged_batch: true", "")
                      + "dynamic_batching { }")
    assert spec_of.build_spec(plain).batching is not None and BatchLayout.from_spec(spec_of.build_spec(plain)) is None


def _variant(old: str, new: str) -> str:
    assert old in RAGGED_CONFIG
    return RAGGED_CONFIG.replace(old, new)


@pytest.mark.parametrize("text,fragment", [
    (_variant('data_type: TYPE_FP32\n                source_input: "INPUT"',
              'data_type: TYPE_FP32\n                source_input: "NOPE"'),
     "unknown source input name 'NOPE'"),
    (_variant("max_batch_size: 8", "max_batch_size: 0"),
     "input 'INPUT' sets allow_ragged_batch, which needs max_batch_size > 0"),
    (_variant("data_type: TYPE_FP32\n                source_input",
              "data_type: TYPE_INT64\n                source_input"),
     "batch input data type must be TYPE_INT32 or TYPE_FP32"),
    (_variant('source_input: "INPUT" } ]\nbatch_output', 'source_input: [ "INPUT", "OPT" ] } ]\nbatch_output'),
     "batch input kind 'BATCH_ACCUMULATED_ELEMENT_COUNT' expects 1 source input, got 2"),
    (_variant('target_name: "INDEX"', 'target_name: "OPT"'),
     "batch input target 'OPT' is also declared as a model input"),
    (_variant('target_name: "INDEX"', ""), "needs a target_name"),
    (_variant('target_name: "INDEX"', 'target_name: [ "INDEX", "INDEX" ]'),
     "batch input target 'INDEX' can only be specified once"),
    (_variant('target_name: "DOUBLED" source_input: "INPUT"', 'target_name: "NOPE" source_input: "INPUT"'),
     "unknown target output name 'NOPE'"),
    (_variant('target_name: "DOUBLED" source_input: "INPUT"', 'target_name: "DOUBLED" source_input: "X"'),
     "unknown source input name 'X'"),
    (_variant('target_name: "DOUBLED" source_input: "INPUT"', 'target_name: "DOUBLED"'),
     "batch output kind 'BATCH_SCATTER_WITH_INPUT_SHAPE' expects 1 source input, got 0"),
    (_variant('target_name: "DOUBLED" source_input', 'target_name: [ "DOUBLED", "DOUBLED" ] source_input'),
     "target output name 'DOUBLED' can only be specified once"),
])
def test_invalid_ragged_configs_are_rejected(text, fragment):
    with pytest.raises(PierError) as err:
        _complete(text)
    assert fragment in err.value.message and "/repo/m/config.pbtxt" in err.value.message


def test_valid_ragged_config_is_accepted():
    _complete(RAGGED_CONFIG)


def test_a_request_must_carry_an_optional_input_that_a_batch_input_reads():
    text = _variant('source_input: "INPUT" } ]\nbatch_output', 'source_input: "OPT" } ]\nbatch_output')
    spec = spec_of.build_spec(_complete(text))
    req = ragged_request([1, 2, 3])
    with pytest.raises(PierError) as err:
        validate_request(spec, req)
    assert "input 'OPT' is optional but model 'm' needs it" in err.value.message
    req.inputs.append(Tensor("OPT", "FP32", [1, 2], np.zeros((1, 2), np.float32)))
    assert validate_request(spec, req) == 1
