"""Shared pieces of the benchmark harness: where the tools are (installing them when missing),
starting/stopping servers on free loopback ports, and run settings.

Environment variables (all optional):
  PIER_REFERENCE_TOOLS  folder of reference tools for the side-by-side rows, laid out as
                        perf-analyzer/, triton-reference/, vllm-reference/, python-limit/
                        (no default: when unset, the Triton, vLLM and bare python-limit rows are
                        skipped with a note in the report; see reference_tools())
  PERF_ANALYZER         perf_analyzer executable                 (default $PERF_ANALYZER_DIR/perf_analyzer)
  PERF_ANALYZER_DIR     perf_analyzer install dir                (default ~/opt/perf-analyzer)
  TRITON_DIR            reference Triton install dir             (default ~/opt/triton)
  PYTHON_LIMIT_DIR      folder with bare_http.py / bare_grpc.py  (default $PIER_REFERENCE_TOOLS/python-limit)
  PIER                  command that starts Pier, split on spaces (default: `pier` next to this Python,
                                                                  else `python -m pier`; `serve ...` follows)
A missing perf_analyzer is installed with this repository's scripts/install_perf_analyzer.sh (then,
if that fails, with $PIER_REFERENCE_TOOLS/perf-analyzer/install.sh); a missing Triton with
$PIER_REFERENCE_TOOLS/triton-reference/install.sh. If that fails or is not there, the benchmark
leaves that server out and says so in its report.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
RESULTS = BENCH / "results"
CACHE = BENCH / ".cache"
LOGS = CACHE / "logs"


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------------------- settings

@dataclass
class Settings:
    quick: bool = False
    rounds: int = 1  # interleaved repetitions (the median round; ratios: the median per-round ratio)
    window_ms: int = 3000  # perf_analyzer -p
    stability: int = 15  # perf_analyzer -s (percent)
    max_trials: int = 6  # perf_analyzer -r
    loadgen_s: float = 5.0  # own load generator / direct ORT: measured seconds per point
    warmup_s: float = 1.0

    @classmethod
    def make(cls, quick: bool, rounds: int | None = None) -> Settings:
        if quick:
            s = cls(quick=True, rounds=1, window_ms=1000, stability=25, max_trials=4, loadgen_s=2.0, warmup_s=0.5)
        else:
            s = cls()
            s.rounds = 3
        if rounds:
            s.rounds = rounds
        return s

    def describe(self) -> str:
        return (f"{'quick' if self.quick else 'full'} mode: {self.rounds} round(s); perf_analyzer -p {self.window_ms} "
                f"-s {self.stability} -r {self.max_trials}; own load generator / direct ORT "
                f"{self.loadgen_s:g} s per point after {self.warmup_s:g} s warm-up")


# ---------------------------------------------------------------------------- tools

REFERENCE_TOOLS_ENV = "PIER_REFERENCE_TOOLS"


def reference_tools() -> Path | None:
    """The folder named by $PIER_REFERENCE_TOOLS (perf-analyzer/, triton-reference/, vllm-reference/,
    python-limit/), or None when the variable is unset or empty or names no existing folder. There is
    no default: without it every side-by-side row that needs a reference tool is skipped."""
    value = os.environ.get(REFERENCE_TOOLS_ENV, "").strip()
    if not value:
        return None
    d = Path(value).expanduser()
    return d if d.is_dir() else None


def reference_tool(name: str) -> Path | None:
    """$PIER_REFERENCE_TOOLS/<name> (e.g. "triton-reference"), or None when it is not there."""
    base = reference_tools()
    if base is None or not (base / name).is_dir():
        return None
    return base / name


def reference_missing(name: str, row: str) -> str:
    """The report note for a row skipped because $PIER_REFERENCE_TOOLS/<name>/ is not there."""
    note = f"{REFERENCE_TOOLS_ENV} is not set (or has no {name}/): {row} skipped"
    value = os.environ.get(REFERENCE_TOOLS_ENV, "").strip()
    if value and reference_tools() is None:
        note += f" ({REFERENCE_TOOLS_ENV}={value} is not a folder)"
    return note


class ToolMissing(RuntimeError):
    """A reference tool is not there: the row is skipped, and str(exc) is the report's whole note."""


def _install(script: Path, target: Path, what: str) -> Path | None:
    """Run `bash script target`; returns the path the script printed last (None on failure)."""
    if not script.is_file():
        log(f"{what}: not installed at {target} and no {script}")
        return None
    log(f"{what}: installing into {target} with {script} (once)")
    try:
        proc = subprocess.run(["bash", str(script), str(target)], check=True, timeout=1800,
                              capture_output=True, text=True)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        log(f"{what}: install failed: {exc}" + (f"\n{err.strip()[-1500:]}" if err.strip() else ""))
        return None
    lines = [ln.strip() for ln in (proc.stdout or "").splitlines() if ln.strip()]
    return Path(lines[-1]) if lines else target


PERF_ANALYZER_INSTALLER = ROOT / "scripts" / "install_perf_analyzer.sh"
PERF_ANALYZER_MISSING = ("perf_analyzer not available: set PERF_ANALYZER (the binary) or PERF_ANALYZER_DIR, "
                         "or install it with `bash scripts/install_perf_analyzer.sh DIR`")


def perf_analyzer() -> Path | None:
    """The perf_analyzer executable: $PERF_ANALYZER, else $PERF_ANALYZER_DIR/perf_analyzer (default
    ~/opt/perf-analyzer), installed there when missing with scripts/install_perf_analyzer.sh, and
    only if that fails with $PIER_REFERENCE_TOOLS/perf-analyzer/install.sh (when that folder is set)."""
    if os.environ.get("PERF_ANALYZER"):
        p = Path(os.environ["PERF_ANALYZER"])
        return p if p.exists() else None
    d = Path(os.environ.get("PERF_ANALYZER_DIR", Path.home() / "opt" / "perf-analyzer"))
    exe = d / "perf_analyzer"
    if exe.exists():
        return exe
    installers = [PERF_ANALYZER_INSTALLER]
    ref = reference_tool("perf-analyzer")
    if ref is not None:
        installers.append(ref / "install.sh")
    for script in installers:
        printed = _install(script, d, "perf_analyzer")
        if exe.exists():
            return exe
        if printed is not None and printed.is_file():
            return printed
    return None


def perf_analyzer_required() -> Path:
    """perf_analyzer() or a RuntimeError saying how to get it (the benchmarks that drive with it need it)."""
    pa = perf_analyzer()
    if pa is None:
        raise RuntimeError(PERF_ANALYZER_MISSING)
    return pa


def triton_dir() -> Path | None:
    """The reference Triton install dir ($TRITON_DIR, default ~/opt/triton), installed when missing
    with $PIER_REFERENCE_TOOLS/triton-reference/install.sh; None when it is not installed and cannot be."""
    d = Path(os.environ.get("TRITON_DIR", Path.home() / "opt" / "triton"))

    def ok() -> bool:
        return (d / "backends" / "python" / "triton_python_backend_stub").exists() and (d / "pyenv").is_dir()

    if not ok():
        ref = reference_tool("triton-reference")
        if ref is None:
            log(f"triton: not installed at {d}; " + reference_missing("triton-reference", "its install"))
        else:
            _install(ref / "install.sh", d, "triton")
    return d if ok() else None


def python_limit_dir() -> Path | None:
    """The folder with bare_http.py / bare_grpc.py: $PYTHON_LIMIT_DIR, else
    $PIER_REFERENCE_TOOLS/python-limit; None when neither has both scripts."""
    if os.environ.get("PYTHON_LIMIT_DIR"):
        d: Path | None = Path(os.environ["PYTHON_LIMIT_DIR"])
    else:
        d = reference_tool("python-limit")
    if d is None:
        return None
    return d if (d / "bare_http.py").is_file() and (d / "bare_grpc.py").is_file() else None


def pier_command() -> list[str]:
    if os.environ.get("PIER"):
        return os.environ["PIER"].split()
    exe = Path(sys.executable).parent / "pier"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "pier"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def git_describe() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return head + (" (+ uncommitted changes)" if dirty else "")
    except Exception:
        return "?"


def machine() -> str:
    cpu = "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return f"{os.cpu_count()} CPUs ({cpu}), Python {sys.version.split()[0]}"


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


# ---------------------------------------------------------------------------- servers

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


def _wait_http_ready(server: Server, path: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    url = f"http://{server.http}{path}"
    while time.monotonic() < deadline:
        if not server.alive():
            raise RuntimeError(f"{server.name} exited (rc {server.proc.returncode}):\n{server.log_tail()}")
        with contextlib.suppress(requests.RequestException):
            if requests.get(url, timeout=2).status_code == 200:
                return
        time.sleep(0.2)
    raise RuntimeError(f"{server.name} not ready after {timeout:.0f} s:\n{server.log_tail()}")


def _wait_grpc_ready(server: Server, timeout: float) -> None:
    import tritonclient.grpc as grpcclient

    deadline = time.monotonic() + timeout
    client = grpcclient.InferenceServerClient(server.grpc)
    try:
        while time.monotonic() < deadline:
            if not server.alive():
                raise RuntimeError(f"{server.name} exited (rc {server.proc.returncode}):\n{server.log_tail()}")
            with contextlib.suppress(Exception):
                if client.is_server_ready(client_timeout=2):
                    return
            time.sleep(0.2)
    finally:
        client.close()
    raise RuntimeError(f"{server.name} not ready after {timeout:.0f} s:\n{server.log_tail()}")


def _popen(cmd: list[str], log_name: str, env: dict | None = None) -> tuple[subprocess.Popen, Path]:
    LOGS.mkdir(parents=True, exist_ok=True)
    log_path = LOGS / f"{log_name}.log"
    with open(log_path, "ab") as fh:  # appended: a restarted server keeps its earlier log
        fh.write(f"\n===== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd)}\n".encode())
        fh.flush()
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=ROOT, env={**os.environ, **(env or {})})
    return proc, log_path


def python_path() -> str:
    """PYTHONPATH for a Pier process: the checkout first, then the caller's entries (the GPU
    machines' carried wheels live there)."""
    return os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))


def start_pier(name: str, repo: Path, *extra: str, timeout: float = 120) -> Server:
    http, grpc_, metrics = free_port(), free_port(), free_port()
    cmd = [*pier_command(), "serve", "--model-repository", str(repo),
           "--http-port", str(http), "--grpc-port", str(grpc_), "--metrics-port", str(metrics),
           "--http-address", "127.0.0.1", "--grpc-address", "127.0.0.1", "--metrics-address", "127.0.0.1", *extra]
    proc, log_path = _popen(cmd, name.replace(" ", "_"), env={"PYTHONPATH": python_path()})
    server = Server(name, http=f"127.0.0.1:{http}", grpc=f"127.0.0.1:{grpc_}", proc=proc, log_path=log_path)
    try:
        _wait_http_ready(server, "/v2/health/ready", timeout)
    except BaseException:
        server.stop()
        raise
    return server


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
    address = {protocol: f"127.0.0.1:{port}"}
    server = Server(name, proc=proc, log_path=log_path, **address)
    try:
        if protocol == "http":
            _wait_http_ready(server, "/v2/health/ready", timeout)
        else:
            _wait_grpc_ready(server, timeout)
    except BaseException:
        server.stop()
        raise
    return server


def start_bare_http(timeout: float = 30) -> Server:
    return _start_bare("bare_http.py", "bare aiohttp", "http", timeout)


def start_bare_grpc(timeout: float = 30) -> Server:
    return _start_bare("bare_grpc.py", "bare grpc.aio", "grpc", timeout)


TRITON = "Triton 2.51"


def start_triton(repo: Path, timeout: float = 180) -> Server:
    """The reference tritonserver via $PIER_REFERENCE_TOOLS/triton-reference/start.sh; stopped with stop.sh.

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
                        str(metrics)], check=True, timeout=timeout, capture_output=True, text=True)
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
    try:  # start.sh waits for live; the model must be ready too
        _wait_http_ready(server, "/v2/health/ready", timeout)
    except BaseException:
        server.stop()
        raise
    return server


class Servers(contextlib.ExitStack):
    """Starts servers and guarantees they are stopped (also on errors and Ctrl-C)."""

    def __init__(self) -> None:
        super().__init__()
        self.missing: dict[str, str] = {}  # label -> why it is left out (first line)
        self.skipped: dict[str, str] = {}  # label -> the note for a row whose reference tool is not there
        self._old_term = None

    def __enter__(self) -> Servers:
        super().__enter__()
        # Turn SIGTERM into an exception so `finally`/ExitStack still stop the servers.
        with contextlib.suppress(ValueError):
            self._old_term = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
        return self

    def __exit__(self, *exc) -> bool:
        try:
            return super().__exit__(*exc)
        finally:
            if self._old_term is not None:
                with contextlib.suppress(ValueError):
                    signal.signal(signal.SIGTERM, self._old_term)

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


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def temp_dir(prefix: str) -> Iterator[Path]:
    CACHE.mkdir(parents=True, exist_ok=True)
    d = Path(tempfile.mkdtemp(prefix=prefix, dir=CACHE))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)
