"""Servers under test: Server (one process, its ports and log), the readiness waits, start_pier
(also for another build of Pier: bench/revisions.py), the reference Triton and the bare Python
servers, all on free loopback ports; Servers stops them whatever happens, and measure() restarts a
server that died under a measurement (MAX_RESTARTS) and turns failures into report notes."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import requests

from bench.common import CACHE, LOGS, ROOT, free_port, log, pier_command, sigterm_as_interrupt
from bench.tools import ToolMissing, python_limit_dir, reference_missing, reference_tool, triton_dir


@dataclass
class Server:
    """A server under test. `http`/`grpc` are host:port strings (None when it lacks one)."""

    name: str
    http: str | None = None
    grpc: str | None = None
    proc: subprocess.Popen | None = None
    log_path: Path | None = None
    stop_fn: Callable[[], None] | None = None
    pid: int | None = None  # for servers started by a script (Triton): the server's own pid
    notes: list[str] = field(default_factory=list)
    start_fn: Callable[[], Server] | None = None
    restarts: int = 0

    def stop(self) -> None:
        if self.stop_fn is not None:
            fn, self.stop_fn = self.stop_fn, None
            fn()
            return
        p = self.proc
        if p is None or p.poll() is not None:
            return
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)

    def alive(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        if self.pid is not None:
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                return False
            except PermissionError:
                return True
        return True

    def exit_info(self) -> str:
        if self.proc is not None and self.proc.poll() is not None:
            return f"exit status {self.proc.returncode}"
        return "gone"

    def restart(self) -> None:
        """Start a fresh copy in place of a server that died (the same object keeps being used)."""
        if self.start_fn is None:
            raise RuntimeError(f"{self.name} cannot be restarted")
        with contextlib.suppress(Exception):
            self.stop()
        new = self.start_fn()
        self.http, self.grpc, self.proc, self.log_path = new.http, new.grpc, new.proc, new.log_path
        self.stop_fn, self.pid = new.stop_fn, new.pid
        self.restarts += 1

    def log_tail(self, n: int = 20) -> str:
        if self.log_path and self.log_path.exists():
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        return ""


def _wait(server: Server, probe: Callable[[], bool], errors: type[Exception], timeout: float) -> None:
    """Poll `probe()` (its `errors` count as not ready) until it is true; raise when the server exits
    or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not server.alive():
            raise RuntimeError(f"{server.name} exited (rc {server.proc.returncode}):\n{server.log_tail()}")
        with contextlib.suppress(errors):
            if probe():
                return
        time.sleep(0.2)
    raise RuntimeError(f"{server.name} not ready after {timeout:.0f} s:\n{server.log_tail()}")


def wait_http_ready(server: Server, timeout: float, path: str = "/v2/health/ready") -> None:
    url = f"http://{server.http}{path}"
    _wait(server, lambda: requests.get(url, timeout=2).status_code == 200, requests.RequestException, timeout)


def wait_grpc_ready(server: Server, timeout: float) -> None:
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.grpc)
    try:
        _wait(server, lambda: client.is_server_ready(client_timeout=2), Exception, timeout)
    finally:
        client.close()


def ready_or_stopped(server: Server, wait: Callable[[], object]) -> Server:
    """`server` once `wait()` returns; stopped (and the error raised on) when it fails or is interrupted."""
    try:
        wait()
    except BaseException:
        server.stop()
        raise
    return server


def _popen(cmd: list[str], log_name: str, env: dict | None = None,
           cwd: Path = ROOT) -> tuple[subprocess.Popen, Path]:
    LOGS.mkdir(parents=True, exist_ok=True)
    log_path = LOGS / f"{log_name}.log"
    with open(log_path, "ab") as fh:  # appended: a restarted server keeps its earlier log
        fh.write(f"\n===== {time.strftime('%Y-%m-%d %H:%M:%S')} (cwd {cwd}) {' '.join(cmd)}\n".encode())
        fh.flush()
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=cwd, env={**os.environ, **(env or {})})
    return proc, log_path


def start_pier(name: str, repo: Path, *extra: str, timeout: float = 120, command: list[str] | None = None,
               cwd: Path = ROOT, env: dict | None = None) -> Server:
    """Pier serving `repo` on free loopback ports; `command` (default pier_command()), `cwd` and
    `env` start another build of it (bench/revisions.py: an older revision's checkout)."""
    http, grpc_, metrics = free_port(), free_port(), free_port()
    cmd = [*(command or pier_command()), "serve", "--model-repository", str(repo),
           "--http-port", str(http), "--grpc-port", str(grpc_), "--metrics-port", str(metrics),
           "--http-address", "127.0.0.1", "--grpc-address", "127.0.0.1", "--metrics-address", "127.0.0.1", *extra]
    proc, log_path = _popen(cmd, name.replace(" ", "_"), env, cwd)
    server = Server(name, http=f"127.0.0.1:{http}", grpc=f"127.0.0.1:{grpc_}", proc=proc, log_path=log_path)
    return ready_or_stopped(server, lambda: wait_http_ready(server, timeout))


def copy_without_queue_delay(src: Path, dest: Path) -> Path:
    """A copy of the model folder `src` whose config asks for no dynamic-batching queue delay: the
    side-by-side row that shows what the example's `max_queue_delay_microseconds` costs."""
    shutil.copytree(src, dest)
    config = dest / "config.pbtxt"
    text = config.read_text()
    changed = re.sub(r"max_queue_delay_microseconds:\s*\d+", "max_queue_delay_microseconds: 0", text)
    if changed == text:
        raise RuntimeError(f"{config} sets no max_queue_delay_microseconds to clear")
    config.write_text(changed)
    return dest


def _start_bare(script: str, name: str, protocol: str, timeout: float) -> Server:
    """One of the python-limit servers, on a free port, ready to answer."""
    d = python_limit_dir()
    if d is None:
        if os.environ.get("PYTHON_LIMIT_DIR"):
            raise RuntimeError(f"no bare_http.py / bare_grpc.py in PYTHON_LIMIT_DIR={os.environ['PYTHON_LIMIT_DIR']}")
        raise ToolMissing(reference_missing("python-limit", name))
    port = free_port()
    proc, log_path = _popen([sys.executable, str(d / script), str(port), "--uvloop"], script.removesuffix(".py"))
    server = Server(name, proc=proc, log_path=log_path, **{protocol: f"127.0.0.1:{port}"})
    wait = wait_http_ready if protocol == "http" else wait_grpc_ready
    return ready_or_stopped(server, lambda: wait(server, timeout))


def start_bare_http(timeout: float = 30) -> Server:
    return _start_bare("bare_http.py", "bare aiohttp", "http", timeout)


def start_bare_grpc(timeout: float = 30) -> Server:
    return _start_bare("bare_grpc.py", "bare grpc.aio", "grpc", timeout)


TRITON = "Triton 2.51"


def triton_reference_starter(model: str, scratch: Path) -> Callable[[], Server]:
    """A starter for the reference Triton serving its own `models/<model>` from a private copy in
    `scratch` (its python backend writes __pycache__ next to model.py); without the reference
    tools, start_triton raises the skip note."""
    ref = reference_tool("triton-reference")
    src = ref / "models" / model if ref is not None else None
    if src is not None and src.is_dir():
        shutil.copytree(src, scratch / model)

    def start() -> Server:
        if src is not None and not src.is_dir():
            raise RuntimeError(f"no {src} (the reference Triton's {model})")
        return start_triton(scratch)

    return start


def start_triton(repo: Path, timeout: float = 180, extra: Sequence[str] = ()) -> Server:
    """The reference tritonserver via $PIER_REFERENCE_TOOLS/triton-reference/start.sh (`extra`: more
    tritonserver flags); stopped with stop.sh.

    start.sh/stop.sh keep server.pid and server.log in the install dir they are given, so an install
    shared with other users (tests, another benchmark) could have them stop each other's server. The
    harness therefore hands them a private run dir whose venv/, pyenv/ and backends/ are links to the
    real install: its pid file and log are ours alone, and stop.sh can only stop our tritonserver."""
    scripts = reference_tool("triton-reference")
    if scripts is None:
        raise ToolMissing(reference_missing("triton-reference", TRITON))
    if not (scripts / "start.sh").is_file() or not (scripts / "stop.sh").is_file():
        raise RuntimeError(f"reference Triton unavailable: no start.sh / stop.sh in {scripts}")
    d = triton_dir()
    if d is None:
        raise RuntimeError(f"reference Triton unavailable: not installed at TRITON_DIR "
                           f"({os.environ.get('TRITON_DIR', '~/opt/triton')}) and {scripts}/install.sh failed")
    LOGS.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix="triton-run-", dir=CACHE))
    for name in ("venv", "pyenv", "backends"):
        (run_dir / name).symlink_to(d / name, target_is_directory=True)
    http, grpc_, metrics = free_port(), free_port(), free_port()
    stop_sh = scripts / "stop.sh"

    def stop() -> None:
        try:
            if (run_dir / "server.pid").exists():
                subprocess.run(["bash", str(stop_sh), str(run_dir)], timeout=60, capture_output=True)
        finally:
            with contextlib.suppress(OSError):
                shutil.copy(run_dir / "server.log", LOGS / "triton.log")
            shutil.rmtree(run_dir, ignore_errors=True)

    try:
        subprocess.run(["bash", str(scripts / "start.sh"), str(run_dir), str(repo), str(http), str(grpc_),
                        str(metrics), *extra], check=True, timeout=timeout, capture_output=True, text=True)
    except subprocess.CalledProcessError as exc:
        stop()
        raise RuntimeError(f"triton start.sh failed: {exc.stderr[-2000:]}") from exc
    except BaseException:
        stop()
        raise
    server = Server(TRITON, http=f"127.0.0.1:{http}", grpc=f"127.0.0.1:{grpc_}",
                    log_path=run_dir / "server.log", stop_fn=stop)
    with contextlib.suppress(OSError, ValueError):
        server.pid = int((run_dir / "server.pid").read_text().strip())
    # start.sh waits for live; the model must be ready too
    return ready_or_stopped(server, lambda: wait_http_ready(server, timeout))


class Servers(contextlib.ExitStack):
    """Starts servers and guarantees they are stopped (also on errors and Ctrl-C)."""

    def __init__(self) -> None:
        super().__init__()
        self.missing: dict[str, str] = {}  # label -> why it is left out (first line)
        self.skipped: dict[str, str] = {}  # label -> the note for a row whose reference tool is not there

    def __enter__(self) -> Servers:
        super().__enter__()
        # SIGTERM becomes an exception so that the servers are still stopped; undone last, after them.
        self.enter_context(sigterm_as_interrupt())
        return self

    def left_out_notes(self) -> list[str]:
        """One report note per server that could not be started (skipped reference rows included)."""
        return [self.skipped.get(label) or f"{label} left out: {why}" for label, why in self.missing.items()]

    def add(self, label: str, start: Callable[[], Server], required: bool = False) -> Server | None:
        log(f"starting {label}")
        t0 = time.monotonic()
        try:
            server = start()
        except ToolMissing as exc:
            if required:
                raise
            log(str(exc))
            self.missing[label] = self.skipped[label] = str(exc)
            return None
        except Exception as exc:
            if required:
                raise
            log(f"{label}: left out: {exc}")
            self.missing[label] = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            return None
        server.start_fn = start
        self.callback(_stop_logged, server)
        log(f"{label} ready in {time.monotonic() - t0:.1f} s (http {server.http}, grpc {server.grpc})")
        return server


def round_order(names: Sequence[str], up: Mapping[str, Server | None], rnd: int) -> list[str]:
    """The started servers among `names` in round `rnd`'s order: rotated by one each round, so each
    goes first in turn (interleaved rounds)."""
    started = [s for s in names if up.get(s) is not None]
    k = rnd % len(started) if started else 0
    return started[k:] + started[:k]


MAX_RESTARTS = 3


def measure(server: Server, fn: Callable[[], object], label: str, notes: list[str]):
    """Run one measurement `fn()` against `server`. A server found dead (before, or after a failed
    measurement: something else on the machine may have killed it) is restarted, at most
    MAX_RESTARTS times per server, and the point measured again once; every such event and every
    failure goes to `notes`. Returns fn()'s result, or None when the point could not be measured."""
    for attempt in (1, 2):
        if not server.alive():
            if server.restarts >= MAX_RESTARTS:
                notes.append(f"{label}: not measured, {server.name} is down ({server.exit_info()}) and was "
                             f"already restarted {server.restarts} times")
                return None
            msg = f"{server.name} had exited ({server.exit_info()}, not stopped by the harness); restarted it"
            log(f"{label}: {msg}")
            notes.append(f"{label}: {msg}")
            try:
                server.restart()
            except Exception as exc:
                notes.append(f"{label}: restart failed: {str(exc).splitlines()[0] if str(exc) else exc!r}")
                return None
        try:
            return fn()
        except Exception as exc:
            text = str(exc)
            log(text)
            if attempt == 1 and not server.alive():
                continue  # it died under us: restart and measure again
            lines = [ln for ln in text.splitlines() if ln.strip()]
            notes.append(" ".join(lines[:1] + lines[-1:]) if len(lines) > 1 else text)
            return None
    return None


def _stop_logged(server: Server) -> None:
    log(f"stopping {server.name}")
    try:
        server.stop()
    except Exception as exc:  # keep stopping the others
        log(f"stopping {server.name} failed: {exc}")
