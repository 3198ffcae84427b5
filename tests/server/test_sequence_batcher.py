"""The sequence batcher (server/scheduling/sequence_batcher.py) over a toy stateful model, without a
server: each kind of control tensor as its config declares it and the implicit state between a
sequence's requests (hidden from the client unless listed as an output); a sequence runs one
request at a time in arrival order while another runs beside it, a request queued behind the
END is refused and a cancelled one leaves no trace; idle sequences are forgotten; a missing
state output is named; iterative sequences run again until the model answers, and stop when
their client has gone. (The refusals' exact words are checked against Triton through the server
in tests/e2e/test_sequence_batching.py.)"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import numpy as np

from pier.contract.errors import ErrorCode, PierError
from pier.contract.types import ExecuteResult, InferenceRequest, Outputs
from pier.lifecycle.loaded_model import LoadedModel
from pier.scheduling.base import WorkItem
from tests.server.toy import Toy, load, outputs, tensor

ACCUMULATE = """name: "acc" backend: "onnxruntime" max_batch_size: 0
input [ { name: "INPUT" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_FP32 dims: [ 1 ] } ]
instance_group [ { count: 2 kind: KIND_CPU } ]
sequence_batching {
  max_sequence_idle_microseconds: 60000000
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START fp32_false_true: [ -1, 1 ] } ] },
    { name: "END" control [ { kind: CONTROL_SEQUENCE_END int32_false_true: [ 5, 7 ] } ] },
    { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY bool_false_true: [ false, true ] } ] },
    { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 } ] }
  ]
  state [ { input_name: "STATE_IN" output_name: "STATE_OUT" data_type: TYPE_FP32 dims: [ 1 ] } ]
}
"""


STABLE_USER_7 = 11056362442684682814  # the CORRID of sequence "user-7": the same in every process, every run


class Accumulator:
    """OUTPUT = STATE_OUT = STATE_IN + INPUT. Keeps what each execution saw; an INPUT of -1 waits
    for `hold` (opened by the test); `keep_state=False` forgets to produce STATE_OUT."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []
        self.hold = threading.Event()
        self.keep_state = True
        self.lock = threading.Lock()

    def __call__(self, request: InferenceRequest) -> ExecuteResult:
        t = {x.name: x for x in request.inputs}
        if float(t["INPUT"].data[0]) == -1:
            assert self.hold.wait(10)
        with self.lock:
            self.seen.append({name: (x.data.tolist(), x.datatype, x.shape) for name, x in t.items()})
        total = t["STATE_IN"].data + t["INPUT"].data
        if not self.keep_state:
            return outputs(tensor("OUTPUT", total))
        return outputs(tensor("OUTPUT", total), tensor("STATE_OUT", total))


def _step(model: LoadedModel, corrid: int | str, value: float, start: bool = False,
          end: bool = False) -> asyncio.Future[ExecuteResult]:
    params: dict[str, object] = {"sequence_id": corrid}
    if start:
        params["sequence_start"] = True
    if end:
        params["sequence_end"] = True
    request = InferenceRequest("acc", "", [tensor("INPUT", [value])], parameters=params)
    return asyncio.ensure_future(model.scheduler.enqueue(WorkItem(request, 1)))


def _value(result: ExecuteResult) -> float:
    assert isinstance(result, Outputs), result
    return float(result.tensors[0].data.flat[0])


def test_controls_and_state_reach_the_model_as_its_config_declares_them() -> None:
    async def main() -> None:
        acc = Accumulator()
        model = load(ACCUMULATE, Toy(acc))
        assert [_value(await _step(model, 42, v, start=v == 1, end=v == 3)) for v in (1, 2, 3)] == [1, 3, 6]
        first, last = acc.seen[0], acc.seen[2]
        assert first["START"] == ([1.0], "FP32", [1]) and last["START"] == ([-1.0], "FP32", [1])
        assert first["END"] == ([5], "INT32", [1]) and last["END"] == ([7], "INT32", [1])
        assert first["READY"] == last["READY"] == ([True], "BOOL", [1])
        assert first["CORRID"] == ([42], "UINT64", [1])
        assert [s["STATE_IN"][0] for s in acc.seen] == [[0.0], [1.0], [3.0]]  # zeros, then the last state
        user = ["user-" + str(n) for n in (7, 7, 7, 8)]  # equal strings, not the same objects
        result = await _step(model, user[0], 10, start=True)
        assert [t.name for t in result.tensors] == ["OUTPUT"]  # the state is the server's, not the client's
        assert _value(await _step(model, user[1], 1)) == 11
        # START again: the state starts afresh; END frees the one instance's one slot for "user-8"
        assert _value(await _step(model, user[2], 5, start=True, end=True)) == 5
        await _step(model, user[3], 1, start=True)
        hashed = [s["CORRID"][0][0] for s in acc.seen[3:]]  # a string ID for a numeric CORRID: a stable hash
        assert hashed[:3] == [STABLE_USER_7] * 3 and hashed[3] not in (0, STABLE_USER_7)
        listed = load(ACCUMULATE.replace('dims: [ 1 ] } ]\ninstance', 'dims: [ 1 ] },\n'
                      '  { name: "STATE_OUT" data_type: TYPE_FP32 dims: [ 1 ] } ]\ninstance'), Toy(Accumulator()))
        result = await _step(listed, 1, 4, start=True)
        assert isinstance(result, Outputs) and [t.name for t in result.tensors] == ["OUTPUT", "STATE_OUT"]

    asyncio.run(main())


def test_a_sequence_runs_in_order_beside_another_and_refuses_what_follows_its_end() -> None:
    async def main() -> None:
        acc = Accumulator()
        model = load(ACCUMULATE, Toy(acc), Toy(acc))
        first = _step(model, 1, -1, start=True)  # held by the model
        await asyncio.sleep(0.05)
        ending = _step(model, 1, 2, end=True)
        after_end = _step(model, 1, 3)  # queued behind the END: the sequence is over by its turn
        await asyncio.sleep(0.05)
        assert model.scheduler.pending_count() == 2  # waiting their turn: pending, as in Triton
        assert _value(await _step(model, 2, 5, start=True, end=True)) == 5  # the other instance, meanwhile
        acc.hold.set()
        assert (_value(await first), _value(await ending)) == (-1, 1)
        refused = await after_end
        assert isinstance(refused, PierError) and refused.code is ErrorCode.INVALID_ARG
        assert "sequence 1 to model 'acc' must specify the START flag" in refused.message
        assert [s["INPUT"][0] for s in acc.seen] == [[5.0], [-1.0], [2.0]]
        assert model.scheduler.pending_count() == 0 and model.scheduler.inflight_count() == 0

    asyncio.run(main())


def test_a_request_cancelled_while_waiting_its_turn_leaves_no_trace() -> None:
    async def main() -> None:
        acc = Accumulator()
        model = load(ACCUMULATE, Toy(acc), Toy(acc))
        first = _step(model, 9, -1, start=True)
        await asyncio.sleep(0.05)
        gone = _step(model, 9, 100)
        await asyncio.sleep(0.05)
        assert model.scheduler.pending_count() == 1
        gone.cancel()  # its client went away
        await asyncio.sleep(0)
        assert model.scheduler.pending_count() == 0
        acc.hold.set()
        await first
        assert _value(await _step(model, 9, 1, end=True)) == 0  # -1 + 1: the cancelled 100 never ran
        assert all(s["INPUT"][0] != [100.0] for s in acc.seen)

    asyncio.run(main())


def test_an_idle_sequence_is_forgotten() -> None:
    async def main() -> None:
        model = load(ACCUMULATE.replace("60000000", "50000"), Toy(Accumulator()))  # 50 ms
        await _step(model, 3, 1, start=True)
        assert _value(await _step(model, 3, 1)) == 2
        time.sleep(0.1)
        refused = await _step(model, 3, 1)
        assert isinstance(refused, PierError) and "must specify the START flag" in refused.message
        assert _value(await _step(model, 3, 1, start=True)) == 1  # a new sequence of the same ID, afresh

    asyncio.run(main())


def test_a_missing_state_output_is_named() -> None:
    async def main() -> None:
        acc = Accumulator()
        acc.keep_state = False
        failed = await _step(load(ACCUMULATE, Toy(acc)), 1, 1, start=True)
        assert isinstance(failed, PierError) and failed.code is ErrorCode.INTERNAL
        assert failed.message == "model 'acc' did not produce its state output 'STATE_OUT'"

    asyncio.run(main())


ITERATIVE = """name: "it" backend: "onnxruntime" max_batch_size: 0
input [ { name: "TIMES" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "RUNS" data_type: TYPE_INT32 dims: [ 1 ] } ]
sequence_batching {
  iterative_sequence: true
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },
    { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 } ] }
  ]
}
"""


def test_an_iterative_sequence_runs_again_until_answered_and_stops_when_its_client_goes() -> None:
    runs: list[tuple[int, int, int]] = []  # (TIMES, START, CORRID) per execution
    requests: list[InferenceRequest] = []

    def iterate(request: InferenceRequest) -> ExecuteResult:
        t = {x.name: int(x.data[0]) for x in request.inputs}
        runs.append((t["TIMES"], t["START"], t["CORRID"]))
        done = sum(1 for r in runs if r[2] == t["CORRID"])
        if done < t["TIMES"]:
            if t["TIMES"] == 99 and done == 2:
                requests[-1].cancelled = True  # the client goes away while it iterates
            return Outputs([], reschedule=True)  # released: run me again
        return outputs(tensor("RUNS", [done], "INT32"))

    async def main() -> None:
        model = load(ITERATIVE, Toy(iterate))
        first = InferenceRequest("it", "", [tensor("TIMES", [3], "INT32")])
        result = await model.scheduler.enqueue(WorkItem(first, 1))
        assert isinstance(result, Outputs) and result.tensors[0].data.tolist() == [3]
        assert [r[:2] for r in runs] == [(3, 1), (3, 0), (3, 0)]  # START on the first execution only
        assert len({r[2] for r in runs}) == 1 and runs[0][2] != 0  # one correlation ID, made by the batcher
        requests.append(InferenceRequest("it", "", [tensor("TIMES", [99], "INT32")]))
        cancelled = await model.scheduler.enqueue(WorkItem(requests[-1], 1))
        assert isinstance(cancelled, PierError) and cancelled.code is ErrorCode.CANCELLED
        assert [r[0] for r in runs].count(99) == 2 and runs[3][2] != runs[0][2]  # not run again; its own ID
        batched = load(ITERATIVE.replace("max_batch_size: 0", "max_batch_size: 4"), Toy(iterate))
        two = InferenceRequest("it", "", [tensor("TIMES", [[1], [1]], "INT32")])
        refused = await batched.scheduler.enqueue(WorkItem(two, 2))  # as Triton: one request, one sequence
        assert isinstance(refused, PierError) and "must specify batch-size 1" in refused.message

    asyncio.run(main())


KEEPER = """name: "keep" backend: "onnxruntime" max_batch_size: 4
input [ { name: "INPUT" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_FP32 dims: [ 1 ] } ]
instance_group [ { count: 2 kind: KIND_CPU } ]
sequence_batching {
  max_sequence_idle_microseconds: 60000000
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },
    { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 } ] }
  ]
  STRATEGY
}
"""
STRATEGIES = {"direct": "direct { }",
              "oldest": "oldest { max_candidate_sequences: 4 max_queue_delay_microseconds: 500 }"}


class Keeper:
    """A model keeping each sequence's sum in its instance (a dict keyed by CORRID, as stateful python
    models do): OUTPUT = the sum so far. A request reaching another instance than its sequence's
    starts from 0 there: a wrong sum."""

    def __init__(self) -> None:
        self.sums: dict[int, float] = {}
        self.corrids: set[int] = set()

    def __call__(self, request: InferenceRequest) -> ExecuteResult:
        t = {x.name: x.data for x in request.inputs}
        corrid = int(t["CORRID"].flat[0])
        self.corrids.add(corrid)
        total = (0.0 if t["START"].flat[0] else self.sums.get(corrid, 0.0)) + float(t["INPUT"].flat[0])
        self.sums[corrid] = total
        return outputs(tensor("OUTPUT", np.full(t["INPUT"].shape, total)))


def _keeper_step(model: LoadedModel, corrid: int, value: float, start: bool = False,
                 end: bool = False) -> asyncio.Future[ExecuteResult]:
    params: dict[str, object] = {"sequence_id": corrid, "sequence_start": start, "sequence_end": end}
    batched = model.spec.max_batch_size > 0
    request = InferenceRequest("keep", "", [tensor("INPUT", [[value]] if batched else [value])], parameters=params)
    return asyncio.ensure_future(model.scheduler.enqueue(WorkItem(request, 1)))


def test_every_request_of_a_sequence_runs_on_the_instance_that_holds_its_slot() -> None:
    """Triton's promise, for both strategies: 8 sequences at once over 2 instances of 4 slots each,
    their requests interleaved; each sequence's requests all reach one instance (so the sums a
    model keeps per instance are right), and the sequences spread over both."""
    async def run(strategy: str) -> None:
        keepers = [Keeper(), Keeper()]
        model = load(KEEPER.replace("STRATEGY", STRATEGIES[strategy]), *(Toy(k) for k in keepers))
        sequences = range(101, 109)
        for step in range(6):
            results = await asyncio.gather(*(_keeper_step(model, s, s + step, start=step == 0, end=step == 5)
                                             for s in sequences))
            assert [_value(r) for r in results] == [sum(s + k for k in range(step + 1)) for s in sequences], step
        assert keepers[0].corrids.isdisjoint(keepers[1].corrids)
        assert keepers[0].corrids | keepers[1].corrids == set(sequences) and all(k.corrids for k in keepers)
        assert model.scheduler.inflight_count() == 0
        await model.stop()

    for strategy in STRATEGIES:
        asyncio.run(run(strategy))


def _where(keepers: list[Keeper], corrid: int) -> int:
    return next(i for i, k in enumerate(keepers) if corrid in k.corrids)


def test_a_new_sequence_waits_for_a_slot_and_gets_the_one_released() -> None:
    """Two instances of one slot each: a third sequence waits (pending) until one ends, then runs on
    that one's instance; a fourth gets the slot of the sequence idle the longest once it passes
    max_sequence_idle_microseconds (no request of the idle one needed), whose next request without
    START is then refused as Triton refuses it."""
    async def main() -> None:
        keepers = [Keeper(), Keeper()]
        config = KEEPER.replace("max_batch_size: 4", "max_batch_size: 0").replace("STRATEGY", "") \
            .replace("60000000", "200000")  # 0.2 s
        model = load(config, *(Toy(k) for k in keepers))
        assert _value(await _keeper_step(model, 1, 1, start=True)) == 1
        assert _value(await _keeper_step(model, 2, 2, start=True)) == 2
        third = _keeper_step(model, 3, 3, start=True)
        await asyncio.sleep(0.05)
        assert not third.done() and model.scheduler.pending_count() == 1  # in the backlog: pending, as in Triton
        assert _value(await _keeper_step(model, 1, 10, end=True)) == 11
        assert _value(await third) == 3 and _where(keepers, 3) == _where(keepers, 1)
        fourth = _keeper_step(model, 4, 4, start=True)
        await asyncio.sleep(0.05)
        assert not fourth.done()
        assert _value(await asyncio.wait_for(fourth, 2)) == 4  # sequence 2 idled out: its slot
        assert _where(keepers, 4) == _where(keepers, 2)
        refused = await _keeper_step(model, 2, 1)
        assert isinstance(refused, PierError) and refused.code is ErrorCode.INVALID_ARG
        assert refused.message == ("inference request for sequence 2 to model 'keep' must specify the START flag "
                                   "on the first request of the sequence")
        await model.stop()

    asyncio.run(main())


def test_the_sequences_of_an_instance_that_lost_its_state_are_over() -> None:
    """An instance whose process died (its health report): its sequences' next requests without START
    get Triton's error, and their slots serve new sequences; the other instance's go on."""
    async def main() -> None:
        keepers = [Keeper(), Keeper()]
        config = KEEPER.replace("max_batch_size: 4", "max_batch_size: 0").replace("STRATEGY", "")
        model = load(config, *(Toy(k) for k in keepers))
        model.instance_names = ["keep_0", "keep_1"]
        for s in (1, 2):
            await _keeper_step(model, s, s, start=True)
        waiting = _keeper_step(model, 3, 3, start=True)
        await asyncio.sleep(0.02)
        model.instance_lost(f"keep_{_where(keepers, 2)}")
        assert _value(await asyncio.wait_for(waiting, 2)) == 3 and _where(keepers, 3) == _where(keepers, 2)
        refused = await _keeper_step(model, 2, 5)
        assert isinstance(refused, PierError) and "sequence 2 to model 'keep' must specify the START" in refused.message
        assert _value(await _keeper_step(model, 1, 5, end=True)) == 6
        await model.stop()

    asyncio.run(main())


def test_unloading_fails_new_sequences_and_finishes_the_running_ones() -> None:
    """At unload a sequence waiting for a slot fails, as does a new one; a request queued behind its
    sequence's request in flight still runs before the instance stops."""
    async def main() -> None:
        acc = Accumulator()
        model = load(ACCUMULATE, Toy(acc))  # one instance, one slot
        first = _step(model, 1, -1, start=True)  # held by the model
        await asyncio.sleep(0.02)
        behind = _step(model, 1, 2)
        waiting = _step(model, 2, 5, start=True)
        await asyncio.sleep(0.02)
        stopping = asyncio.ensure_future(model.stop())
        late = _step(model, 3, 1, start=True)
        for refused in await asyncio.gather(waiting, late, return_exceptions=True):
            assert isinstance(refused, PierError) and refused.code is ErrorCode.UNAVAILABLE, refused
            assert refused.message == "model 'acc' is unloading: no new sequences are accepted"
        acc.hold.set()
        assert (_value(await first), _value(await behind)) == (-1, 1)
        await asyncio.wait_for(stopping, 5)

    asyncio.run(main())
