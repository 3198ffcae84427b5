"""Toy models for the unit tests of the server's parts, written against the backend contract
(server/contract/): a config.pbtxt text completed and frozen as the repository does it, an
instance that answers with a Python function, and a routing table that serves them as the life
cycle would publish them. No server process, no model files."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from pier.contract.backend import ModelInstance
from pier.contract.errors import ErrorCode, PierError
from pier.contract.types import ExecuteResult, InferenceRequest, Outputs, Tensor
from pier.lifecycle.loaded_model import LoadedModel, build_loaded_model
from pier.lifecycle.routing import Route, RoutingTable
from pier.protocol import model_config_pb2 as mc
from pier.repository.model_config import complete_config, parse_config_text
from pier.repository.spec import build_spec

Answer = Callable[[InferenceRequest], ExecuteResult]


def completed(text: str) -> mc.ModelConfig:
    """`text` (a config.pbtxt naming its model) completed and validated as a load does. The config
    names a real backend so that it completes like any; the instances are the toy's."""
    raw = parse_config_text(text, "toy config")
    return complete_config(raw, raw.name, [], "toy config", False, lambda *_: None)


class Toy(ModelInstance):
    """Runs `answer` on each request of a batch, in a worker thread (never inline on the event
    loop: `gate`, when set, holds every execute until it opens). Keeps the requests it ran."""

    may_run_on_event_loop = False
    unbatched = True  # each request as it came: the toy answers requests, not merged batches

    def __init__(self, answer: Answer, gate: threading.Event | None = None) -> None:
        self.answer = answer
        self.gate = gate
        self.ran: list[InferenceRequest] = []
        self.closed = False

    def execute(self, requests: Sequence[InferenceRequest]) -> list[ExecuteResult]:
        if self.gate is not None:
            assert self.gate.wait(10), "the test never opened the gate"
        self.ran += requests
        return [self.answer(r) for r in requests]

    def close(self) -> None:
        self.closed = True


def load(text: str, *instances: ModelInstance, version: int = 1) -> LoadedModel:
    """A loaded version of the model `text` configures, served by `instances` behind the scheduler
    its config asks for (direct, dynamic batcher, sequence batcher)."""
    config = completed(text)
    return build_loaded_model(build_spec(config), config, version, list(instances))


def serve(routes: RoutingTable, *models: LoadedModel) -> None:
    """Publish `models` (versions of one or more models) as READY, newest taking the traffic."""
    by_name: dict[str, dict[int, LoadedModel]] = {}
    for m in models:
        by_name.setdefault(m.spec.name, {})[m.version] = m
    for name, ready in by_name.items():
        routes.publish(Route.build(name, frozenset(ready), ready, {}))


def tensor(name: str, values: object, datatype: str = "FP32") -> Tensor:
    data = np.asarray(values, dtype=np.object_ if datatype == "BYTES" else None)
    if datatype == "FP32":
        data = data.astype(np.float32)
    elif datatype == "INT32":
        data = data.astype(np.int32)
    return Tensor(name, datatype, list(data.shape), data)


def outputs(*tensors: Tensor) -> Outputs:
    return Outputs(list(tensors))


def counter(output: str, datatype: str = "FP32", width: int = 1) -> Answer:
    """A decoupled model's execute: N (its first input's first element) responses `output` = [i] *
    `width` for i = 0 ... N-1 through the request's sink, then the final flag alone; N < 0: an
    error in-band; N >= 1000: one a millisecond until the request is cancelled. How many it sent
    goes into the request's parameters["sent"]."""
    def count(request: InferenceRequest) -> ExecuteResult:
        sink = request.response_sink
        assert sink is not None, "a decoupled model's request carries a response sink"
        n = int(request.inputs[0].data.flat[0])
        if n < 0:
            sink(PierError(ErrorCode.INVALID_ARG, "cannot count fewer than zero responses"), True)
            return Outputs([])
        sent = 0
        while sent < n and not request.cancelled:
            sink(outputs(tensor(output, [sent] * width, datatype)), False)
            sent += 1
            if n >= 1000:
                time.sleep(0.001)
        request.parameters["sent"] = sent
        sink(None, True)
        return Outputs([])
    return count
