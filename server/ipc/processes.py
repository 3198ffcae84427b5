"""Both ends of a supervised child process, in words and in the kernel: how its end reads in an
error message (`exit_cause`, the parent's side) and how a child ties its life to the server's
(`die_with_parent`, called first thing by every child's entry point: the Python stub, the LLM
engine core, the frontend worker). Kept free of heavy imports: a stub running in a model's
packed environment imports it."""

from __future__ import annotations

import ctypes
import os
import signal
from collections.abc import Iterable

PARENT_ENV = "PIER_PARENT_PID"  # set by pier.ipc.supervisor.spawn: the pid of the server that started it
_PR_SET_PDEATHSIG = 1


def exit_cause(returncode: int) -> str:
    """How a process ended, as an operator reads it: "killed by signal 9 (SIGKILL)", "exited with code 3"."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = "unknown signal"
        return f"killed by signal {-returncode} ({name})"
    return f"exited with code {returncode}"


def die_with_parent(ignore: Iterable[signal.Signals] = (signal.SIGINT, signal.SIGTERM),
                    oom_score_adj: int = 0) -> None:
    """Tie this child's life to the server that started it, then set its signal policy.

    - PR_SET_PDEATHSIG(SIGKILL): the kernel kills this process when the server's *thread* that
      forked it ends, which is why pier.ipc.supervisor forks every child from a thread that lives
      as long as the child may; then the parent pid is checked once against $PIER_PARENT_PID, as
      the server may have died before the prctl took effect. No polling thread.
    - `ignore`: signals this process does not act on (by default SIGINT and SIGTERM: a Ctrl-C or
      a process-group SIGTERM reaches the server, which drains and then stops its children).
    - `oom_score_adj`: added to this process's OOM score (raising it needs no privilege), so
      that when memory runs out the kernel picks this child (restarted) before the server.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # pragma: no cover - not Linux: end-of-file on its channel still ends it
        pass
    parent = os.environ.get(PARENT_ENV, "")
    if parent.isdigit() and os.getppid() != int(parent):  # the server died before prctl took effect
        os._exit(1)
    for sig in ignore:
        signal.signal(sig, signal.SIG_IGN)
    if oom_score_adj:
        try:
            path = "/proc/self/oom_score_adj"
            with open(path) as fh:
                current = int(fh.read().strip() or 0)
            with open(path, "w") as fh:
                fh.write(str(max(-1000, min(1000, current + oom_score_adj))))
        except (OSError, ValueError):
            pass
