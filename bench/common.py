"""Shared pieces of the benchmark harness: paths, run settings, logging, the Pier command, and
facts about the run (machine, revision, load), and small run helpers (a temporary folder under
bench/.cache, SIGTERM as KeyboardInterrupt). Tools live in bench/tools.py (where the reference tools
are, installing them when missing), servers in bench/servers.py, older revisions in bench/revisions.py."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
RESULTS = BENCH / "results"
CACHE = BENCH / ".cache"
LOGS = CACHE / "logs"
# The LLM engine's C++ kernels compile once per checkout, into build/ as the tests do (tests/conftest.py):
# torch rebuilds a shared ~/.cache/torch_extensions whenever another checkout or venv built last, and a
# rebuild inside a restarted engine core (tens of seconds on 2 busy cores) would count as its restart.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / "build" / "torch_extensions"))


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


# ---------------------------------------------------------------------------- run helpers

def pier_command() -> list[str]:
    """The command that starts Pier ($PIER split on spaces, else `pier` next to this Python, else
    `python -m pier`); `serve ...` follows."""
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


@contextlib.contextmanager
def temp_dir(prefix: str) -> Iterator[Path]:
    CACHE.mkdir(parents=True, exist_ok=True)
    d = Path(tempfile.mkdtemp(prefix=prefix, dir=CACHE))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt inside the block, so `finally` blocks and ExitStacks still stop
    the servers and remove temporary folders; the previous handler is back afterwards. Outside the
    main thread (where no handler can be set) it does nothing."""
    old = None
    with contextlib.suppress(ValueError):
        old = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    try:
        yield
    finally:
        if old is not None:
            with contextlib.suppress(ValueError):
                signal.signal(signal.SIGTERM, old)
