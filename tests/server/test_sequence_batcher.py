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
    return float(result.tensors[0].data[0])


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
        assert _value(await _step(model, user[2], 5, start=True)) == 5  # START again: the state starts afresh
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
