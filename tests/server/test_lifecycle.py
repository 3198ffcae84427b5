"""The life cycle (server/lifecycle/) without a server: real ONNX models read from a folder as a load
reads them, brought up, switched, drained and retired by ModelLifecycle, requests sent through the
DataPlane. New versions load beside what serves and a failure changes nothing that serves; a
reload serves at once while the old load finishes its requests; a retired version takes no
new traffic, is metered until its last request is done, then is gone; traffic weights fall back
to the newest version when theirs go; instance health makes a version UNAVAILABLE and READY
again, and a report about a load that no longer serves changes nothing."""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path

import numpy as np
import pytest

from pier.contract.backend import Backend, InstanceContext, LoadProgress, ModelContext, ModelInstance
from pier.contract.errors import ErrorCode, PierError
from pier.contract.types import InferenceRequest, Tensor
from pier.dataplane.plane import DataPlane
from pier.lifecycle.lifecycle import ModelLifecycle, ModelVersions
from pier.lifecycle.routing import RoutingTable
from pier.repository import backend_registry, disk
from scripts.build_example_models import write_model
from tests.model_builders import ADD_CONFIG, add_constant_model, slow_model

SLOW_CONFIG = """name: "slow" platform: "onnxruntime_onnx" max_batch_size: 0
input [ { name: "X" data_type: TYPE_FP32 dims: [ 1, 256 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1, 256 ] } ]
"""


class Served:
    """A life cycle, its routes and a data plane over them, as the server composes them."""

    def __init__(self, repo: Path) -> None:
        self.repo = repo
        self.routes = RoutingTable()
        self.lifecycle = ModelLifecycle(self.routes, None)  # type: ignore[arg-type]  # no BLS here
        self.plane = DataPlane(self.routes, strict_readiness=True)
        self.plane.mark_started()

    def record(self, name: str) -> ModelVersions:
        return self.lifecycle.model(name)

    async def apply(self, name: str, force: bool = False) -> str:
        on_disk = disk.read_model(name, self.repo / name, None, "", False, set(), set())
        return await self.lifecycle.apply(self.record(name), on_disk, force)

    def states(self, name: str) -> dict[int, tuple[str, str]]:
        return {v: (vr.state.value, vr.reason) for v, vr in sorted(self.record(name).versions.items())}

    async def add(self, version: str = "", x: float = 0.0) -> float:
        """What `m` (Y = X + its version's constant) answers for X = x."""
        data = np.full((1, 4), x, dtype=np.float32)
        answer = await self.plane.infer(InferenceRequest("m", version, [Tensor("X", "FP32", [1, 4], data)]))
        return float(answer.outputs[0].data[0, 0])

    async def slow(self, version: str = "") -> str:
        data = np.ones((1, 256), dtype=np.float32)
        answer = await self.plane.infer(InferenceRequest("slow", version, [Tensor("X", "FP32", [1, 256], data)]))
        return answer.model_version


def _add_versions(repo: Path, constants: dict[int, float | None], policy: str = "{ all { } }") -> None:
    """Versions of `m` adding their constant (None: a file that is no ONNX model)."""
    for version, c in constants.items():
        model = b"not an onnx model" if c is None else add_constant_model(c)
        write_model(repo, "m", ADD_CONFIG.format(name="m", policy=policy), model, version=version)


def test_versions_load_beside_what_serves_and_a_failed_load_changes_nothing(tmp_path: Path) -> None:
    async def main() -> None:
        s = Served(tmp_path)
        _add_versions(tmp_path, {1: 1.0})
        assert await s.apply("m") == ""
        serving = s.record("m").versions[1].loaded
        assert await s.add() == 1.0
        _add_versions(tmp_path, {2: 2.0, 3: None})
        failed = await s.apply("m")
        assert failed.startswith("version 3: ") and "onnx" in failed.lower()
        states = s.states("m")
        assert states[1] == ("READY", "")
        assert states[2] == ("UNAVAILABLE", "not loaded: another version of the model failed")
        assert states[3][0] == "UNAVAILABLE" and states[3][1] == failed.removeprefix("version 3: ")
        assert s.record("m").versions[1].loaded is serving and await s.add() == 1.0  # untouched
        with pytest.raises(PierError, match="version 2 is not at ready state"):
            await s.add("2")
        assert not s.plane.ready()  # strict readiness: a version failed
        _add_versions(tmp_path, {3: 3.0})
        assert await s.apply("m") == ""
        assert [s.states("m")[v][0] for v in (1, 2, 3)] == ["READY"] * 3 and s.plane.ready()
        assert s.record("m").versions[1].loaded is serving  # unchanged on disk: not loaded again
        assert (await s.add(), await s.add("1"), await s.add("2")) == (3.0, 1.0, 2.0)
        await s.lifecycle.drain()

    asyncio.run(main())


def test_a_reload_serves_at_once_while_the_old_load_finishes_its_requests(tmp_path: Path) -> None:
    async def main() -> None:
        s = Served(tmp_path)
        write_model(tmp_path, "slow", SLOW_CONFIG, slow_model(40))
        assert await s.apply("slow") == ""
        old = s.record("slow").versions[1].loaded
        assert old is not None
        in_flight = asyncio.ensure_future(s.slow())  # about 0.2 s on the model
        await asyncio.sleep(0.02)
        write_model(tmp_path, "slow", SLOW_CONFIG, slow_model(41))  # the file changes: a reload
        assert await s.apply("slow") == ""
        new = s.record("slow").versions[1].loaded
        assert new is not None and new is not old and new.load_id > old.load_id
        assert s.routes.resolve("slow") is new  # new requests go to the new load at once
        assert s.states("slow") == {1: ("READY", "")}
        await s.lifecycle.drain()  # the old load stops once its request is answered
        assert in_flight.done() and await in_flight == "1"
        assert await s.slow() == "1"
        await s.lifecycle.drain()

    asyncio.run(main())


def test_a_retired_version_takes_no_new_requests_and_unloads_after_its_last(tmp_path: Path) -> None:
    async def main() -> None:
        s = Served(tmp_path)
        for v in (1, 2):
            write_model(tmp_path, "slow", SLOW_CONFIG.replace('max_batch_size: 0', 'max_batch_size: 0 '
                                                              'version_policy: { all { } }'), slow_model(40), v)
        assert await s.apply("slow") == ""
        in_flight = asyncio.ensure_future(s.slow("1"))
        await asyncio.sleep(0.02)
        s.lifecycle.retire(s.record("slow"), [1])  # an unload of version 1
        assert not in_flight.done()  # the model takes about 0.2 s
        assert {m.version for m in s.lifecycle.metered_models()} == {1, 2}  # its series stay while it drains
        assert s.states("slow") == {1: ("UNLOADING", ""), 2: ("READY", "")}
        with pytest.raises(PierError, match="version 1 is not at ready state") as refused:
            await s.slow("1")
        assert refused.value.code is ErrorCode.UNAVAILABLE
        await s.lifecycle.drain()  # it unloads once its request is answered
        assert in_flight.done() and await in_flight == "1"
        assert await s.slow() == "2"
        assert s.states("slow") == {1: ("UNAVAILABLE", "unloaded"), 2: ("READY", "")}
        assert {m.version for m in s.lifecycle.metered_models()} == {2}
        s.lifecycle.publish(s.record("slow"))  # as any later change of the model does
        assert s.plane.ready()  # unloaded on purpose: strict readiness holds
        assert s.lifecycle.status_table() == [("slow", "1", "UNAVAILABLE: unloaded"), ("slow", "2", "READY")]

    asyncio.run(main())


def test_traffic_weights_roll_back_and_fall_back_to_the_newest_version(tmp_path: Path) -> None:
    async def main() -> None:
        s = Served(tmp_path)
        _add_versions(tmp_path, {1: 1.0, 2: 2.0, 3: 3.0})
        assert await s.apply("m") == ""
        lc = s.lifecycle
        assert lc.traffic("m") == {3: 100.0}
        assert lc.set_weights("m", {1: 90, 2: 10}) == {1: 90.0, 2: 10.0}
        assert lc.describe_traffic("m") == "v1 90%, v2 10%"
        assert {await s.add() for _ in range(40)} <= {1.0, 2.0}
        for weights, words in (({1: -1.0}, "finite number >= 0"), ({1: float("nan")}, "finite number >= 0"),
                               ({4: 1.0}, "version 4 of model 'm' is not READY"),
                               ({1: 0.0, 2: 0.0}, "not all be zero")):
            with pytest.raises(PierError, match=words):
                lc.set_weights("m", weights)
        assert lc.traffic("m") == {1: 90.0, 2: 10.0}  # a refused change changes nothing
        with pytest.raises(PierError, match="no READY version"):
            lc.set_weights("other", {1: 1.0})
        assert lc.rollback("m") == {1: 100.0}  # the newest READY version older than 2, the newest taking traffic
        with pytest.raises(PierError, match="no READY version older than 1"):
            lc.rollback("m")
        assert lc.rollback("m", 2) == {2: 100.0}
        v2 = s.record("m").versions[2].loaded
        lc.health_changed("m", 2, v2, {"m_0": "down"})  # the only weighted version cannot serve...
        assert lc.traffic("m") == {3: 100.0} and await s.add() == 3.0  # ...the newest READY one takes it all
        lc.health_changed("m", 2, v2, {})
        assert s.states("m")[2] == ("READY", "") and lc.traffic("m") == {3: 100.0}  # its weight does not come back
        assert lc.set_weights("m", {}) == {3: 100.0}
        await lc.drain()

    asyncio.run(main())


def test_instance_health_makes_a_version_unavailable_and_ready_again(tmp_path: Path) -> None:
    async def main() -> None:
        s = Served(tmp_path)
        config = ADD_CONFIG.format(name="m", policy="{ latest { num_versions: 1 } }")
        write_model(tmp_path, "m", config + "instance_group [ { count: 2 kind: KIND_CPU } ]\n", add_constant_model(1))
        assert await s.apply("m") == ""
        model = s.record("m").versions[1].loaded
        assert model is not None and len(model.instances) == 2
        lc = s.lifecycle
        lc.health_changed("m", 1, model, {"m_0": "its process died"})
        assert s.states("m") == {1: ("READY", "")} and await s.add() == 1.0  # the other instance serves
        lc.health_changed("m", 1, model, {"m_0": "its process died", "m_1": "killed by signal 9"})
        assert s.states("m") == {1: ("UNAVAILABLE", "its process died; killed by signal 9")}
        with pytest.raises(PierError, match=r"'m' has no available versions \(version 1 is UNAVAILABLE: its process "
                                            r"died; killed by signal 9\)"):  # Triton's words, then why
            await s.add()
        assert s.plane.not_serving("m") == ("Request for unknown model: 'm' has no available versions (version 1 is "
                                            "UNAVAILABLE: its process died; killed by signal 9)")
        assert s.plane.not_serving("nope") is None  # unknown: the frontend says so itself
        assert not s.plane.ready()
        lc.health_changed("m", 1, model, {"m_1": "killed by signal 9"})  # one is back
        assert s.states("m") == {1: ("READY", "")} and await s.add() == 1.0 and s.plane.ready()
        assert s.plane.not_serving("m") is None
        assert await s.apply("m", force=True) == ""  # a reload replaces the load...
        lc.health_changed("m", 1, model, {"m_0": "late", "m_1": "late"})  # ...so what the old one says is moot
        assert s.states("m") == {1: ("READY", "")} and await s.add() == 1.0
        await lc.drain()

    asyncio.run(main())


def test_a_load_says_how_far_it_has_come(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         caplog: pytest.LogCaptureFixture) -> None:
    """A backend's progress reports (ModelContext.report_progress, from its loading thread) are the
    LOADING version's reason, step by step, and one log line each when stderr is no terminal; once
    READY the reason is empty again and a late report changes nothing."""
    real = backend_registry.get_backend
    go = [threading.Event() for _ in range(3)]
    said = [threading.Event() for _ in range(3)]

    class Reporting(Backend):  # the ONNX backend, with a load that reports three steps
        name, default_model_filename = "onnxruntime", "model.onnx"

        def create_instance(self, model: ModelContext, instance: InstanceContext) -> ModelInstance:
            for i in range(3):
                model.report_progress(instance.name, LoadProgress("loading weights", i, 2, 10 * i, 20))
                said[i].set()
                go[i].wait(30)
            return real(backend_registry.lookup("onnxruntime_onnx", "")).create_instance(model, instance)

    monkeypatch.setattr(backend_registry, "get_backend", lambda entry: Reporting())

    async def main() -> None:
        s = Served(tmp_path)
        write_model(tmp_path, "m", ADD_CONFIG.format(name="m", policy="{ latest { num_versions: 1 } }"),
                    add_constant_model(1))
        loop = asyncio.get_running_loop()
        caplog.set_level(logging.INFO, logger="pier.repository")
        load = asyncio.ensure_future(s.apply("m"))
        for i in range(3):
            await loop.run_in_executor(None, said[i].wait, 30)
            expected = ("LOADING", f"loading weights: {i}/2 shards, {10 * i}/20 B")
            for _ in range(200):  # applied on the loop as soon as it runs the callback
                if s.states("m")[1] == expected:
                    break
                await asyncio.sleep(0.01)
            assert s.states("m")[1] == expected
            go[i].set()
        assert await load == "" and s.states("m") == {1: ("READY", "")}
        s.lifecycle.load_progress("m", 1, LoadProgress("loading weights", 1, 2))  # late: moot once READY
        assert s.states("m") == {1: ("READY", "")}
        lines = [r.getMessage() for r in caplog.records if "loading weights" in r.getMessage()]
        assert lines == [f"'m' version 1: loading weights: {i}/2 shards, {10 * i}/20 B" for i in range(3)]
        await s.lifecycle.drain()

    asyncio.run(main())
