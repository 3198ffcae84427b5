"""The data plane (server/dataplane/plane.py) over toy models, without a server: readiness through
start, strictness and exit; a request refused by validation never reaches the model and counts
nowhere, a model's own error does; requested outputs in the order asked, classified when asked;
decoupled models' responses in order with the final flag, in-band errors, and an early close
that cancels the request; the drain waits for every request in flight while new ones are still
served; the OpenAI API's model lists read the newest version."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from pier.contract.errors import ErrorCode, PierError
from pier.contract.types import ExecuteResult, InferenceRequest, RequestedOutput
from pier.dataplane.plane import DataPlane
from pier.lifecycle.routing import Route, RoutingTable
from tests.server.toy import Toy, counter, load, outputs, serve, tensor

ECHO = """name: "echo" backend: "onnxruntime" max_batch_size: 0
input [ { name: "X" data_type: TYPE_FP32 dims: [ 3 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 3 ] }, { name: "NEG" data_type: TYPE_FP32 dims: [ 3 ] },
         { name: "TWICE" data_type: TYPE_FP32 dims: [ 3 ] } ]
"""
COUNTER = """name: "counter" backend: "onnxruntime" max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "N" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "I" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""


def echo(request: InferenceRequest) -> ExecuteResult:
    x = request.inputs[0].data
    if x[0] < 0:
        return PierError(ErrorCode.INTERNAL, "the model refuses negative numbers")
    return outputs(tensor("Y", x), tensor("NEG", -x), tensor("TWICE", 2 * x))


def _request(model: str, values: list, datatype: str = "FP32", name: str = "X") -> InferenceRequest:
    return InferenceRequest(model, "", [tensor(name, values, datatype)])


def test_readiness_follows_the_start_the_strictness_and_the_exit() -> None:
    async def main() -> None:
        routes = RoutingTable()
        strict, lenient = DataPlane(routes, strict_readiness=True), DataPlane(routes, strict_readiness=False)
        serve(routes, load(ECHO, Toy(echo)))
        assert not strict.ready() and not lenient.ready()  # the startup models are still loading
        strict.mark_started()
        lenient.mark_started()
        assert strict.ready() and lenient.ready()
        routes.publish(Route("broken", failed=True, healthy=False))  # a model that failed to load
        assert not strict.ready() and lenient.ready()
        strict.begin_exit()
        with pytest.raises(PierError, match="Server exiting") as refused:
            strict.ready()
        assert refused.value.code is ErrorCode.UNAVAILABLE
        assert strict.live()  # a liveness probe must not get a draining pod killed

    asyncio.run(main())


def test_a_refused_request_never_reaches_the_model_and_a_failed_one_counts() -> None:
    async def main() -> None:
        routes, toy = RoutingTable(), Toy(echo)
        model = load(ECHO, toy)
        serve(routes, model)
        plane = DataPlane(routes, strict_readiness=False)
        with pytest.raises(PierError, match="'X'") as refused:
            await plane.infer(_request("echo", [1, 2]))  # dims [3]
        assert refused.value.code is ErrorCode.INVALID_ARG
        assert toy.ran == [] and model.stats.fail.count == 0 and sum(model.stats.failures.values()) == 0
        with pytest.raises(PierError, match="refuses negative numbers"):
            await plane.infer(_request("echo", [-1, 2, 3]))
        assert len(toy.ran) == 1 and model.stats.fail.count == 1 and model.stats.failures["BACKEND"] == 1
        answer = await plane.infer(_request("echo", [1, 2, 3]))
        assert (answer.model_name, answer.model_version) == ("echo", "1")
        assert model.stats.success.count == 1 and model.stats.inference_count == 1

    asyncio.run(main())


def test_requested_outputs_come_in_the_order_asked_and_classified_when_asked() -> None:
    async def main() -> None:
        routes = RoutingTable()
        serve(routes, load(ECHO, Toy(echo)))
        plane = DataPlane(routes, strict_readiness=False)
        request = _request("echo", [1, 3, 2])
        request.outputs = [RequestedOutput("TWICE"), RequestedOutput("NEG"),
                           RequestedOutput("Y", {"classification": 2})]
        answer = await plane.infer(request)
        assert [t.name for t in answer.outputs] == ["TWICE", "NEG", "Y"]  # neither the config's order nor sorted
        np.testing.assert_array_equal(answer.outputs[1].data, [-1, -3, -2])
        assert answer.outputs[2].datatype == "BYTES"
        assert answer.outputs[2].data.tolist() == [b"3.000000:1", b"2.000000:2"]  # the top two, value:index
        request = _request("echo", [1, 2, 3])
        request.outputs = [RequestedOutput("Y")]
        assert [t.name for t in (await plane.infer(request)).outputs] == ["Y"]

    asyncio.run(main())


def test_a_decoupled_model_streams_in_order_with_the_final_flag_and_errors_in_band() -> None:
    async def main() -> None:
        routes = RoutingTable()
        model = load(COUNTER, Toy(counter("I", "INT32")))
        serve(routes, model)
        plane = DataPlane(routes, strict_readiness=False)
        with pytest.raises(PierError, match="'counter' streams") as refused:
            await plane.infer(_request("counter", [3], "INT32", "N"))
        assert refused.value.code is ErrorCode.UNSUPPORTED
        stream = [r async for r in plane.infer_stream(_request("counter", [3], "INT32", "N"))]
        assert [r.outputs[0].data.tolist() for r in stream[:3]] == [[0], [1], [2]]
        assert [r.parameters["triton_final_response"] for r in stream] == [False, False, False, True]
        assert stream[3].outputs == []  # the model sent the final flag alone
        assert [r.outputs[0].data.tolist() async for r in plane.responses(_request("counter", [2], "INT32", "N"))] \
            == [[0], [1]]
        errors = [r async for r in plane.infer_stream(_request("counter", [-1], "INT32", "N"))]
        assert len(errors) == 1 and isinstance(errors[0], PierError) and "fewer than zero" in errors[0].message
        with pytest.raises(PierError, match="fewer than zero"):
            [r async for r in plane.responses(_request("counter", [-1], "INT32", "N"))]
        assert model.stats.first_responses == 2  # requests that got a response with outputs

    asyncio.run(main())


def test_closing_a_stream_early_cancels_its_request() -> None:
    async def main() -> None:
        routes, toy = RoutingTable(), Toy(counter("I", "INT32"))
        serve(routes, load(COUNTER, toy))
        plane = DataPlane(routes, strict_readiness=False)
        request = _request("counter", [1000], "INT32", "N")
        stream = plane.responses(request)
        assert [(await anext(stream)).outputs[0].data.tolist() for _ in range(2)] == [[0], [1]]
        await stream.aclose()  # the client went away
        assert request.cancelled
        await asyncio.wait_for(plane.wait_idle(), 5)
        for _ in range(500):  # the model notices on its worker thread
            if "sent" in toy.ran[0].parameters:
                break
            await asyncio.sleep(0.01)
        assert toy.ran[0].parameters["sent"] < 1000

    asyncio.run(main())


def test_the_drain_waits_for_requests_in_flight_and_still_serves_new_ones() -> None:
    async def main() -> None:
        routes, gate = RoutingTable(), threading.Event()
        serve(routes, load(ECHO, Toy(echo, gate)))
        plane = DataPlane(routes, strict_readiness=False)
        first = asyncio.ensure_future(plane.infer(_request("echo", [1, 2, 3])))
        await asyncio.sleep(0.05)
        plane.begin_exit()  # SIGTERM
        late = asyncio.ensure_future(plane.infer(_request("echo", [4, 5, 6])))  # as Triton: still served
        idle = asyncio.ensure_future(plane.wait_idle())
        await asyncio.sleep(0.1)
        assert not idle.done() and not first.done()
        gate.set()
        await asyncio.wait_for(idle, 5)
        assert (await first).outputs[0].data.tolist() == [1, 2, 3]
        assert (await late).outputs[0].data.tolist() == [4, 5, 6]

    asyncio.run(main())


class _Described(Toy):
    def __init__(self, version: int) -> None:
        super().__init__(echo)
        self.version = version

    def info(self) -> dict[str, int]:
        return {"max_model_len": 100 * self.version}


def test_model_lists_read_the_newest_ready_version() -> None:
    """What the OpenAI API lists: models of a backend with their newest version's facts, and models
    that set a parameter with their newest version's value."""
    async def main() -> None:
        routes = RoutingTable()
        parameter = 'parameters { key: "tool_call_parser" value: { string_value: "%s" } }\n'
        serve(routes, load(ECHO + parameter % "hermes", _Described(1)),
              load(ECHO + parameter % "llama3_json", _Described(2), version=2))
        plane = DataPlane(routes, strict_readiness=False)
        assert plane.models_with_backend("onnxruntime") == {"echo": {"max_model_len": 200}}
        assert plane.models_with_backend("llm") == {}
        assert plane.models_with_parameter("tool_call_parser") == {"echo": "llama3_json"}
        assert plane.models_with_parameter("other") == {}

    asyncio.run(main())
