"""Triton's sequence batcher, for stateful models (`sequence_batching` in the config).

Every request names its sequence with the `sequence_id` parameter (a non-zero integer or a
non-empty string) and marks the first and last with `sequence_start` / `sequence_end`. The
batcher:
- refuses, as Triton does, a request without a correlation ID, a request of batch size other than
  1, and a first request without START (after END, or after the sequence sat idle longer than
  `max_sequence_idle_microseconds`, the sequence is gone);
- runs a sequence's requests one at a time, in arrival order, and hands the model the control
  inputs it configured: START, END, READY (always 1: no empty slots are ever sent) and CORRID,
  each a [1, 1] tensor ([1] without batching) of the configured datatype and false/true values;
- keeps implicit state (`state`): the model's state output of one request is the state input of
  the next; the first request of a sequence gets the configured `initial_state` (zeros, or a
  `data_file` from the model's `initial_state` folder) or zeros. A state output reaches the client
  only when the config also lists it as a model output (Triton's debugging rule).
Requests of different sequences share batches through the scheduler this one wraps: a dynamic
batcher with the strategy's `max_queue_delay_microseconds` (and, for `oldest`, its preferred batch
sizes), or the one-at-a-time scheduler for models that do not batch.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pier.contract.errors import ErrorCode, PierError, internal, invalid_arg
from pier.contract.policies import SequencePolicy
from pier.contract.types import ExecuteResult, InferenceRequest, Outputs, RequestedOutput, Tensor
from pier.scheduling.base import Scheduler, WorkItem
from pier.tensors.datatypes import numpy_dtype

CorrelationId = int | str


@dataclass(slots=True)
class _Sequence:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    state: dict[str, np.ndarray] = field(default_factory=dict)
    last_ns: int = field(default_factory=time.perf_counter_ns)
    users: int = 0  # requests of this sequence accepted and not yet answered
    ended: bool = False


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
    def __init__(self, inner: Scheduler, policy: SequencePolicy, model_name: str) -> None:
        self._inner = inner
        self._policy = policy
        self._model = model_name
        self._sequences: dict[CorrelationId, _Sequence] = {}
        self._swept_ns = time.perf_counter_ns()
        self._iterations = 0  # correlation IDs of iterative sequences
        self._waiting = 0  # requests waiting for their sequence's earlier request to finish

    def _not_started(self, corrid: CorrelationId) -> PierError:
        return invalid_arg(f"inference request for sequence {corrid} to model '{self._model}' must specify the "
                           "START flag on the first request of the sequence")

    def _not_batch_one(self) -> PierError:
        return invalid_arg(f"inference request to model '{self._model}' must specify batch-size 1 due to "
                           "requirements of sequence batcher")

    def _gone(self, seq: _Sequence, now: int) -> bool:
        """Ended, or idle past the limit, with no request of it in flight."""
        return not seq.users and (seq.ended or now - seq.last_ns > self._policy.idle_ns)

    def _sequence(self, corrid: CorrelationId, start: bool, now: int) -> _Sequence:
        seq = self._sequences.get(corrid)
        if seq is not None and self._gone(seq, now):
            del self._sequences[corrid]
            seq = None
        if seq is None:
            if not start:
                raise self._not_started(corrid)
            seq = self._sequences[corrid] = _Sequence()
        return seq

    def _sweep(self, now: int) -> None:
        """Forget sequences idle past the limit (at most once per idle period)."""
        if now - self._swept_ns < self._policy.idle_ns:
            return
        self._swept_ns = now
        for corrid in [c for c, s in self._sequences.items() if self._gone(s, now)]:
            del self._sequences[corrid]

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
            now = time.perf_counter_ns()
            self._sweep(now)
            seq = self._sequence(corrid, start, now)
        except PierError as exc:
            return exc
        seq.users += 1
        self._waiting += 1  # queued behind the sequence's earlier request: pending, as in Triton
        waiting = True
        try:
            async with seq.lock:  # FIFO: a sequence's requests run one at a time, in arrival order
                self._waiting -= 1
                waiting = False
                if start:
                    seq.state.clear()
                    seq.ended = False
                elif seq.ended:  # queued behind the request that ended the sequence
                    return self._not_started(corrid)
                run = self._with_controls(request, corrid, start, end, seq)
                result = await self._inner.enqueue(dataclasses.replace(item, request=run))
                if not isinstance(result, Exception):
                    result = self._keep_state(result, seq, request)
                if end:
                    seq.ended = True
                seq.last_ns = time.perf_counter_ns()
        finally:
            if waiting:  # cancelled before its turn
                self._waiting -= 1
            seq.users -= 1
            if seq.ended and not seq.users and self._sequences.get(corrid) is seq:
                del self._sequences[corrid]
        return result

    async def _iterate(self, item: WorkItem) -> ExecuteResult:
        """Triton's iterative sequence: each request is a sequence of its own (the client names no
        correlation ID; the batcher makes one). Its first execution carries START; each time the
        model releases it with RESCHEDULE it is queued again, without START (Triton never sends END
        here: the model ends the sequence by answering). A request whose client went away is not
        run again."""
        request = item.request
        if self._policy.batched and item.batch_size != 1:
            return self._not_batch_one()
        self._iterations += 1
        corrid = self._iterations
        seq, start = _Sequence(), True
        while True:
            run = self._with_controls(request, corrid, start, False, seq)
            run.parameters = {**request.parameters, "sequence_id": corrid, "sequence_start": start,
                              "sequence_end": False}
            result = await self._inner.enqueue(WorkItem(run, item.batch_size))
            if isinstance(result, Exception):
                return result
            if not result.reschedule:
                return self._keep_state(result, seq, request)
            if request.cancelled:
                return PierError(ErrorCode.CANCELLED, f"request to model '{self._model}' was cancelled")
            start = False

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
        return self._inner.inflight_count() + self._waiting

    def pending_count(self) -> int:
        return self._inner.pending_count() + self._waiting

    async def stop(self) -> None:
        await self._inner.stop()
