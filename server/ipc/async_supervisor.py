"""The asyncio flavour of pier.ipc.supervisor.Supervisor, for an owner whose transport the event
loop reads (the frontend pool: its channels are `loop.add_reader` sockets). Same budget, backoff,
hooks and wording of events; the pidfd is watched with `loop.add_reader`, so a death is seen at
once without a thread, and children are forked from the loop's thread (the server's main thread,
which lives as long as they may: PR_SET_PDEATHSIG holds)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
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

T = TypeVar("T")


class AsyncChildOwner(Protocol[L]):
    """ChildOwner's hooks for the asyncio flavour; each runs on the loop. The owner reads its
    transport on the loop itself; `drain` reads what is left when the child is gone."""

    def launch(self) -> tuple[Launch, L]:
        """Make the transport for a new child; its command (raise OSError when it cannot)."""

    def started(self, child: Child[L]) -> None:
        """The child runs: send it what it needs; its first answer settles the start
        (`child.ready()`, `child.refuse(error)`)."""

    def serving(self, child: Child[L]) -> None:
        """The child is ready (first start or restart): take it into service."""

    def drain(self, child: Child[L]) -> None:
        """The child is gone: read what it sent before it went."""

    def restarted(self, child: Child[L]) -> None:
        """A restart succeeded (after `serving`)."""

    def lost(self, child: Child[L] | None, end: Exit) -> None:
        """The child that served died (`child`), or a restart failed (`child` None)."""

    def ask_to_stop(self, child: Child[L]) -> None:
        """Ask the child to finish and exit."""

    def stopped(self, child: Child[L] | None, killed: bool) -> None:
        """stop() is done (`killed`: the child did not exit within the stop timeout)."""


class AsyncSupervisor(Generic[L]):
    """One child for `owner`, on the running event loop."""

    def __init__(self, owner: AsyncChildOwner[L], policy: RestartPolicy, name: str,
                 start_timeout_s: float | None = None, stop_timeout_s: float = 30.0) -> None:
        self.name = name
        self.policy = policy
        self.child: Child[L] | None = None
        self._owner = owner
        self._budget = RestartBudget(policy)
        self._start_timeout_s = start_timeout_s
        self._stop_timeout_s = stop_timeout_s
        self._generation = 0
        self._stopping = False
        self._stop_asked: asyncio.Event | None = None
        self._restart: asyncio.Task[None] | None = None

    async def start(self) -> Child[L]:
        """Start the first child and wait until it is ready; raises why it could not."""
        self._stop_asked = asyncio.Event()
        child, error = await self._start_child()
        if child is None:
            raise error or ChildExited("stopped while starting")
        self._serve(child)
        return child

    async def stop(self) -> None:
        """Ask the child to stop, wait up to the stop timeout, then kill it; idempotent."""
        if self._stopping:
            return
        self._stopping = True
        if self._stop_asked is not None:
            self._stop_asked.set()
        if self._restart is not None:
            await self._restart  # it returns at once: it waits for the backoff or a start with the stop in view
        child, self.child = self.child, None
        if child is None:
            self._hook(self._owner.stopped, None, False)
            return
        loop = asyncio.get_running_loop()
        loop.remove_reader(child.pidfd)
        exited = self._watch(child)
        self._hook(self._owner.ask_to_stop, child)
        killed = False
        try:
            await asyncio.wait_for(asyncio.shield(exited), self._stop_timeout_s)
        except asyncio.TimeoutError:
            killed = True
            child.kill()
            await exited
        finally:
            loop.remove_reader(child.pidfd)
        child.reap()
        self._hook(self._owner.drain, child)
        self._hook(self._owner.stopped, child, killed)
        child.release()

    # ---- the loop's side ----------------------------------------------------------------------

    def _hook(self, hook: Callable[..., T], *args: Any) -> T | None:
        return call_hook(self.name, hook, *args)

    def _watch(self, child: Child[L]) -> asyncio.Future[None]:
        """A future done when `child` has exited (its pidfd readable)."""
        loop = asyncio.get_running_loop()
        exited: asyncio.Future[None] = loop.create_future()

        def readable() -> None:
            loop.remove_reader(child.pidfd)
            if not exited.done():
                exited.set_result(None)

        loop.add_reader(child.pidfd, readable)
        return exited

    def _serve(self, child: Child[L]) -> None:
        self._hook(self._owner.serving, child)
        self.child = child
        self._watch(child).add_done_callback(lambda _: self._exited(child))

    def _exited(self, child: Child[L]) -> None:
        if self.child is not child:  # stop() took it over
            return
        self.child = None
        self._hook(self._owner.drain, child)
        self._down(child, exit_cause(child.reap()), None)

    def _down(self, child: Child[L] | None, cause: str | None, error: BaseException | None) -> None:
        restarts = self._budget.recent()
        delay = self._budget.charge()
        self._hook(self._owner.lost, child, Exit(cause, error, delay, restarts, self.policy))
        if child is not None:
            child.release()
        if delay is not None and not self._stopping:
            self._restart = asyncio.get_running_loop().create_task(self._restart_after(delay))

    async def _restart_after(self, delay: float) -> None:
        assert self._stop_asked is not None
        if delay > 0:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stop_asked.wait(), delay)
        if self._stopping:
            return
        child, error = await self._start_child()
        if self._stopping:  # _start_child let go of a child it started meanwhile
            return
        if child is None:
            self._down(None, None, error)
            return
        self._serve(child)
        self._hook(self._owner.restarted, child)

    async def _start_child(self) -> tuple[Child[L] | None, BaseException | None]:
        """A new child, ready: (child, None); else (None, why) with nothing left running."""
        assert self._stop_asked is not None
        self._generation += 1
        try:
            child = launch_child(self._owner.launch, self._generation, self.name)
        except Exception as exc:
            return None, exc
        loop = asyncio.get_running_loop()
        settled: asyncio.Future[None] = loop.create_future()

        def settle() -> None:
            if not settled.done():
                settled.set_result(None)

        child._on_settled = settle
        exited = self._watch(child)
        stop: asyncio.Future[Any] = asyncio.ensure_future(self._stop_asked.wait())
        error: BaseException | None = None
        try:
            self._owner.started(child)
            await asyncio.wait([settled, exited, stop], timeout=self._start_timeout_s,
                               return_when=asyncio.FIRST_COMPLETED)
        except Exception as exc:
            error = exc
        finally:
            loop.remove_reader(child.pidfd)
            stop.cancel()
        if error is None and exited.done() and not settled.done():
            self._hook(self._owner.drain, child)  # what it sent before it ended may settle its start yet
        if error is None and settled.done() and child.refusal is None and not self._stopping:
            return child, None
        if error is None and settled.done():
            error = child.refusal
        elif error is None and exited.done():
            error = ChildExited(exit_cause(child.reap()))
        elif error is None and not self._stopping:
            error = StartTimeout(f"not ready within {self._start_timeout_s:g} s")
        child.kill()
        if not exited.done():
            await loop.run_in_executor(None, child.reap)
        child.reap()
        child.release()
        return None, error

