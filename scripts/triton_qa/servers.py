"""Start and stop the server under test (Pier or the reference tritonserver) on Triton's default ports."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

PORTS = (8000, 8001, 8002)
REPO_ROOT = Path(__file__).resolve().parents[2]


def port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def wait_ports_free(timeout: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        busy = [p for p in PORTS if not port_free(p)]
        if not busy or time.monotonic() > deadline:
            return busy
        time.sleep(0.5)


class ServerKind:
    """How to launch one server kind: the argv prefix and environment; flags are tritonserver's."""

    name: str

    def argv(self, flags: list[str]) -> list[str]:
        raise NotImplementedError

    def env(self) -> dict[str, str]:
        return dict(os.environ)

    def shim(self, path: Path) -> None:
        """A `tritonserver` executable at `path` (log_format_test.py runs `tritonserver` from PATH)."""
        lines = ["#!/usr/bin/env bash"]
        for k, v in self.env().items():
            if k in ("PATH", "LD_LIBRARY_PATH"):
                lines.append(f"export {k}='{v}'")
        lines.append("exec " + " ".join(f"'{a}'" for a in self.argv([])) + ' "$@"')
        path.write_text("\n".join(lines) + "\n")
        path.chmod(0o755)


class Pier(ServerKind):
    name = "pier"

    def __init__(self, exe: str | None = None):
        self.exe = exe or os.environ.get("PIER", str(REPO_ROOT / ".venv" / "bin" / "pier"))

    def available(self) -> str | None:
        return None if Path(self.exe).exists() else f"{self.exe} not found (make .venv/.linked)"

    def argv(self, flags: list[str]) -> list[str]:
        return [self.exe, "serve", *flags]


class Triton(ServerKind):
    """The reference tritonserver 2.51 from the reference tools' triton-reference/install.sh, launched the way its
    start.sh does (same environment and bind flags), but directly, so the runner owns the process and its log."""

    name = "triton"

    def __init__(self, home: str | None = None):
        self.home = Path(home or os.environ.get("TRITON_HOME", str(Path.home() / "opt" / "triton")))

    def _tsdir(self) -> Path | None:
        found = sorted(self.home.glob("venv/lib/python3*/site-packages"))
        return found[0] if found else None

    def available(self) -> str | None:
        ts = self._tsdir()
        if ts is None or not (ts / "pytriton/tritonserver/bin/tritonserver").exists():
            return f"no tritonserver under {self.home} (TRITON_HOME)"
        return None

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        ts = self._tsdir()
        pyenv = self.home / "pyenv" / "bin"
        code = "import sysconfig;print(sysconfig.get_config_var('LIBDIR'))"
        libpy = subprocess.run([str(pyenv / "python"), "-c", code], capture_output=True, text=True).stdout.strip()
        old = env.get("LD_LIBRARY_PATH")
        env["LD_LIBRARY_PATH"] = f"{libpy}:{ts}/nvidia_pytriton.libs" + (f":{old}" if old else "")
        env["PATH"] = f"{pyenv}:{env['PATH']}"
        return env

    def argv(self, flags: list[str]) -> list[str]:
        ts = self._tsdir()
        return [f"{ts}/pytriton/tritonserver/bin/tritonserver", f"--backend-directory={self.home}/backends",
                "--http-address=127.0.0.1", "--grpc-address=127.0.0.1", "--metrics-address=127.0.0.1",
                "--allow-gpu-metrics=false", *flags]


class Running:
    """One server process (its own process group), started with tritonserver flags."""

    def __init__(self, kind: ServerKind, flags: list[str], log: Path, cwd: Path, env: dict[str, str] | None = None):
        self.kind, self.flags, self.log, self.cwd = kind, flags, log, cwd
        self.env = kind.env()
        self.env.update(env or {})
        self.proc: subprocess.Popen | None = None

    def start(self, ready_timeout: float = 60.0, expect_fail: bool = False) -> tuple[bool, str]:
        """(ready, note). Ready = /v2/health/ready answered 200 within the timeout (util.sh run_server)."""
        busy = wait_ports_free()
        if busy:
            return False, f"ports {busy} are in use (another server?)"
        self.log.parent.mkdir(parents=True, exist_ok=True)
        out = open(self.log, "wb")
        argv = self.kind.argv(self.flags)
        out.write(("=== " + " ".join(argv) + "\n").encode())
        out.flush()
        self.proc = subprocess.Popen(argv, cwd=self.cwd, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        out.close()
        deadline = time.monotonic() + ready_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False, f"server exited with status {self.proc.returncode}"
            try:
                with urllib.request.urlopen("http://127.0.0.1:8000/v2/health/ready", timeout=2) as r:
                    if r.status == 200:
                        return True, ""
            except Exception:
                pass
            time.sleep(0.5 if expect_fail else 1.0)
        return False, f"not ready after {ready_timeout:.0f} s"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def wait(self, timeout: float) -> int | None:
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, grace: float = 30.0) -> int | None:
        """SIGTERM the server (as test.sh's `kill`), then SIGKILL its process group after `grace` seconds."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            rc = self.wait(grace)
            if rc is None:
                print(f"    server pid {self.proc.pid} still alive after {grace:.0f} s: SIGKILL", file=sys.stderr)
        self._kill_group()
        return self.proc.returncode

    def _kill_group(self) -> None:
        assert self.proc is not None
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
