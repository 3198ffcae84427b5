"""One child process as pier.ipc's supervisors (supervisor.py, async_supervisor.py) see it: how it
is launched (`Launch`, `spawn`: the one subprocess.Popen of a Pier child), its handle (`Child`:
the pidfd, the start handshake, a race-free kill), the restart budget (`RestartPolicy`,
`RestartBudget`) and what an end means to its owner (`Exit`, `ChildExited`, `StartTimeout`).
Both flavours share these; only the supervisors call `spawn`."""

from __future__ import annotations

import collections
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from pier.ipc.processes import PARENT_ENV

log = logging.getLogger("pier.ipc")


class Link(Protocol):
    """The owner's side of one child's transport (its sockets); closed once the child is gone."""

    def close(self) -> None: ...


L = TypeVar("L", bound=Link)
T = TypeVar("T")
@dataclass(frozen=True)
class Launch:
    """How to run a child: its command, its environment (None: the server's), the socket ends it
    inherits (passed by descriptor and closed here once it runs), and whether it gets a session
    of its own (a terminal's Ctrl-C then does not reach it)."""

    argv: Sequence[str]
    env: Mapping[str, str] | None = None
    inherit: Sequence[socket.socket] = ()
    new_session: bool = False


@dataclass(frozen=True)
class RestartPolicy:
    """At most `limit` restarts within `window_s` seconds (sliding); the first restart in a window
    at once, each later one after `backoff_s`, doubled each time, at most `max_backoff_s`."""

    limit: int
    window_s: float
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0

    def delay(self, restarts: int) -> float:
        """Seconds before a restart that follows `restarts` others within the window."""
        return 0.0 if restarts <= 0 else min(self.backoff_s * 2.0 ** (restarts - 1), self.max_backoff_s)


class RestartBudget:
    """The restarts a policy allows, charged one death at a time."""

    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self._times: collections.deque[float] = collections.deque()

    def recent(self, now: float | None = None) -> int:
        """Restarts within the window that ends now."""
        now = time.monotonic() if now is None else now
        while self._times and now - self._times[0] >= self.policy.window_s:
            self._times.popleft()
        return len(self._times)

    def charge(self, now: float | None = None) -> float | None:
        """One death: the seconds to wait before restarting, or None when the window holds
        `limit` restarts already (the child stays down)."""
        now = time.monotonic() if now is None else now
        restarts = self.recent(now)
        if restarts >= self.policy.limit:
            return None
        self._times.append(now)
        return self.policy.delay(restarts)


class ChildExited(Exception):
    """The child ended before it was ready; `cause` says how (exit_cause)."""

    def __init__(self, cause: str) -> None:
        super().__init__(cause)
        self.cause = cause


class StartTimeout(TimeoutError):
    """The child was not ready within the start timeout (it was killed)."""


_PENDING = object()


_LIVE: dict[Child[Any], None] = {}  # every child spawned and not yet released, in spawn order
_LIVE_LOCK = threading.Lock()
_ENDING = False  # kill_all() has run: the server is exiting now, no child may start
_SCRATCH: set[str] = set()  # the owners' private folders (socket files), removed by kill_all() too
_SCRATCH_LOCK = threading.Lock()  # held while a scratch folder is being removed


# A socket file's path must fit sockaddr_un's sun_path (108 bytes with its NUL): a scratch folder
# leaves this many bytes for the names its owners give their sockets.
SOCKET_NAME_MAX = 32
SUN_PATH_MAX = 107


def scratch_folder(prefix: str) -> str:
    """A private temporary folder for a child's transport (Unix or ZeroMQ ipc:// socket files),
    made with mode 0700 so only this user can connect; its owner removes it (drop_scratch), and
    so does kill_all() when the server cannot wait for the owners. It is made in the temporary
    folder (TMPDIR), or in /tmp where that path is too long for a socket's name under it."""
    parent = tempfile.gettempdir()
    if len(os.path.join(parent, prefix + "x" * 8)) + 1 + SOCKET_NAME_MAX > SUN_PATH_MAX:
        parent = "/tmp"
    path = tempfile.mkdtemp(prefix=prefix, dir=parent)
    with _LIVE_LOCK:
        _SCRATCH.add(path)
    return path


def drop_scratch(path: str) -> None:
    """Remove a scratch folder; it stays listed until it is gone, so that kill_all(), on another
    thread, waits for a removal under way instead of letting the process exit in the middle of it."""
    with _SCRATCH_LOCK:
        shutil.rmtree(path, ignore_errors=True)
        with _LIVE_LOCK:
            _SCRATCH.discard(path)


class Child(Generic[L]):
    """One running process (a restart makes a new one) and the owner's side of its transport."""

    def __init__(self, proc: subprocess.Popen[bytes], link: L, generation: int, name: str = "") -> None:
        self.proc = proc
        self.pid = proc.pid
        self.link = link
        self.generation = generation  # 1 for the first start, then one more per restart
        self.name = name or "child process"  # its supervisor's name
        self.pidfd = os.pidfd_open(proc.pid)
        self._outcome: object = _PENDING
        self._on_settled: Callable[[], None] = lambda: None
        with _LIVE_LOCK:
            _LIVE[self] = None
            if _ENDING:  # spawned while kill_all() ran: it goes too
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)

    # ---- the start handshake: the owner's reading of the child's first answer settles it ----

    def ready(self) -> None:
        """The child is ready to serve."""
        if self._outcome is _PENDING:
            self._outcome = None
            self._on_settled()

    def refuse(self, error: BaseException) -> None:
        """The child said it cannot serve (`error`: why); it is killed and the start fails."""
        if self._outcome is _PENDING:
            self._outcome = error
            self._on_settled()

    @property
    def settled(self) -> bool:
        return self._outcome is not _PENDING

    @property
    def refusal(self) -> BaseException | None:
        return self._outcome if isinstance(self._outcome, BaseException) else None

    # ---- its end ------------------------------------------------------------------------------

    def kill(self) -> None:
        """SIGKILL through the pidfd (never another process that reused the pid)."""
        if self.proc.returncode is None and self.pidfd >= 0:
            try:
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            except ProcessLookupError:  # exited already
                pass

    def reap(self) -> int:
        """Wait for it to end (it has, or was killed) and return its exit status."""
        return self.proc.wait()

    def release(self) -> None:
        """Close the pidfd and the owner's transport (idempotent; after reap)."""
        with _LIVE_LOCK:  # kill_all() signals through the pidfd under this lock
            _LIVE.pop(self, None)
            if self.pidfd >= 0:
                os.close(self.pidfd)
                self.pidfd = -1
        self.link.close()


def running() -> list[str]:
    """The child processes running now, in words ("llm-core (pid 12)"). Any thread."""
    with _LIVE_LOCK:
        return [f"{c.name} (pid {c.pid})" for c in _LIVE if c.proc.returncode is None]


def kill_all(timeout_s: float = 5.0) -> None:
    """SIGKILL every child process still running, whichever supervisor runs it, and wait (up to
    `timeout_s` in all) for each to end, then remove the owners' scratch folders; from then on no
    child starts (a supervisor's restart fails). The server's last act when it must exit now (its
    exit timeout expired with work still running), so that no child outlives it even for the
    moment PR_SET_PDEATHSIG would take, and no socket folder is left. Any thread."""
    global _ENDING
    try:
        with _LIVE_LOCK:
            _ENDING = True
            children = list(_LIVE)
            for child in children:
                try:
                    if child.proc.returncode is None and child.pidfd >= 0:
                        signal.pidfd_send_signal(child.pidfd, signal.SIGKILL)
                except OSError:  # exited already, or its supervisor reaped it and closed the pidfd just now
                    pass
        deadline = time.monotonic() + timeout_s
        for child in children:
            try:
                child.proc.wait(max(0.0, deadline - time.monotonic()))
            except (subprocess.TimeoutExpired, OSError):  # pragma: no cover - SIGKILL is not refused: a D-state child
                pass
    finally:  # the folders go whatever happened above
        with _LIVE_LOCK:
            folders = list(_SCRATCH)
        for folder in folders:
            drop_scratch(folder)


def spawn(launch: Launch, link: L, generation: int = 1, name: str = "") -> Child[L]:
    """Start a child: the only subprocess.Popen of a Pier child process. Raises OSError (the
    inherited socket ends are closed either way; `link` is the caller's to close then)."""
    if _ENDING:
        raise OSError("the server is exiting")
    env = dict(os.environ if launch.env is None else launch.env)
    env[PARENT_ENV] = str(os.getpid())
    try:
        proc = subprocess.Popen(list(launch.argv), pass_fds=[s.fileno() for s in launch.inherit],
                                stdin=subprocess.DEVNULL, env=env, start_new_session=launch.new_session)
    finally:
        for s in launch.inherit:
            s.close()
    try:
        return Child(proc, link, generation, name)
    except OSError:  # pragma: no cover - no pidfd to be had: do not leave it running
        proc.kill()
        proc.wait()
        raise


def call_hook(name: str, hook: Callable[..., T], *args: Any) -> T | None:
    """An owner's hook, run by supervisor `name`: one that raises is logged, and the supervisor goes on."""
    try:
        return hook(*args)
    except Exception:
        log.exception("%s: the owner's %s() failed", name, getattr(hook, "__name__", "hook"))
        return None


def launch_child(launch: Callable[[], tuple[Launch, L]], generation: int, name: str = "") -> Child[L]:
    """Spawn the child an owner's `launch` describes (`name`: its supervisor's); raises what failed
    (its transport closed)."""
    how, link = launch()
    try:
        return spawn(how, link, generation, name)
    except BaseException:
        link.close()
        raise


@dataclass(frozen=True)
class Exit:
    """A child gone, or a start that failed, and what the supervisor does about it."""

    cause: str | None  # how the child that served ended (exit_cause); None when a start failed
    error: BaseException | None  # why the start failed (ChildExited, StartTimeout, the owner's refusal)
    restart_in: float | None  # seconds until the next start; None: not restarted (the budget is spent)
    restarts: int  # restarts within the window before this one
    policy: RestartPolicy
