"""Triton's sequence batcher, for stateful models (`sequence_batching` in the config).

Every request names its sequence with the `sequence_id` parameter (a non-zero integer or a
non-empty string) and marks the first and last with `sequence_start` / `sequence_end`. The
batcher:
- gives a sequence, at START, a slot of one instance (server/scheduling/sequence_slots.py) and
  runs all its requests on that instance, as Triton does, so that a model keeping state per
  sequence in its instance (a dict keyed by correlation ID in `self`) sees all of them; when every
  slot is taken a new sequence waits for one (Triton's backlog, counted as pending). Each instance
  has a scheduler of its own: a dynamic batcher with the strategy's `max_queue_delay_microseconds`
  (and, for `oldest`, its preferred batch sizes), or the one-at-a-time scheduler for models that do
  not batch, so sequences on one instance share its batches (Triton's per-instance batchers);
- frees the slot when the sequence ends, when it sits idle longer than
  `max_sequence_idle_microseconds` (a timer reaps it, so a waiting sequence gets the slot), or when
  its instance loses its state (a Python stub that died: `instance_lost`); the next request of it
  without START then gets Triton's error, as does a request without a correlation ID, of batch
  size other than 1, or queued behind the request that ended its sequence;
- runs a sequence's requests one at a time, in arrival order, and hands the model the control
  inputs it configured: START, END, READY (always 1: no empty slots are ever sent) and CORRID,
  each a [1, 1] tensor ([1] without batching) of the configured datatype and false/true values;
- keeps implicit state (`state`): the model's state output of one request is the state input of
  the next; the first request of a sequence gets the configured `initial_state` (zeros, or a
  `data_file` from the model's `initial_state` folder) or zeros. A state output reaches the client
  only when the config also lists it as a model output (Triton's debugging rule).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pier.contract.errors import ErrorCode, PierError, internal, invalid_arg, unavailable
from pier.contract.policies import SequencePolicy
from pier.contract.types import ExecuteResult, InferenceRequest, Outputs, RequestedOutput, Tensor
from pier.scheduling.base import Scheduler, WorkItem
from pier.scheduling.sequence_slots import SequenceSlots, Slot
from pier.tensors.datatypes import numpy_dtype

CorrelationId = int | str


@dataclass(slots=True, eq=False)
class _Sequence:
    corrid: CorrelationId
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    state: dict[str, np.ndarray] = field(default_factory=dict)
    last_ns: int = field(default_factory=time.perf_counter_ns)  # when its last request was answered
    users: int = 0  # requests of this sequence accepted and not yet answered
    slot: Slot | None = None  # held from START until it ends, idles out or its instance is lost


def correlation_id(request: InferenceRequest) -> CorrelationId:
    """The request's sequence_id; 0 or "" when it has none."""
    value = request.parameters.get("sequence_id", 0)
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise invalid_arg(f"Unable to parse 'sequence_id': expected an unsigned integer or a string, got {value!r}")
    if isinstance(value, int) and not 0 <= value < 2**64:
        raise invalid_arg(f"Unable to parse 'sequence_id': expected an unsigned integer or a string, got {value}")
    return value


def _as_uint64(corrid: CorrelationId) -> int:
    """A string correlation ID for a numeric CORRID input: a stable 64-bit hash of it."""
    if isinstance(corrid, int):
        return corrid
    return int.from_bytes(hashlib.blake2b(corrid.encode(), digest_size=8).digest(), "little")


class SequenceBatcher(Scheduler):
    """`inners`: one scheduler per instance, in the order of the model's instances."""

    def __init__(self, inners: list[Scheduler], policy: SequencePolicy, model_name: str) -> None:
        self._inners = inners
        self._policy = policy
        self._model = model_name
        self._slots = SequenceSlots(len(inners), policy.slots)
        self._sequences: dict[CorrelationId, _Sequence] = {}
        self._holders: dict[Slot, _Sequence] = {}  # every slot in use, and its sequence
        self._idle: dict[CorrelationId, _Sequence] = {}  # holding a slot, nothing in flight: longest idle first
        self._reaper: asyncio.TimerHandle | None = None
        self._iterations = 0  # correlation IDs of iterative sequences
        self._waiting = 0  # requests waiting for their sequence's earlier request to finish, or for a slot
        self._stopping: asyncio.Event | None = None  # set by stop(); set again when nothing waits any more

    def _not_started(self, corrid: CorrelationId) -> PierError:
        return invalid_arg(f"inference request for sequence {corrid} to model '{self._model}' must specify the "
                           "START flag on the first request of the sequence")

    def _not_batch_one(self) -> PierError:
        return invalid_arg(f"inference request to model '{self._model}' must specify batch-size 1 due to "
                           "requirements of sequence batcher")

    def _gone(self, seq: _Sequence, now: int) -> bool:
        """Ended (no slot), or idle past the limit, with no request of it in flight."""
        return not seq.users and (seq.slot is None or now - seq.last_ns > self._policy.idle_ns)

    def _sequence(self, corrid: CorrelationId, start: bool, now: int) -> _Sequence:
        seq = self._sequences.get(corrid)
        if seq is not None and self._gone(seq, now):
            self._forget(seq)
            seq = None
        if seq is None:
            if not start:
                raise self._not_started(corrid)
            seq = self._sequences[corrid] = _Sequence(corrid)
        return seq

    # ---- slots -----------------------------------------------------------------------------

    def _hold(self, seq: _Sequence, slot: Slot) -> None:
        seq.slot = slot
        self._holders[slot] = seq

    def _free(self, seq: _Sequence) -> None:
        """The sequence is over: its slot goes to the next sequence."""
        if seq.slot is not None:
            slot, seq.slot = seq.slot, None
            del self._holders[slot]
            self._slots.release(slot)

    def _forget(self, seq: _Sequence) -> None:
        """Free the slot of a sequence with nothing in flight and forget it."""
        self._free(seq)
        if self._sequences.get(seq.corrid) is seq:
            del self._sequences[seq.corrid]
        if self._idle.get(seq.corrid) is seq:
            del self._idle[seq.corrid]

    def _rest(self, seq: _Sequence) -> None:
        """The sequence's last request in flight was answered: free at its end, else idle from now."""
        if seq.slot is None:
            self._forget(seq)
            return
        seq.last_ns = time.perf_counter_ns()
        self._idle.pop(seq.corrid, None)
        self._idle[seq.corrid] = seq  # the newest idle last
        if self._reaper is None:
            self._arm(seq.last_ns)

    def _arm(self, now: int) -> None:
        if self._idle:
            first = next(iter(self._idle.values()))
            delay_ns = max(first.last_ns + self._policy.idle_ns - now, 0)
            self._reaper = asyncio.get_running_loop().call_later(delay_ns / 1e9 + 1e-4, self._reap)

    def _reap(self) -> None:
        """Free the slots of the sequences idle past max_sequence_idle_microseconds."""
        self._reaper = None
        now = time.perf_counter_ns()
        while self._idle:
            seq = next(iter(self._idle.values()))
            if now - seq.last_ns <= self._policy.idle_ns:
                break
            self._forget(seq)
        self._arm(now)

    def instance_lost(self, index: int) -> None:
        """Instance `index` lost what it held (its process died): its sequences are over; their next
        request without START gets Triton's error, and their slots go to waiting sequences."""
        for slot, seq in list(self._holders.items()):
            if slot[1] == index:
                self._free(seq)
                if not seq.users:
                    self._forget(seq)

    # ---- requests --------------------------------------------------------------------------

    def _waited(self) -> None:
        self._waiting -= 1
        if self._stopping is not None and not self._waiting:
            self._stopping.set()

    async def enqueue(self, item: WorkItem) -> ExecuteResult:
        if self._policy.iterative:
            return await self._iterate(item)
        request = item.request
        try:
            corrid = correlation_id(request)
            if not corrid:
                raise invalid_arg(f"inference request to model '{self._model}' must specify a non-zero or "
                                  "non-empty correlation ID")
            if self._policy.batched and item.batch_size != 1:
                raise self._not_batch_one()
            start = request.parameters.get("sequence_start") is True
            end = request.parameters.get("sequence_end") is True
            seq = self._sequence(corrid, start, time.perf_counter_ns())
        except PierError as exc:
            return exc
        seq.users += 1
        if self._idle.get(corrid) is seq:
            del self._idle[corrid]
        self._waiting += 1  # behind the sequence's earlier request, or for a slot: pending, as in Triton
        waiting = True
        try:
            async with seq.lock:  # FIFO: a sequence's requests run one at a time, in arrival order
                if start:
                    seq.state.clear()
                    if seq.slot is None:
                        self._hold(seq, await self._slots.acquire())
                self._waited()
                waiting = False
                if seq.slot is None:  # ended, idled out or lost its instance before this request's turn
                    return self._not_started(corrid)
                run = self._with_controls(request, corrid, start, end, seq)
                result = await self._inners[seq.slot[1]].enqueue(dataclasses.replace(item, request=run))
                if not isinstance(result, Exception):
                    result = self._keep_state(result, seq, request)
                if end:
                    self._free(seq)
        finally:
            if waiting:  # cancelled before its turn
                self._waited()
            seq.users -= 1
            if not seq.users:
                self._rest(seq)
        return result

    async def _iterate(self, item: WorkItem) -> ExecuteResult:
        """Triton's iterative sequence: each request is a sequence of its own (the client names no
        correlation ID; the batcher makes one), with a slot like any. Its first execution carries
        START; each time the model releases it with RESCHEDULE it is queued again on the same
        instance, without START (Triton never sends END here: the model ends the sequence by
        answering). A request whose client went away is not run again."""
        request = item.request
        if self._policy.batched and item.batch_size != 1:
            return self._not_batch_one()
        self._iterations += 1
        corrid = self._iterations
        seq, start = _Sequence(corrid), True
        self._waiting += 1
        try:
            self._hold(seq, await self._slots.acquire())
        finally:
            self._waited()
        try:
            while True:
                if seq.slot is None:
                    return unavailable(f"the instance of model '{self._model}' that ran the request's sequence "
                                       f"{corrid} lost its state (its process died): send the request again")
                run = self._with_controls(request, corrid, start, False, seq)
                run.parameters = {**request.parameters, "sequence_id": corrid, "sequence_start": start,
                                  "sequence_end": False}
                result = await self._inners[seq.slot[1]].enqueue(WorkItem(run, item.batch_size))
                if isinstance(result, Exception):
                    return result
                if not result.reschedule:
                    return self._keep_state(result, seq, request)
                if request.cancelled:
                    return PierError(ErrorCode.CANCELLED, f"request to model '{self._model}' was cancelled")
                start = False
        finally:
            self._free(seq)

    def _with_controls(self, request: InferenceRequest, corrid: CorrelationId, start: bool, end: bool,
                       seq: _Sequence) -> InferenceRequest:
        lead = (1,) if self._policy.batched else ()
        extra = []
        for c in self._policy.controls:
            if c.kind == "CORRID":  # a numeric CORRID narrower than 64 bits wraps, as Triton's cast does
                value: Any = (corrid if isinstance(corrid, str) else str(corrid)).encode() if c.datatype == "BYTES" \
                    else np.uint64(_as_uint64(corrid)).astype(numpy_dtype(c.datatype))
            else:
                flag = {"START": start, "END": end, "READY": True}[c.kind]
                value = c.values[1] if flag else c.values[0]
            data = np.full(lead + (1,), value, dtype=numpy_dtype(c.datatype))
            extra.append(Tensor(c.name, c.datatype, list(data.shape), data))
        for s in self._policy.states:
            state = seq.state.get(s.input_name)
            data = state if state is not None else s.initial.reshape(lead + s.initial.shape)
            extra.append(Tensor(s.input_name, s.datatype, list(data.shape), data))
        outputs = request.outputs
        if outputs and self._policy.states:  # the model must also produce the state outputs
            asked = {o.name for o in outputs}
            outputs = outputs + [RequestedOutput(s.output_name) for s in self._policy.states
                                 if s.output_name not in asked]
        return dataclasses.replace(request, inputs=request.inputs + extra, outputs=outputs)

    def _keep_state(self, result: Outputs, seq: _Sequence, request: InferenceRequest) -> ExecuteResult:
        if not self._policy.states:
            return result
        by_name = {t.name: t for t in result.tensors}
        for s in self._policy.states:
            t = by_name.get(s.output_name)
            if t is None:
                return internal(f"model '{self._model}' did not produce its state output '{s.output_name}'")
            seq.state[s.input_name] = np.array(t.data, copy=True)
        shown = self._policy.returned_states  # a client asking for no outputs in particular gets all of these
        if request.outputs:
            shown = shown & {o.name for o in request.outputs}
        hidden = {s.output_name for s in self._policy.states} - shown
        return Outputs([t for t in result.tensors if t.name not in hidden])

    def inflight_count(self) -> int:
        return sum(inner.inflight_count() for inner in self._inners) + self._waiting

    def pending_count(self) -> int:
        return sum(inner.pending_count() for inner in self._inners) + self._waiting

    async def stop(self) -> None:
        """New sequences and those still waiting for a slot fail; the requests of running sequences
        (those queued behind their sequence's earlier request included) finish; then the instances
        stop."""
        self._stopping = asyncio.Event()
        self._slots.close(unavailable(f"model '{self._model}' is unloading: no new sequences are accepted"))
        while self._waiting:
            self._stopping.clear()
            await self._stopping.wait()
        if self._reaper is not None:
            self._reaper.cancel()
            self._reaper = None
        await asyncio.gather(*(inner.stop() for inner in self._inners))
