"""Python models in their own stub processes (the default, as Triton), against the real server:
a stub killed with SIGKILL under load (what the kernel's OOM killer does to a model whose memory
grows without bound: stubs are its first choice) fails only its own in-flight requests (naming the cause)
while an ONNX model and another python model serve without one failure, then comes back; a
model that calls os._exit(3) or segfaults does the same; past the restart limit the model
stays UNAVAILABLE until it is loaded again; `execution_mode` and `--backend-config=python,...`
choose in-process execution; EXECUTION_ENV_PATH runs a model in its packed environment. No
stub process and no /dev/shm entry outlives the server."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import EXAMPLE_REPO, ROOT, PierProcess, start_pier

MODEL = '''
import ctypes, os, time
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        time.sleep(0.02)
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy()
            if x.size and x.flat[0] == -3:
                os._exit(3)
            if x.size and x.flat[0] == -11:
                ctypes.string_at(0)
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", x),
                                                   pb_utils.Tensor("PID", np.array([os.getpid()], np.int64))]))
        return out
'''

CONFIG = """name: "{name}"
backend: "python"
max_batch_size: 0
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] }}, {{ name: "PID" data_type: TYPE_INT64 dims: [ 1 ] }} ]
{extra}
"""

ENV_MODEL = '''
import sys
import numpy as np
import pier_env_marker
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        text = f"{sys.prefix}|{pier_env_marker.VALUE}".encode()
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([text], dtype=np.object_))])
                for _ in requests]
'''


def _model(repo: Path, name: str, extra: str = "", code: str = MODEL, config: str | None = None) -> Path:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "1" / "model.py").write_text(code)
    (repo / name / "config.pbtxt").write_text(config or CONFIG.format(name=name, extra=extra))
    return repo / name


def _param(key: str, value: str) -> str:
    return f'parameters {{ key: "{key}" value {{ string_value: "{value}" }} }}'


def stubs(server_pid: int) -> dict[str, int]:
    """The live stub processes of a server: instance name -> pid."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(") ", 1)[1][0]
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        text = [a.decode(errors="replace") for a in argv]
        if state != "Z" and any("pier.backends.python.stub" in a for a in text) and "--parent-pid" in text \
                and text[text.index("--parent-pid") + 1] == str(server_pid):
            found[text[text.index("--instance") + 1]] = int(entry)
    return found


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def _infer(client: httpclient.InferenceServerClient, model: str, x: np.ndarray) -> tuple[np.ndarray, int]:
    inp = httpclient.InferInput("INPUT0", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    result = client.infer(model, [inp])
    return result.as_numpy("OUTPUT0"), int(result.as_numpy("PID")[0])


def _until(check: Callable[[], bool], what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except InferenceServerException:
            pass
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _stopped_clean(server: PierProcess, shm_before: set[str]) -> None:
    pid = server.proc.pid
    assert stubs(pid), "the server had stub processes"
    assert server.stop() == 0, server.log()
    _until(lambda: not stubs(pid), "the stub processes to go", timeout=5)
    assert _shm() <= shm_before, _shm() - shm_before


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    repo = tmp_path_factory.mktemp("proc") / "repo"
    for name in ("victim_py", "crash_py", "bystander_py"):
        _model(repo, name)
    _model(repo, "inproc_py", _param("execution_mode", "in_process"))
    shutil.copytree(EXAMPLE_REPO / "simple", repo / "simple")
    shm = _shm()
    proc = start_pier([repo], log_path=repo.parent / "pier.log")
    yield proc
    _stopped_clean(proc, shm)


def test_a_killed_stub_fails_only_its_own_requests_and_comes_back(server: PierProcess) -> None:
    http = httpclient.InferenceServerClient(server.http_url)
    x = np.arange(32768, dtype=np.float32)  # 128 KiB: the tensors cross in a memfd
    first_pid = _infer(http, "victim_py", x)[1]
    assert stubs(server.proc.pid)["victim_py_0"] == first_pid != server.proc.pid

    def oom_adj(pid: int) -> int:
        return int(Path(f"/proc/{pid}/oom_score_adj").read_text())

    assert oom_adj(first_pid) == min(1000, oom_adj(server.proc.pid) + 500)  # out of memory: the stub goes first
    stop = threading.Event()
    victim: dict[str, list] = {"ok": [], "errors": []}
    others: dict[str, list] = {"ok": [], "errors": []}

    def load_victim() -> None:
        client = httpclient.InferenceServerClient(server.http_url)
        while not stop.is_set():
            try:
                y, pid = _infer(client, "victim_py", x)
                assert np.array_equal(y, x)
                victim["ok"].append(pid)
            except InferenceServerException as exc:
                victim["errors"].append(str(exc))

    def load_simple() -> None:
        client = grpcclient.InferenceServerClient(server.grpc_url)
        a = np.arange(16, dtype=np.int32).reshape(1, 16)
        inputs = [grpcclient.InferInput("INPUT0", [1, 16], "INT32"), grpcclient.InferInput("INPUT1", [1, 16], "INT32")]
        for inp in inputs:
            inp.set_data_from_numpy(a)
        while not stop.is_set():
            try:
                assert np.array_equal(client.infer("simple", inputs).as_numpy("OUTPUT0"), 2 * a)
                others["ok"].append("simple")
            except Exception as exc:  # noqa: BLE001 - any failure of a bystander counts
                others["errors"].append(f"simple: {exc}")

    def load_bystander() -> None:
        client = httpclient.InferenceServerClient(server.http_url)
        while not stop.is_set():
            try:
                assert np.array_equal(_infer(client, "bystander_py", x)[0], x)
                others["ok"].append("bystander_py")
            except Exception as exc:  # noqa: BLE001
                others["errors"].append(f"bystander_py: {exc}")

    threads = [threading.Thread(target=f) for f in (load_victim, load_victim, load_victim, load_simple, load_bystander)]
    for t in threads:
        t.start()
    try:
        _until(lambda: len(victim["ok"]) > 20, "the victim to serve under load")
        os.kill(first_pid, signal.SIGKILL)
        _until(lambda: any(pid != first_pid for pid in victim["ok"][-5:]), "the victim to serve again")
        served, restarted = len(others["ok"]), len(victim["ok"])
        _until(lambda: len(victim["ok"]) > restarted + 10 and len(others["ok"]) > served + 20,
               "more load after the restart")
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert others["errors"] == [] and len(others["ok"]) > 50, others["errors"][:5]
    cause = "Stub process for model 'victim_py' instance 'victim_py_0' died: killed by signal 9 (SIGKILL)"
    assert any(cause in e for e in victim["errors"]), victim["errors"]
    for error in victim["errors"]:  # in flight: the cause; arriving while it restarts: not healthy / no version
        assert cause in error or "Stub process 'victim_py_0' is not healthy" in error \
            or "'victim_py' has no available versions" in error, error
    assert http.is_model_ready("victim_py")
    new_pid = _infer(http, "victim_py", x)[1]
    assert new_pid != first_pid and stubs(server.proc.pid)["victim_py_0"] == new_pid
    log = server.log()
    assert f"'victim_py' version 1 is UNAVAILABLE: {cause}" in log and "'victim_py' version 1 is READY again" in log


@pytest.mark.parametrize(("value", "cause"), [(-3, "exited with code 3"), (-11, "killed by signal 11 (SIGSEGV)")],
                         ids=["os._exit", "segfault"])
def test_a_model_that_exits_or_segfaults_fails_its_request_and_comes_back(server: PierProcess, value: int,
                                                                          cause: str) -> None:
    http = httpclient.InferenceServerClient(server.http_url)
    before = _infer(http, "crash_py", np.ones(2, np.float32))[1]
    with pytest.raises(InferenceServerException) as failed:
        _infer(http, "crash_py", np.full(2, value, np.float32))
    assert f"Stub process for model 'crash_py' instance 'crash_py_0' died: {cause}" in str(failed.value)
    assert failed.value.status() == "500"
    _until(lambda: _infer(http, "crash_py", np.ones(2, np.float32))[1] != before, "crash_py to serve again")
    assert http.is_server_live() and _infer(http, "bystander_py", np.ones(1, np.float32))[0].tolist() == [1.0]
    if value == -11:
        assert "Fatal Python error: Segmentation fault" in server.log()  # faulthandler: the model's stack


def test_the_execution_mode_parameter_keeps_a_model_in_the_server(server: PierProcess) -> None:
    http = httpclient.InferenceServerClient(server.http_url)
    assert _infer(http, "inproc_py", np.ones(1, np.float32))[1] == server.proc.pid
    assert "inproc_py_0" not in stubs(server.proc.pid)


def _packed_env(model_dir: Path, scratch: Path) -> None:
    """A venv (the server's Python) with one module of its own, packed as a tarball."""
    env = scratch / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True, timeout=120)
    site = next((env / "lib").glob("python3*/site-packages"))
    (site / "pier_env_marker.py").write_text('VALUE = "from the packed env"\n')
    with tarfile.open(model_dir / "env.tar.gz", "w:gz") as tar:
        for item in env.iterdir():
            tar.add(item, arcname=item.name)


def test_restart_limit_backend_config_and_packed_environments(tmp_path: Path) -> None:
    """`--backend-config=python,execution-mode=in_process` (the server-wide default) and
    `stub-restart-limit=1`: one restart, then the model stays UNAVAILABLE until loaded again;
    EXECUTION_ENV_PATH runs its model in the unpacked environment (cached once)."""
    repo = tmp_path / "repo"
    _model(repo, "crash_py", _param("execution_mode", "process"))
    _model(repo, "plain_py")
    env_model = _model(repo, "env_py", config=(
        'name: "env_py"\nbackend: "python"\noutput [ { name: "OUT" data_type: TYPE_STRING dims: [ 1 ] } ]\n'
        'input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
        + _param("EXECUTION_ENV_PATH", "$$TRITON_MODEL_DIRECTORY/env.tar.gz")), code=ENV_MODEL)
    _packed_env(env_model, tmp_path)
    cache = tmp_path / "env-cache"
    shm = _shm()
    server = start_pier([repo], "--model-control-mode=explicit", "--load-model=*",
                        "--backend-config=python,execution-mode=in_process",
                        "--backend-config=python,stub-restart-limit=1", log_path=tmp_path / "pier.log",
                        env={"PIER_PYTHON_ENV_CACHE": str(cache)})
    try:
        http = httpclient.InferenceServerClient(server.http_url)
        assert _infer(http, "plain_py", np.ones(1, np.float32))[1] == server.proc.pid  # the server-wide default
        pid = _infer(http, "crash_py", np.ones(1, np.float32))[1]
        assert pid != server.proc.pid
        for _ in range(2):  # the first death restarts it, the second is past the limit
            with pytest.raises(InferenceServerException, match="died: exited with code 3"):
                _infer(http, "crash_py", np.full(1, -3, np.float32))
            if _ == 0:
                _until(lambda: _infer(http, "crash_py", np.ones(1, np.float32))[1] != pid, "one restart")
        _until(lambda: not http.is_model_ready("crash_py"), "crash_py UNAVAILABLE")
        index = {m["name"]: m for m in http.get_model_repository_index()}
        assert index["crash_py"]["state"] == "UNAVAILABLE"
        assert "not restarted: 1 restarts in the last 600 s" in index["crash_py"]["reason"], index["crash_py"]
        with pytest.raises(InferenceServerException):
            _infer(http, "crash_py", np.ones(1, np.float32))
        http.load_model("crash_py")  # a reload starts it afresh
        assert http.is_model_ready("crash_py") and _infer(http, "crash_py", np.ones(1, np.float32))[0].tolist() == [1]

        inp = httpclient.InferInput("INPUT0", [1], "FP32")
        inp.set_data_from_numpy(np.ones(1, np.float32))
        prefix, value = http.infer("env_py", [inp]).as_numpy("OUT")[0].decode().split("|")
        assert value == "from the packed env" and Path(prefix).parent == cache, prefix
        http.load_model("env_py")  # a reload reuses the unpacked environment
        assert http.infer("env_py", [inp]).as_numpy("OUT")[0].decode().split("|")[0] == prefix
        assert [p.name for p in cache.iterdir()] == [Path(prefix).name]
    finally:
        _stopped_clean(server, shm)


def test_no_stub_outlives_a_server_killed_with_sigkill(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    _model(repo, "crash_py")
    _model(repo, "bystander_py")
    shm = _shm()
    server = start_pier([repo], log_path=tmp_path / "pier.log")
    http = httpclient.InferenceServerClient(server.http_url)
    _infer(http, "crash_py", np.ones(100_000, np.float32))  # 400 KB: through shared memory
    assert set(stubs(server.proc.pid)) == {"crash_py_0", "bystander_py_0"}
    server.proc.kill()
    server.proc.wait()
    _until(lambda: not stubs(server.proc.pid), "the stubs to die with the server", timeout=10)
    assert _shm() <= shm


def test_python_backend_settings_are_checked() -> None:
    for flag, text in (("--backend-config=python,no-such-key=1", "unknown setting 'no-such-key' of the python backend"),
                       ("--backend-config=python,execution-mode=thread", "expected one of process, in_process")):
        proc = subprocess.run([sys.executable, "-m", "pier", "serve", f"--model-repository={EXAMPLE_REPO}", flag],
                              capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert proc.returncode == 2 and text in proc.stderr, proc.stderr
