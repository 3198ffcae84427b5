"""The python backend's process mode without a server: the channel between server and stub
(whole messages, tensors inline or through a memfd, nothing left in /dev/shm), a ProcessInstance
running a model in its child (identity, decoupled, death and restart with health reports, the
restart limit, initialize() errors, close), and the backend's settings."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import uvloop

from pier.backends.python.backend import BACKEND, PythonSettings
from pier.backends.python.process import LOOP_COPY_BYTES, ProcessInstance, default_launch
from pier.contract.backend import InstanceContext, ModelContext
from pier.contract.errors import ErrorCode, PierError
from pier.contract.types import InferenceRequest, InstanceGroupSpec, ModelSpec, Outputs, Tensor, TensorSpec
from pier.ipc import channel as wire

MODEL = '''
import os, threading, time
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        if os.environ.get("PIER_TEST_INIT_FAIL") == "1":
            raise RuntimeError("no weights")
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy({"model_transaction_policy": {
            "decoupled": args["model_name"].endswith("_stream")}})

    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "X").as_numpy()
            mode = r.parameters()
            if '"exit"' in mode:
                os._exit(3)
            if '"grow"' in mode:
                x = np.arange(600_000, dtype=np.float32)
            if '"bls"' in mode:
                resp = pb_utils.InferenceRequest(model_name="other", inputs=[], requested_output_names=[]).exec()
                text = resp.error().message() if resp.has_error() else "no error"
                out.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", np.array([text.encode()], object))]))
                continue
            if self.decoupled and '"send_raise"' in mode:
                r.get_response_sender().send(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x)]))
                raise pb_utils.TritonModelException("failed after sending")
            if self.decoupled:
                sender = r.get_response_sender()
                def send(sender=sender, x=x):
                    for _ in range(3):
                        sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x)]))
                    sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                threading.Thread(target=send).start()
                continue
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x),
                                                   pb_utils.Tensor("PID", np.array([os.getpid()], np.int64))]))
        return None if self.decoupled else out
'''


def _context(tmp_path: Path, name: str = "m", decoupled: bool = False, health=None,
             parameters: dict[str, str] | None = None) -> ModelContext:
    version_dir = tmp_path / name / "1"
    version_dir.mkdir(parents=True, exist_ok=True)
    (version_dir / "model.py").write_text(MODEL)
    spec = ModelSpec(name=name, platform="", backend="python", max_batch_size=0,
                     inputs=(TensorSpec("X", "FP32", (-1,)),),
                     outputs=(TensorSpec("Y", "FP32", (-1,)), TensorSpec("PID", "INT64", (1,))),
                     instance_groups=(InstanceGroupSpec("g", "KIND_CPU", 1),), default_model_filename="model.py",
                     parameters=parameters or {}, decoupled=decoupled)
    kwargs = {} if health is None else {"report_health": health}
    return ModelContext(spec=spec, version=1, model_dir=version_dir.parent, version_dir=version_dir, **kwargs)


def _request(x: np.ndarray, **params) -> InferenceRequest:
    return InferenceRequest("m", "", [Tensor("X", "FP32", list(x.shape), x)], parameters=params)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def _memfds() -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:pier-python-tensors")
        except OSError:
            pass
    return count + Path("/proc/self/maps").read_text().count("/memfd:pier-python-tensors")


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def test_messages_carry_tensors_inline_or_through_a_memfd_and_leave_nothing() -> None:
    a, b = wire.channel_pair()
    shm = _shm()
    receiver = wire.Receiver(b)
    small = np.arange(16, dtype=np.float16)
    big = np.random.default_rng(0).random((512, 512)).astype(np.float32)  # 1 MiB: memfd
    strings = np.array([b"a", b"", "x" * 5], dtype=object)
    for message_tensors in ([small, strings], [small, big, big[::2]], [np.array([b"y" * 1000] * 300, dtype=object)]):
        packer = wire.Packer()
        tensors = [Tensor(f"t{i}", "BYTES" if t.dtype == object else "FP32", list(t.shape), t)
                   for i, t in enumerate(message_tensors)]
        wire.send(a, ["x", [wire.tensor_out(t, packer) for t in tensors]], packer)
        msg, mapping = receiver.recv()
        got = [wire.tensor_in(w, mapping) for w in msg[1]]
        for sent, back in zip(message_tensors, got):
            assert back.data.shape == sent.shape and back.data.dtype == sent.dtype
            assert (back.data == sent).all()
        del got, mapping, msg
    assert _shm() == shm and _memfds() == 0  # the memfds closed once mapped, the mappings gone with the arrays
    a.close()
    assert receiver.recv() is None  # the peer went away: end-of-file
    b.close()


def test_the_exec_channel_reuses_one_shared_region_and_grows_it() -> None:
    a, b = wire.channel_pair()
    receiver, arena = wire.Receiver(b), wire.Arena()
    rng = np.random.default_rng(2)
    kept = []
    for n in (100_000, 50_000, 600_000, 100_000):  # 400 KB (1 MiB region), smaller, 2.4 MB (grows), smaller
        x = rng.random(n).astype(np.float32)
        packer = wire.Packer()
        wire.send(a, ["exec", wire.tensor_out(Tensor("X", "FP32", [n], x), packer)], packer, arena=arena)
        msg, source = receiver.recv()
        assert isinstance(source, wire.Borrowed)
        got = wire.tensor_in(msg[1], source).data
        assert np.array_equal(got, x) and got.flags.writeable and got.flags.owndata  # a copy: the region is reused
        kept.append((got, x))
    assert arena.size == 3 << 20
    assert all(np.array_equal(got, x) for got, x in kept)  # later messages did not overwrite earlier answers
    a.close()
    b.close()


def test_a_model_runs_in_its_own_process_and_answers(tmp_path: Path) -> None:
    instance = ProcessInstance(_context(tmp_path), InstanceContext("m_0", "KIND_CPU"), default_launch())
    try:
        x = np.random.default_rng(1).random(300_000).astype(np.float32)  # over the inline limit
        (result,) = instance.execute([_request(x)])
        assert isinstance(result, Outputs)
        y, pid = (t.data for t in result.tensors)
        assert np.array_equal(y, x) and int(pid[0]) != os.getpid() and _alive(int(pid[0]))
        (error,) = instance.execute([_request(x, mode="bls")])  # no server here: BLS says so in-band
        assert isinstance(error, Outputs)
        assert b"BLS requests can only be executed inside a running server" in error.tensors[0].data[0]
    finally:
        instance.close()
    assert not _alive(int(pid[0]))


@pytest.mark.parametrize("loop_factory", [asyncio.new_event_loop, uvloop.new_event_loop], ids=["asyncio", "uvloop"])
def test_large_batches_and_answers_are_copied_off_the_event_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 loop_factory: Callable[[], asyncio.AbstractEventLoop]
                                                                 ) -> None:
    """begin_execute copies tensors into and out of the exec channel's shared memory on the loop up
    to LOOP_COPY_BYTES; a larger batch, or a larger answer, is copied on a worker thread. The same
    channel serves both ways in turn (uvloop's reader leaves its socket non-blocking)."""
    copies: list[tuple[str, bool]] = []  # (direction, on the loop's thread)
    loop_thread: threading.Thread | None = None
    place, result_in = wire.Arena.place, wire.result_in

    def spy_place(self: wire.Arena, packer: wire.Packer) -> int | None:
        copies.append(("in", threading.current_thread() is loop_thread))
        return place(self, packer)

    def spy_result_in(w: wire.WireResult | None, mapping: wire.Source) -> Outputs | PierError | None:
        if isinstance(mapping, wire.Borrowed):
            copies.append(("out", threading.current_thread() is loop_thread))
        return result_in(w, mapping)

    monkeypatch.setattr(wire.Arena, "place", spy_place)
    monkeypatch.setattr(wire, "result_in", spy_result_in)
    instance = ProcessInstance(_context(tmp_path), InstanceContext("m_0", "KIND_CPU"), default_launch())

    async def run(x: np.ndarray, **params: str) -> np.ndarray:
        nonlocal loop_thread
        loop_thread = threading.current_thread()
        fut: asyncio.Future[list] = asyncio.get_running_loop().create_future()
        instance.begin_execute([_request(x, **params)], fut.set_result)
        (result,) = await asyncio.wait_for(fut, 30)
        assert isinstance(result, Outputs)
        return result.tensors[0].data

    rng = np.random.default_rng(3)
    small = rng.random(100_000).astype(np.float32)  # 400 KB: the arena, under the bound
    big = rng.random((LOOP_COPY_BYTES >> 2) + 1).astype(np.float32)
    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            for _ in range(2):
                assert np.array_equal(runner.run(run(small)), small)
                assert copies == [("in", True), ("out", True)]
                copies.clear()
                assert np.array_equal(runner.run(run(big)), big)
                assert copies == [("in", False), ("out", False)]
                copies.clear()
                assert np.array_equal(runner.run(run(small[:4], mode="grow")), np.arange(600_000, dtype=np.float32))
                assert copies == [("out", False)]  # a small batch whose answer is large
                copies.clear()
    finally:
        instance.close()


def test_decoupled_responses_come_through_the_sink(tmp_path: Path) -> None:
    instance = ProcessInstance(_context(tmp_path, "m_stream", decoupled=True), InstanceContext("m_0", "KIND_CPU"),
                               default_launch())
    got: list = []
    done = threading.Event()
    try:
        request = _request(np.array([1.5], np.float32))
        request.response_sink = lambda result, final: (got.append((result, final)), final and done.set())
        assert instance.execute([request]) == [Outputs([])]
        assert done.wait(10)
        assert [float(r.tensors[0].data[0]) for r, _ in got[:3]] == [1.5] * 3 and got[3] == (None, True)
    finally:
        instance.close()


def test_a_response_sent_before_execute_fails_is_handed_on_before_the_failure(tmp_path: Path) -> None:
    """The response crosses on aux, the execute's error on exec: the error waits for the response,
    and the failed request is forgotten (the model never sends it a final flag)."""
    instance = ProcessInstance(_context(tmp_path, "m_stream", decoupled=True), InstanceContext("m_0", "KIND_CPU"),
                               default_launch())
    try:
        for _ in range(20):
            got: list = []
            request = _request(np.array([2.5], np.float32), mode="send_raise")
            request.response_sink = lambda result, final, got=got: got.append((result, final))
            (failed,) = instance.execute([request])
            assert isinstance(failed, PierError) and "failed after sending" in failed.message
            assert len(got) == 1 and float(got[0][0].tensors[0].data[0]) == 2.5 and not got[0][1]
        assert instance._entries == {}
    finally:
        instance.close()


def test_a_dead_stub_fails_its_request_reports_and_restarts(tmp_path: Path) -> None:
    reports: list = []
    instance = ProcessInstance(_context(tmp_path, health=lambda i, r: reports.append((i, r))),
                               InstanceContext("m_0", "KIND_CPU"), default_launch())
    try:
        x = np.ones(4, np.float32)
        pid = int(instance.execute([_request(x)])[0].tensors[1].data[0])
        (failed,) = instance.execute([_request(x, mode="exit")])
        assert isinstance(failed, PierError) and failed.code is ErrorCode.INTERNAL
        assert failed.message == "Stub process for model 'm' instance 'm_0' died: exited with code 3"
        deadline = time.monotonic() + 30
        while (not reports or reports[-1][1] is not None) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert reports == [("m_0", failed.message), ("m_0", None)]
        again = instance.execute([_request(x)])[0]
        assert isinstance(again, Outputs) and int(again.tensors[1].data[0]) != pid and not _alive(pid)
    finally:
        instance.close()


def test_past_the_restart_limit_the_instance_stays_down(tmp_path: Path) -> None:
    reports: list = []
    instance = ProcessInstance(_context(tmp_path, health=lambda i, r: reports.append((i, r))),
                               InstanceContext("m_0", "KIND_CPU"), default_launch(), restart_limit=0)
    try:
        instance.execute([_request(np.ones(1, np.float32), mode="exit")])
        deadline = time.monotonic() + 10
        while not reports and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(reports) == 1 and "not restarted: 0 restarts in the last 600 s" in reports[0][1]
        (down,) = instance.execute([_request(np.ones(1, np.float32))])
        assert isinstance(down, PierError) and down.code is ErrorCode.UNAVAILABLE
        assert down.message.startswith("Stub process 'm_0' is not healthy: Stub process for model 'm' instance "
                                       "'m_0' died: exited with code 3")
    finally:
        instance.close()


def test_initialize_errors_fail_the_load_as_in_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIER_TEST_INIT_FAIL", "1")
    with pytest.raises(PierError, match=r"initialize\(\) of python model 'm' failed: RuntimeError: no weights"):
        ProcessInstance(_context(tmp_path), InstanceContext("m_0", "KIND_CPU"), default_launch())


def test_execution_mode_parameter_and_settings(tmp_path: Path) -> None:
    in_process = _context(tmp_path, parameters={"execution_mode": "in_process"})
    instance = BACKEND.create_instance(in_process, InstanceContext("m_0", "KIND_CPU"))
    try:
        assert int(instance.execute([_request(np.ones(1, np.float32))])[0].tensors[1].data[0]) == os.getpid()
    finally:
        instance.close()
    bad = _context(tmp_path, parameters={"execution_mode": "thread"})
    with pytest.raises(PierError, match="parameter 'execution_mode' is 'thread', expected one of process, in_process"):
        BACKEND.create_instance(bad, InstanceContext("m_0", "KIND_CPU"))
    assert PythonSettings.parse({"execution-mode": "in_process", "stub-restart-limit": "2",
                                 "shm-default-byte-size": "1"}) == \
        PythonSettings("in_process", 2, 600.0, ("shm-default-byte-size",))
    for settings, text in (({"bogus": "1"}, "unknown setting 'bogus'"), ({"stub-restart-limit": "-1"}, "count"),
                           ({"stub-restart-window-seconds": "0"}, "seconds > 0")):
        with pytest.raises(ValueError, match=text):
            PythonSettings.parse(settings)


def test_backend_config_flags_reach_the_python_backend(capsys: pytest.CaptureFixture[str]) -> None:
    """tritonserver's `--backend-config=[BACKEND,]KEY=VALUE` (server/cli.py): python settings act, Triton's
    python settings and other backends' are accepted and named as without effect, bad ones are refused."""
    from pier.cli import build_parser, settings_from_args

    parser = build_parser()

    def settings(*flags: str):
        return settings_from_args(parser.parse_args(["serve", f"--model-repository={Path(__file__).parent}",
                                                     *flags]), parser)

    try:
        s = settings("--backend-config=python,execution-mode=in_process",
                     "--backend-config=python,stub-restart-limit=2")
        assert BACKEND.settings == PythonSettings("in_process", 2, 600.0) and s.backend_config_ignored == ()
        assert "--backend-config" not in s.ignored_flags
        s = settings("--backend-config=python,shm-default-byte-size=1048576", "--backend-config=onnxruntime,x=1",
                     "--backend-config=default-max-batch-size=4")
        assert s.backend_config_ignored == ("python,shm-default-byte-size=1048576", "onnxruntime,x=1",
                                            "default-max-batch-size=4")
        assert "--backend-config" in s.ignored_flags and BACKEND.settings.execution_mode == "process"
        for flag, text in (("--backend-config=python,nope=1", "unknown setting 'nope' of the python backend"),
                           ("--backend-config=python", "expected [BACKEND,]KEY=VALUE"),
                           ("--backend-config=python,stub-restart-window-seconds=soon", "expected seconds > 0")):
            with pytest.raises(SystemExit):
                settings(flag)
            assert text in capsys.readouterr().err
    finally:
        BACKEND.configure({})
