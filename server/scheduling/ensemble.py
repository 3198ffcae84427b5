"""Ensembles (`platform: "ensemble"`): the graph is checked when the ensemble loads, and each
request runs it as a data flow: a step starts as soon as every tensor it reads exists, so
independent steps run concurrently, and each step is an ordinary request to its model through
the data plane (so it batches with that model's other traffic and counts in its statistics).
A step with `model_version: -1` calls whatever version the composing model routes to now."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from pier.contract.errors import PierError, internal, invalid_arg, unavailable
from pier.contract.types import (
    ExecuteResult,
    InferenceRequest,
    InferenceResponse,
    ModelSpec,
    Outputs,
    RequestedOutput,
    ResponseSink,
    Tensor,
)
from pier.observability.statistics import ModelStatistics
from pier.protocol import model_config_pb2 as mc
from pier.scheduling.base import Scheduler, WorkItem

Infer = Callable[[InferenceRequest], Awaitable[InferenceResponse]]
Stream = Callable[[InferenceRequest], AsyncIterator[InferenceResponse | PierError]]
SpecLookup = Callable[[str, str], ModelSpec]  # (model, version or "") -> spec; raises PierError


@dataclass(frozen=True)
class Step:
    index: int
    model: str
    version: str  # "" = the version the model routes to when the request runs
    inputs: tuple[tuple[str, str], ...]  # (model input, ensemble tensor)
    outputs: tuple[tuple[str, str], ...]  # (model output, ensemble tensor)
    decoupled: bool = False  # the model answers with any number of responses

    @property
    def label(self) -> str:
        return f"step {self.index} (model '{self.model.rpartition('/')[2]}')"  # a namespaced key: its name


@dataclass(frozen=True)
class EnsemblePlan:
    name: str
    steps: tuple[Step, ...]
    outputs: tuple[tuple[str, str], ...]  # (ensemble output, datatype)
    optional_inputs: frozenset[str] = frozenset()  # ensemble inputs a request may leave out
    _needed: dict[frozenset[str], tuple[tuple[Step, ...], tuple[tuple[str, str], ...]]] = dataclasses.field(
        default_factory=dict, compare=False, repr=False)

    def needed(self, request: InferenceRequest) -> tuple[tuple[Step, ...], tuple[tuple[str, str], ...]]:
        """The steps and ensemble outputs that `request` needs. As Triton: a request that asks for
        some outputs runs only the steps those outputs depend on (a composing model that feeds
        none of them is not called, and its statistics show it)."""
        wanted = frozenset(o.name for o in request.outputs) & {name for name, _ in self.outputs}
        if not wanted or len(wanted) == len(self.outputs):
            return self.steps, self.outputs
        cached = self._needed.get(wanted)
        if cached is None:
            producer = {tensor: s for s in self.steps for _, tensor in s.outputs}
            keep: set[int] = set()
            todo = [producer[t] for t in wanted if t in producer]
            while todo:
                step = todo.pop()
                if step.index not in keep:
                    keep.add(step.index)
                    todo.extend(producer[t] for _, t in step.inputs if t in producer)
            cached = (tuple(s for s in self.steps if s.index in keep),
                      tuple(o for o in self.outputs if o[0] in wanted))
            if len(self._needed) < 64:  # requests choose the subsets: keep the cache bounded
                self._needed[wanted] = cached
        return cached

    def absent(self, request: InferenceRequest) -> frozenset[str]:
        """The optional ensemble inputs `request` left out: as Triton, the steps that read them run
        without them (their models' inputs are optional too, or those steps refuse the request)."""
        if not self.optional_inputs:
            return frozenset()
        return self.optional_inputs - {t.name for t in request.inputs}

    @staticmethod
    def ready(step: Step, tensors: dict[str, Tensor], absent: AbstractSet[str]) -> bool:
        return all(t in tensors or t in absent for _, t in step.inputs)

    @property
    def decoupled(self) -> bool:
        """A decoupled step makes the ensemble decoupled, as in Triton."""
        return any(s.decoupled for s in self.steps)


def _sequence_parameters(request: InferenceRequest) -> dict[str, bool | int | str]:
    """As Triton's ensemble scheduler: every ensemble response carries the sequence id and flags
    its steps ran with (0 and false for a request outside any sequence); qa L0_simple_ensemble
    reads them back from a streamed sequence."""
    p = request.parameters
    sequence_id = p.get("sequence_id", 0)
    return {"sequence_id": sequence_id if isinstance(sequence_id, (int, str)) else 0,
            "sequence_start": p.get("sequence_start") is True, "sequence_end": p.get("sequence_end") is True}


def _dims_agree(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    return len(a) == len(b) and all(x == y or x == -1 or y == -1 for x, y in zip(a, b))


def build_plan(config: mc.ModelConfig, spec: ModelSpec, lookup: SpecLookup) -> EnsemblePlan:
    """Check the graph (every tensor produced once, every step input available, no cycles,
    datatypes and shapes agree) and return the plan. Errors name the step and the tensor."""
    name = spec.name

    def fail(problem: str) -> PierError:
        return invalid_arg(f"ensemble '{name}': {problem}")

    raw_steps = list(config.ensemble_scheduling.step)
    if not raw_steps:
        raise fail("ensemble_scheduling has no step")
    # tensor -> (who produces it, datatype, dims, batches)
    produced: dict[str, tuple[str, str, tuple[int, ...]]] = {
        t.name: ("the ensemble input", t.datatype, t.dims) for t in spec.inputs}
    steps: list[Step] = []
    specs: list[ModelSpec] = []
    for i, raw in enumerate(raw_steps, start=1):
        step = Step(i, raw.model_name, "" if raw.model_version <= 0 else str(raw.model_version),
                    tuple(sorted(raw.input_map.items())), tuple(sorted(raw.output_map.items())))
        if not step.model:
            raise fail(f"step {i} names no model")
        try:
            m = lookup(step.model, step.version)
        except PierError as exc:
            raise fail(f"{step.label}: the model is not available: {exc.message}") from None
        if m.decoupled:
            step = dataclasses.replace(step, decoupled=True)
        if spec.max_batch_size > 0 and m.max_batch_size == 0:
            raise fail(f"{step.label}: the ensemble batches (max_batch_size {spec.max_batch_size}) but the model "
                       "does not (max_batch_size 0)")
        for model_input, _ in step.inputs:
            if m.input(model_input) is None:
                raise fail(f"{step.label}: the model has no input '{model_input}'")
        mapped = {k for k, _ in step.inputs}
        missing = [t.name for t in m.inputs if not t.optional and t.name not in mapped]
        if missing:
            raise fail(f"{step.label}: model input '{missing[0]}' is not mapped to any ensemble tensor")
        for model_output, tensor in step.outputs:
            out = m.output(model_output)
            if out is None:
                raise fail(f"{step.label}: the model has no output '{model_output}'")
            if tensor in produced:
                raise fail(f"tensor '{tensor}' is produced more than once: by {produced[tensor][0]} and by "
                           f"{step.label}")
            produced[tensor] = (step.label, out.datatype, out.dims)
        steps.append(step)
        specs.append(m)
    for step, m in zip(steps, specs):
        for model_input, tensor in step.inputs:
            if tensor not in produced:
                raise fail(f"{step.label}: input '{model_input}' reads tensor '{tensor}', which no step and no "
                           "ensemble input produces")
            who, datatype, dims = produced[tensor]
            want = m.input(model_input)
            assert want is not None
            if datatype != want.datatype:
                raise fail(f"{step.label}: input '{model_input}' expects {want.datatype} but tensor '{tensor}' "
                           f"from {who} is {datatype}")
            if not _dims_agree(dims, want.dims):
                raise fail(f"{step.label}: input '{model_input}' expects dims {list(want.dims)} but tensor "
                           f"'{tensor}' from {who} has dims {list(dims)}")
    read = {tensor for step in steps for _, tensor in step.inputs}
    for t in spec.inputs:  # as Triton, which refuses such an ensemble
        if t.name not in read:
            raise fail(f"ensemble input '{t.name}' is not used by any step")
    outputs = []
    for t in spec.outputs:
        if t.name not in produced or produced[t.name][0] == "the ensemble input":
            raise fail(f"ensemble output '{t.name}' is not produced by any step")
        who, datatype, dims = produced[t.name]
        if datatype != t.datatype:
            raise fail(f"ensemble output '{t.name}' is {t.datatype} but {who} produces {datatype}")
        if not _dims_agree(dims, t.dims):
            raise fail(f"ensemble output '{t.name}' has dims {list(t.dims)} but {who} produces {list(dims)}")
        outputs.append((t.name, t.datatype))
    _check_acyclic(steps, fail)
    return EnsemblePlan(name, tuple(steps), tuple(outputs), frozenset(t.name for t in spec.inputs if t.optional))


def _check_acyclic(steps: list[Step], fail: Callable[[str], PierError]) -> None:
    producer = {tensor: s for s in steps for _, tensor in s.outputs}
    state: dict[int, int] = {}  # 1 visiting, 2 done

    def visit(s: Step, path: list[str]) -> None:
        if state.get(s.index) == 2:
            return
        if state.get(s.index) == 1:
            raise fail("the steps form a cycle: " + " -> ".join(path))
        state[s.index] = 1
        for _, tensor in s.inputs:
            p = producer.get(tensor)
            if p is not None:
                visit(p, [*path, f"tensor '{tensor}' from {p.label}"])
        state[s.index] = 2

    for s in steps:
        visit(s, [s.label])


class EnsembleScheduler(Scheduler):
    def __init__(self, plan: EnsemblePlan, infer: Infer, stats: ModelStatistics, stream: Stream | None = None) -> None:
        self._plan = plan
        self._infer = infer
        self._stream = stream
        self._stats = stats
        self._inflight = 0
        self._stopping = False
        self._idle = asyncio.Event()
        self._idle.set()

    async def enqueue(self, item: WorkItem) -> ExecuteResult:
        if self._stopping:
            raise unavailable("model is unloading: no new requests are accepted")
        self._inflight += 1
        self._idle.clear()
        start = time.perf_counter_ns()
        try:
            result = await (self._run_decoupled(item.request) if self._plan.decoupled else self._run(item.request))
        finally:
            self._inflight -= 1
            if self._inflight == 0:
                self._idle.set()
        done = time.perf_counter_ns()
        ok = not isinstance(result, PierError)
        if ok:
            self._stats.record_execution(item.batch_size, 0, done - start, 0)
        # As Triton 2.51: an ensemble's failure counts as OTHER (its failing step's model has the backend one)
        self._stats.record_request(ok, done - item.enqueued_ns, start - item.enqueued_ns, 0, done - start, 0,
                                   reason=None if ok else "OTHER")
        return result

    async def _run(self, request: InferenceRequest) -> ExecuteResult:
        tensors: dict[str, Tensor] = {t.name: t for t in request.inputs}
        absent = set(self._plan.absent(request))
        steps, outputs = self._plan.needed(request)
        waiting = list(steps)
        running: dict[asyncio.Task, Step] = {}
        try:
            while waiting or running:
                for step in [s for s in waiting if self._plan.ready(s, tensors, absent)]:
                    waiting.remove(step)
                    running[asyncio.ensure_future(self._infer(self._step_request(step, request, tensors)))] = step
                if not running:
                    return invalid_arg(f"ensemble '{self._plan.name}': "
                                       f"{waiting[0].label} never received its inputs")
                done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    step = running.pop(task)
                    try:
                        response = task.result()
                    except PierError as exc:
                        return self._failed(step, exc)
                    self._take_outputs(step, response, tensors, absent)
        finally:
            for task in running:
                task.cancel()
        return Outputs([tensors[name] for name, _ in outputs if name in tensors], _sequence_parameters(request))

    def _failed(self, step: Step, exc: PierError) -> PierError:
        # Triton's prefix ("in ensemble 'name', <the step's error>"), naming the step as well
        return PierError(exc.code, f"in ensemble '{self._plan.name}', {step.label}: {exc.message}")

    @staticmethod
    def _take_outputs(step: Step, response: InferenceResponse, tensors: dict[str, Tensor], absent: set[str]) -> None:
        """The step's outputs become ensemble tensors. As Triton: an output the model did not
        produce is absent, so the steps that read it run without it (an optional input there,
        else their model refuses the request), and an ensemble output it was is left out."""
        by_name = {t.name: t for t in response.outputs}
        for model_output, tensor in step.outputs:
            out = by_name.get(model_output)
            if out is not None:
                tensors[tensor] = Tensor(tensor, out.datatype, list(out.shape), out.data)
            else:
                absent.add(tensor)

    async def _run_decoupled(self, request: InferenceRequest) -> ExecuteResult:
        """An ensemble with decoupled steps streams, as Triton's does: each response of a decoupled
        step carries on through the steps after it, and every time the ensemble's outputs are all
        produced they go out as one response (through the request's response sink, which the
        data plane set); the final flag follows the last."""
        sink = request.response_sink
        if sink is None or self._stream is None:
            return internal(f"ensemble '{self._plan.name}' has decoupled steps: it answers through a stream")
        steps, outputs = self._plan.needed(request)
        error = await self._branch(request, {t.name: t for t in request.inputs}, set(self._plan.absent(request)),
                                   list(steps), outputs, sink)
        if error is not None:
            return error
        sink(None, True)
        return Outputs([])

    async def _branch(self, request: InferenceRequest, tensors: dict[str, Tensor], absent: set[str],
                      waiting: list[Step], outputs: tuple[tuple[str, str], ...],
                      sink: ResponseSink) -> PierError | None:
        """Run what `tensors` allows: the ordinary steps first (each once), then fork at the next
        decoupled step, one branch per response."""
        assert self._stream is not None
        while ready := [s for s in waiting if not s.decoupled and self._plan.ready(s, tensors, absent)]:
            for step in ready:
                waiting.remove(step)
            results = await asyncio.gather(*(self._infer(self._step_request(s, request, tensors)) for s in ready),
                                           return_exceptions=True)
            for step, result in zip(ready, results):
                if isinstance(result, PierError):
                    return self._failed(step, result)
                if isinstance(result, BaseException):
                    raise result
                self._take_outputs(step, result, tensors, absent)
        fork = next((s for s in waiting if self._plan.ready(s, tensors, absent)), None)
        if fork is None:
            if waiting:
                return invalid_arg(f"ensemble '{self._plan.name}': {waiting[0].label} never received its inputs")
            sink(Outputs([tensors[name] for name, _ in outputs if name in tensors], _sequence_parameters(request)),
                 False)
            return None
        waiting.remove(fork)
        stream = self._stream(self._step_request(fork, request, tensors))
        try:
            async for item in stream:
                if request.cancelled:  # the client went away: closing the step's stream cancels it
                    return unavailable(f"ensemble '{self._plan.name}': the request was cancelled")
                if isinstance(item, PierError):
                    return self._failed(fork, item)
                if not item.outputs:  # the step's flag-only final response
                    continue
                branch, branch_absent = dict(tensors), set(absent)
                self._take_outputs(fork, item, branch, branch_absent)
                error = await self._branch(request, branch, branch_absent, list(waiting), outputs, sink)
                if error is not None:
                    return error
        finally:
            close = getattr(stream, "aclose", None)  # an async generator: closing it cancels the step
            if close is not None:
                await close()
        return None

    @staticmethod
    def _step_request(step: Step, request: InferenceRequest, tensors: dict[str, Tensor]) -> InferenceRequest:
        inputs = []
        for model_input, tensor in step.inputs:
            t = tensors.get(tensor)
            if t is not None:  # else an optional ensemble input the request left out
                inputs.append(Tensor(model_input, t.datatype, list(t.shape), t.data))
        # As Triton: every step gets the request's parameters (its own and the protocol's: priority,
        # timeout, sequence flags), so that a composing model reads what the client sent.
        # A traced ensemble's step is a child trace (OpenTelemetry mode: its spans under the
        # ensemble's model span); in Triton's mode each step is sampled on its own.
        trace = request.trace.child(step.model.rpartition("/")[2], request.id) if request.trace else None
        return InferenceRequest(step.model, step.version, inputs, [RequestedOutput(o) for o, _ in step.outputs],
                                id=request.id, parameters=dict(request.parameters), trace=trace)

    def inflight_count(self) -> int:
        return self._inflight

    def pending_count(self) -> int:
        return 0

    async def stop(self) -> None:
        self._stopping = True
        await self._idle.wait()
