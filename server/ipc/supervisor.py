"""The one place that spawns, watches and restarts Pier's child processes: Python-model stubs
(backends/python/process.py), the LLM engine core (backends/llm/core_client.py), frontend
processes (server/frontends/workers/pool.py; the asyncio flavour, async_supervisor.py), and
whatever comes next (tensor-parallel workers).

A `Supervisor` runs one child at a time for one owner, on a thread of its own:

- spawn: every child is forked from that thread (child.py's `spawn`), which lives as long as it may:
  the child's PR_SET_PDEATHSIG (pier.ipc.processes.die_with_parent) follows the thread that
  forked it, not the process, so a child forked from a short-lived thread would be killed when
  that thread ends. The child learns the server's pid from $PIER_PARENT_PID.
- watch: a pidfd (no pid reuse, no SIGCHLD), polled with the owner's readers (fd -> a callback
  that reads everything there is without blocking); a death is seen at once, and what the child
  sent before it died is read before anything is failed.
- restart: one sliding-window budget with backoff (`RestartPolicy`: at most `limit` restarts in
  `window_s`; the first restart in a window at once, then `backoff_s`, doubling up to
  `max_backoff_s`); past it the child stays down until the owner is made anew (a reload). A
  start that fails counts as a death.
- health: the owner hears of every change (`lost`, `restarted`, `stopped`) and words and reports
  it itself (ModelContext.report_health, a log line): the supervisor decides, the owner speaks.
- stop: the owner asks its child to stop (finalize, a stop command), the supervisor waits up to
  `stop_timeout_s` while still reading what it sends, then kills it (race-free, via the pidfd).

The owner keeps only its transport (socketpair, ZeroMQ) and its protocol, through the hooks of
`ChildOwner`.
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Generic, Protocol, TypeVar

from pier.ipc.child import (
    Child,
    ChildExited,
    Exit,
    L,
    Launch,
    RestartBudget,
    RestartPolicy,
    StartTimeout,
    call_hook,
    launch_child,
)
from pier.ipc.processes import exit_cause

log = logging.getLogger("pier.ipc")
T = TypeVar("T")
Readers = Mapping[int, Callable[[], bool]]
"""fd -> a callback that reads everything there is without blocking (some sources, ZeroMQ's,
signal edges only), and returns False once the source is at its end (it is then forgotten). Each
is also called once when registered, and once more after the child died."""


class ChildOwner(Protocol[L]):
    """What a Supervisor's owner supplies: its transport and its protocol. Every hook runs on the
    supervisor's thread; one that raises is logged and the supervisor goes on."""

    def launch(self) -> tuple[Launch, L]:
        """Make the transport for a new child; its command (raise OSError when it cannot)."""

    def started(self, child: Child[L]) -> Readers:
        """The child runs: send it what it needs to start; the readers while it starts, one of
        which settles the start (`child.ready()`, `child.refuse(error)`)."""

    def serving(self, child: Child[L]) -> Readers:
        """The child is ready (first start or restart): take it into service; what to read from it."""

    def restarted(self, child: Child[L]) -> None:
        """A restart succeeded (after `serving`): say so (health None, a log line)."""

    def lost(self, child: Child[L] | None, end: Exit) -> None:
        """The child that served died (`child`), or a restart failed (`child` None): fail what is
        in flight and say why (`end` tells whether and when it restarts)."""

    def ask_to_stop(self, child: Child[L]) -> None:
        """Ask the child to finish and exit (a finalize or stop message)."""

    def stopped(self, child: Child[L] | None, killed: bool) -> None:
        """stop() is done: fail what is left. `child`: the one that served (None: none was);
        `killed`: it did not exit within the stop timeout."""


SETTLED, EXITED, STOPPING, TIMEOUT = "settled", "exited", "stopping", "timeout"


class Supervisor(Generic[L]):
    """One child for `owner`, started, watched and restarted on a thread of its own (`name`)."""

    def __init__(self, owner: ChildOwner[L], policy: RestartPolicy, name: str, stop_timeout_s: float = 30.0,
                 start_timeout_s: float | None = None) -> None:
        self.name = name
        self.policy = policy
        self.child: Child[L] | None = None  # the one serving now
        self._owner = owner
        self._budget = RestartBudget(policy)
        self._stop_timeout_s = stop_timeout_s
        self._start_timeout_s = start_timeout_s
        self._generation = 0
        self._stopping = threading.Event()
        self._wake_r = self._wake_w = -1  # a pipe, from start() on: stop() wakes the thread's poll
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> Child[L]:
        """Start the first child and wait until it is ready; raises why it could not start (the
        owner's refusal, ChildExited, StartTimeout, OSError), and then nothing is left running."""
        self._wake_r, self._wake_w = os.pipe()
        self._thread.start()
        self._started.wait()
        if self._start_error is not None or self.child is None:
            self._thread.join()
            self._close_wake()
            raise self._start_error or ChildExited("stopped while starting")
        return self.child

    def stop(self, join_timeout_s: float | None = None) -> None:
        """Stop the child (see the module's docstring) and the supervisor; idempotent."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        try:
            os.write(self._wake_w, b"x")
        except OSError:  # closed: it never started, or start() failed
            return
        self._thread.join(join_timeout_s if join_timeout_s is not None else self._stop_timeout_s + 10)
        if not self._thread.is_alive():
            self._close_wake()

    def _close_wake(self) -> None:
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        self._wake_r = self._wake_w = -1

    # ---- the thread ---------------------------------------------------------------------------

    def _hook(self, hook: Callable[..., T], *args: Any) -> T | None:
        return call_hook(self.name, hook, *args)

    def _run(self) -> None:
        try:
            self._supervise()
        finally:
            self._started.set()  # start() never waits for a thread that is gone

    def _supervise(self) -> None:
        first = True
        while True:
            child, error = self._start_child()
            if self._stopping.is_set():
                if child is not None:
                    self._discard(child)
                self._hook(self._owner.stopped, None, False)
                return
            if child is not None:
                readers = self._hook(self._owner.serving, child) or {}
                self.child = child
                if first:
                    first = False
                    self._started.set()
                else:
                    self._hook(self._owner.restarted, child)
                if self._poll(child, readers, wake=True) == STOPPING:
                    self._stop_child(child, readers)
                    return
                self.child = None
                cause: str | None = exit_cause(child.reap())
            elif first:
                self._start_error = error
                return
            else:
                cause = None
            restarts = self._budget.recent()
            delay = self._budget.charge()
            self._hook(self._owner.lost, child, Exit(cause, error, delay, restarts, self.policy))
            if child is not None:
                child.release()
            # down for good (until stop) when the budget is spent, else until the backoff is over
            if self._stopping.wait() if delay is None else self._stopping.wait(delay):
                self._hook(self._owner.stopped, None, False)
                return

    def _start_child(self) -> tuple[Child[L] | None, BaseException | None]:
        """A new child, ready: (child, None); else (None, why) with nothing left running."""
        self._generation += 1
        try:
            child = launch_child(self._owner.launch, self._generation, self.name)
        except Exception as exc:
            return None, exc
        try:
            readers = self._owner.started(child)
        except Exception as exc:
            self._discard(child)
            return None, exc
        deadline = None if self._start_timeout_s is None else time.monotonic() + self._start_timeout_s
        outcome = self._poll(child, readers, wake=True, handshake=True, deadline=deadline)
        if outcome == SETTLED and child.refusal is None:
            return child, None
        error: BaseException | None = None
        if outcome == SETTLED:
            error = child.refusal
        elif outcome == EXITED:
            error = ChildExited(exit_cause(child.reap()))
        elif outcome == TIMEOUT:
            error = StartTimeout(f"not ready within {self._start_timeout_s:g} s")
        self._discard(child)
        return None, error

    def _poll(self, child: Child[L], readers: Readers, wake: bool, handshake: bool = False,
              deadline: float | None = None) -> str:
        """Serve `readers` until the child exits (they are read once more: what it sent before it
        died still counts), a stop is asked (`wake`), the start settles (`handshake`) or `deadline`."""
        poller = select.poll()
        poller.register(child.pidfd, select.POLLIN)
        if wake:
            poller.register(self._wake_r, select.POLLIN)
        live = dict(readers)
        for fd in live:
            poller.register(fd, select.POLLIN)
        for fd in list(live):
            self._read(live, fd, poller)
        while True:
            if handshake and child.settled:
                return SETTLED
            timeout = None
            if deadline is not None:
                timeout = max(0.0, deadline - time.monotonic()) * 1000
                if timeout <= 0:
                    return TIMEOUT
            exited = stopping = False
            for fd, _ in poller.poll(timeout):
                if fd == child.pidfd:
                    exited = True
                elif fd == self._wake_r:
                    stopping = True
                elif fd in live:
                    self._read(live, fd, poller)
            if exited:  # what it sent before it ended may settle its start yet (a refusal, say)
                for fd in list(live):
                    self._read(live, fd, poller)
                return SETTLED if handshake and child.settled else EXITED
            if handshake and child.settled:
                return SETTLED
            if stopping:
                return STOPPING

    def _read(self, live: dict[int, Callable[[], bool]], fd: int, poller: select.poll) -> None:
        try:
            more = live[fd]()
        except Exception:  # a message this side cannot handle must not stop the supervisor
            log.exception("%s: reading from the child failed", self.name)
            more = True
        if not more:
            poller.unregister(fd)
            del live[fd]

    def _stop_child(self, child: Child[L], readers: Readers) -> None:
        self._hook(self._owner.ask_to_stop, child)
        outcome = self._poll(child, readers, wake=False, deadline=time.monotonic() + self._stop_timeout_s)
        killed = outcome != EXITED
        if killed:
            child.kill()
        child.reap()
        self.child = None
        self._hook(self._owner.stopped, child, killed)
        child.release()

    def _discard(self, child: Child[L]) -> None:
        """A child that never served: make sure it is gone, reaped, and its transport closed."""
        child.kill()
        child.reap()
        child.release()
