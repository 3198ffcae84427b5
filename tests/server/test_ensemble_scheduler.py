"""Ensembles (server/scheduling/ensemble.py) over toy composing models served by a DataPlane, without
a server: the graph's refusals at load (those tests/e2e/test_ensemble.py does not check through
the server), a data flow whose independent steps run at once, only the steps the requested
outputs need, a failing step named while its siblings are not waited for, an unload that waits
for the requests in flight and refuses new ones, and a decoupled step whose every response flows
on through the steps after it, in-band errors and cancellation included."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import pytest

from pier.contract.errors import ErrorCode, PierError
from pier.contract.types import ExecuteResult, InferenceRequest, Outputs, RequestedOutput
from pier.dataplane.plane import DataPlane
from pier.lifecycle.loaded_model import LoadedModel
from pier.lifecycle.routing import RoutingTable
from pier.observability.statistics import ModelStatistics
from pier.repository.spec import build_spec
from pier.scheduling.ensemble import EnsembleScheduler, build_plan
from tests.server.toy import Toy, completed, counter, load, outputs, serve, tensor


def _one_in_one_out(name: str, inputs: str = 'name: "X"', output: str = "Y", datatype: str = "FP32") -> str:
    return (f'name: "{name}" backend: "onnxruntime" max_batch_size: 0\n'
            f'input [ {{ {inputs} data_type: TYPE_{datatype} dims: [ 2 ] }} ]\n'
            f'output [ {{ name: "{output}" data_type: TYPE_{datatype} dims: [ 2 ] }} ]\n')


ADD = ('name: "add" backend: "onnxruntime" max_batch_size: 0\n'
       'input [ { name: "A" data_type: TYPE_FP32 dims: [ 2 ] }, { name: "B" data_type: TYPE_FP32 dims: [ 2 ] } ]\n'
       'output [ { name: "SUM" data_type: TYPE_FP32 dims: [ 2 ] } ]\n')
REPEAT = ('name: "repeat" backend: "onnxruntime" max_batch_size: 0 model_transaction_policy { decoupled: true }\n'
          'input [ { name: "N" data_type: TYPE_FP32 dims: [ 2 ] } ]\n'
          'output [ { name: "I" data_type: TYPE_FP32 dims: [ 2 ] } ]\n')


def _step(model: str, inputs: dict[str, str], outputs: dict[str, str]) -> str:
    maps = "".join(f' input_map {{ key: "{k}" value: "{v}" }}' for k, v in inputs.items())
    maps += "".join(f' output_map {{ key: "{k}" value: "{v}" }}' for k, v in outputs.items())
    return f'{{ model_name: "{model}" model_version: -1{maps} }}'


def _ensemble(name: str, steps: list[str], outs: tuple[str, ...] = ("OUT",), ins: tuple[str, ...] = ("IN",)) -> str:
    tensors = {"input": ins, "output": outs}
    io = "".join(f'{kind} [ ' + ", ".join(f'{{ name: "{t}" data_type: TYPE_FP32 dims: [ 2 ] }}' for t in names)
                 + " ]\n" for kind, names in tensors.items())
    return (f'name: "{name}" platform: "ensemble" max_batch_size: 0\n{io}'
            f'ensemble_scheduling {{ step [ {", ".join(steps)} ] }}\n')


# OUT = double(IN) + negate(IN) = IN; SIDE = double(negate(IN)) = -2 IN
PIPE = _ensemble("pipe", [_step("double", {"X": "IN"}, {"Y": "a"}), _step("negate", {"X": "IN"}, {"Y": "b"}),
                          _step("add", {"A": "a", "B": "b"}, {"SUM": "OUT"}),
                          _step("double", {"X": "b"}, {"Y": "SIDE"})], outs=("OUT", "SIDE"))


class Composed:
    """Toy composing models served by a DataPlane, and ensembles over them whose steps re-enter the
    plane (as the server's ServerServices do)."""

    def __init__(self) -> None:
        self.routes = RoutingTable()
        self.plane = DataPlane(self.routes, strict_readiness=False)
        self.times: dict[str, list[tuple[float, float]]] = {}
        self.gate = threading.Event()
        self.gate.set()
        self.toys = {
            "double": Toy(self._timed("double", lambda x: 2 * x)),
            "negate": Toy(self._timed("negate", lambda x: -x)),
            "held": Toy(self._timed("held", lambda x: x, held=True)),
            "fail": Toy(self._fail),
            "add": Toy(lambda r: outputs(tensor("SUM", r.inputs[0].data + r.inputs[1].data))),
            "repeat": Toy(counter("I", width=2)),
        }
        texts = {"double": _one_in_one_out("double"), "negate": _one_in_one_out("negate"),
                 "held": _one_in_one_out("held"), "fail": _one_in_one_out("fail"), "add": ADD, "repeat": REPEAT}
        serve(self.routes, *(load(texts[n], toy) for n, toy in self.toys.items()))

    def _timed(self, name: str, f, held: bool = False):
        def answer(request: InferenceRequest) -> Outputs:
            start = time.monotonic()
            if held:
                assert self.gate.wait(10)
            else:
                time.sleep(0.1)
            self.times.setdefault(name, []).append((start, time.monotonic()))
            return outputs(tensor("Y", f(request.inputs[0].data)))
        return answer

    @staticmethod
    def _fail(request: InferenceRequest) -> ExecuteResult:
        return PierError(ErrorCode.INTERNAL, "negative input")

    def ensemble(self, text: str) -> LoadedModel:
        """Loaded as the life cycle loads one: the plan checked against the served models' specs."""
        config = completed(text)
        spec = build_spec(config)
        plan = build_plan(config, spec, lambda name, version: self.routes.resolve(name, version).spec)
        if plan.decoupled:  # as Triton marks an ensemble with a decoupled step
            spec = dataclasses.replace(spec, decoupled=True)
        stats = ModelStatistics()
        model = LoadedModel(spec, config, 1, EnsembleScheduler(plan, self.plane.infer, stats, self.plane.infer_stream),
                            stats)
        serve(self.routes, model)
        return model

    @staticmethod
    def request(name: str, values: list[float], *wanted: str) -> InferenceRequest:
        return InferenceRequest(name, "", [tensor("IN", values)], [RequestedOutput(w) for w in wanted])


BASE = _ensemble("e", [_step("double", {"X": "IN"}, {"Y": "OUT"})])


@pytest.mark.parametrize("text, words", [
    (_ensemble("e", []), "ensemble_scheduling has no step"),
    (BASE.replace('model_name: "double"', 'model_name: "missing"'), "step 1 (model 'missing'): the model is not "
                                                                   "available: Request for unknown model"),
    (BASE.replace("max_batch_size: 0", "max_batch_size: 4"), "step 1 (model 'double'): the ensemble batches "
                                                            "(max_batch_size 4) but the model does not"),
    (BASE.replace('key: "X"', 'key: "Z"'), "step 1 (model 'double'): the model has no input 'Z'"),
    (_ensemble("e", [_step("add", {"A": "IN"}, {"SUM": "OUT"})]),
     "step 1 (model 'add'): model input 'B' is not mapped to any ensemble tensor"),
    (BASE.replace('key: "Y"', 'key: "W"'), "step 1 (model 'double'): the model has no output 'W'"),
    (BASE.replace('{ name: "IN" data_type: TYPE_FP32', '{ name: "IN" data_type: TYPE_INT32'),
     "step 1 (model 'double'): input 'X' expects FP32 but tensor 'IN' from the ensemble input is INT32"),
    (_ensemble("e", [_step("double", {"X": "IN"}, {"Y": "OUT"})], outs=("OUT", "MORE")),
     "ensemble output 'MORE' is not produced by any step"),
    (BASE.replace('output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 2 ]', 'output [ { name: "OUT" data_type: '
                  'TYPE_FP32 dims: [ 3 ]'), "ensemble output 'OUT' has dims [3] but step 1 (model 'double') produces "
                                            "[2]"),
], ids=["no step", "unknown model", "batching", "no such input", "unmapped input", "no such output",
        "input datatype", "output not produced", "output dims"])
def test_a_graph_that_cannot_run_is_refused_at_load_naming_the_step_and_tensor(text: str, words: str) -> None:
    async def main() -> None:
        with pytest.raises(PierError) as refused:
            Composed().ensemble(text)
        assert refused.value.code is not ErrorCode.INTERNAL and f"ensemble 'e': {words}" in refused.value.message

    asyncio.run(main())


def test_independent_steps_run_at_once_and_only_needed_steps_run() -> None:
    async def main() -> None:
        c = Composed()
        pipe = c.ensemble(PIPE)
        answer = await c.plane.infer(c.request("pipe", [1.5, -4]))
        assert {t.name: t.data.tolist() for t in answer.outputs} == {"OUT": [1.5, -4.0], "SIDE": [-3.0, 8.0]}
        (d0, d1), (n0, n1) = c.times["double"][0], c.times["negate"][0]
        assert d0 < n1 and n0 < d1  # the two steps that read only IN ran at the same time
        assert c.times["double"][1][0] >= n1  # the step reading b waited for it
        assert pipe.stats.execution_count == 1 and pipe.stats.success.count == 1
        ran = {n: len(t.ran) for n, t in c.toys.items()}
        side = await c.plane.infer(c.request("pipe", [1, 2], "SIDE"))
        assert [t.name for t in side.outputs] == ["SIDE"] and side.outputs[0].data.tolist() == [-2.0, -4.0]
        assert {n: len(t.ran) - ran[n] for n, t in c.toys.items() if len(t.ran) > ran[n]} == {"negate": 1, "double": 1}

    asyncio.run(main())


def test_a_failing_step_is_named_and_its_sibling_not_waited_for() -> None:
    async def main() -> None:
        c = Composed()
        c.gate.clear()
        guarded = c.ensemble(_ensemble("guarded", [_step("held", {"X": "IN"}, {"Y": "a"}),
                                                   _step("fail", {"X": "IN"}, {"Y": "b"}),
                                                   _step("add", {"A": "a", "B": "b"}, {"SUM": "OUT"})]))
        with pytest.raises(PierError) as failed:
            await asyncio.wait_for(c.plane.infer(c.request("guarded", [1, 2])), 5)  # "held" waits for the gate
        assert failed.value.message == "in ensemble 'guarded', step 2 (model 'fail'): negative input"
        assert failed.value.code is ErrorCode.INTERNAL
        assert guarded.stats.failures["OTHER"] == 1 and c.routes.resolve("fail").stats.failures["BACKEND"] == 1
        assert len(c.toys["add"].ran) == 0
        c.gate.set()

    asyncio.run(main())


def test_an_unloading_ensemble_finishes_what_is_in_flight_and_takes_nothing_new() -> None:
    async def main() -> None:
        c = Composed()
        c.gate.clear()
        model = c.ensemble(_ensemble("e", [_step("held", {"X": "IN"}, {"Y": "OUT"})]))
        in_flight = asyncio.ensure_future(c.plane.infer(c.request("e", [1, 2])))
        await asyncio.sleep(0.05)
        stopped = asyncio.ensure_future(model.stop())
        await asyncio.sleep(0.05)
        assert not stopped.done() and model.scheduler.inflight_count() == 1
        with pytest.raises(PierError, match="model is unloading") as refused:
            await c.plane.infer(c.request("e", [3, 4]))
        assert refused.value.code is ErrorCode.UNAVAILABLE
        c.gate.set()
        await asyncio.wait_for(stopped, 5)
        assert (await in_flight).outputs[0].data.tolist() == [1.0, 2.0]

    asyncio.run(main())


STREAMED = _ensemble("streamed", [_step("repeat", {"N": "IN"}, {"I": "i"}), _step("double", {"X": "i"}, {"Y": "OUT"})])


def test_each_response_of_a_decoupled_step_flows_on_through_the_steps_after_it() -> None:
    async def main() -> None:
        c = Composed()
        model = c.ensemble(STREAMED)
        assert model.spec.decoupled
        stream = [r async for r in c.plane.infer_stream(c.request("streamed", [3, 0]))]
        assert [r.outputs[0].data.tolist() for r in stream[:3]] == [[0, 0], [2, 2], [4, 4]]  # in order
        assert [r.parameters["triton_final_response"] for r in stream] == [False, False, False, True]
        assert stream[3].outputs == []
        failed = [r async for r in c.plane.infer_stream(c.request("streamed", [-1, 0]))]
        assert len(failed) == 1 and isinstance(failed[0], PierError)
        assert failed[0].message == ("in ensemble 'streamed', step 1 (model 'repeat'): cannot count fewer than zero "
                                     "responses")

    asyncio.run(main())


def test_a_client_leaving_a_streamed_ensemble_stops_its_decoupled_step() -> None:
    async def main() -> None:
        c = Composed()
        c.ensemble(STREAMED)
        responses = c.plane.responses(c.request("streamed", [1000, 0]))
        assert (await anext(responses)).outputs[0].data.tolist() == [0, 0]
        await responses.aclose()
        repeat = c.toys["repeat"]
        for _ in range(500):  # the model notices on its worker thread
            if repeat.ran and "sent" in repeat.ran[0].parameters:
                break
            await asyncio.sleep(0.01)
        assert repeat.ran[0].parameters["sent"] < 1000
        await asyncio.wait_for(c.plane.wait_idle(), 5)

    asyncio.run(main())
