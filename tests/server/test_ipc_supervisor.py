"""pier.ipc.supervisor and its asyncio flavour, with a tiny real child process (a few lines of
Python on a SOCK_SEQPACKET socketpair): a death is seen at once, what the child sent before it
died is read before its loss is reported, restarts follow one sliding-window budget with backoff
in both flavours, a start that is refused or dies fails with its reason and leaves nothing
running, stop asks and then kills, and a child dies with the process that started it."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from pier.ipc.async_supervisor import AsyncSupervisor
from pier.ipc.child import Child, ChildExited, Exit, Launch, RestartBudget, RestartPolicy, StartTimeout
from pier.ipc.supervisor import Readers, Supervisor

CHILD = r'''
import os, socket, sys, time
from pier.ipc.processes import die_with_parent
die_with_parent()
sock = socket.socket(fileno=int(sys.argv[1]))
mode = sys.argv[2]
if mode == "refuse":
    sock.send(b"no: the weights are missing")
    time.sleep(60)
if mode == "die":
    os._exit(4)
if mode == "mute":  # alive (past die_with_parent), never ready
    sock.send(b"waiting")
    time.sleep(60)
sock.send(b"ready %d" % os.getppid())
while True:
    msg = sock.recv(100)
    if not msg:
        os._exit(0)
    if msg.startswith(b"exit"):
        sock.send(b"last words")
        os._exit(int(msg[5:]))
    if msg == b"stop" and mode != "stubborn":
        os._exit(0)
    sock.send(b"echo " + msg)
'''


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


class _Link:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def close(self) -> None:
        self.sock.close()


class _Toy:
    """An owner: records every hook with the time it ran; `mode` is what the next child does."""

    def __init__(self, mode: str = "serve") -> None:
        self.mode = mode
        self.events: list[tuple[float, str, Any]] = []
        self.changed = threading.Condition()

    def note(self, kind: str, detail: Any = None) -> None:
        with self.changed:
            self.events.append((time.monotonic(), kind, detail))
            self.changed.notify_all()

    def wait_for(self, count: int, kind: str, timeout: float = 20) -> list[tuple[float, str, Any]]:
        with self.changed:
            assert self.changed.wait_for(lambda: len(self.of(kind)) >= count, timeout), self.events
            return self.of(kind)

    def of(self, kind: str) -> list[tuple[float, str, Any]]:
        return [e for e in self.events if e[1] == kind]

    def launch(self) -> tuple[Launch, _Link]:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        return Launch([sys.executable, "-c", CHILD, str(theirs.fileno()), self.mode], inherit=[theirs]), _Link(ours)

    def read(self, child: Child[_Link]) -> bool:
        """Everything the child sent, without blocking; False at its end."""
        while True:
            try:
                data = child.link.sock.recv(100, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return True
            except OSError:
                return False
            if not data:
                return False
            if data.startswith(b"ready"):
                child.ready()
            elif data.startswith(b"no:"):
                child.refuse(RuntimeError(data.decode()))
            else:
                self.note("got", data.decode())

    def started(self, child: Child[_Link]) -> Readers:
        self.note("started", child.pid)
        return {child.link.sock.fileno(): lambda: self.read(child)}

    def serving(self, child: Child[_Link]) -> Readers:
        self.note("serving", child.pid)
        return {child.link.sock.fileno(): lambda: self.read(child)}

    def restarted(self, child: Child[_Link]) -> None:
        self.note("restarted", child.pid)

    def lost(self, child: Child[_Link] | None, end: Exit) -> None:
        self.note("lost", end)

    def ask_to_stop(self, child: Child[_Link]) -> None:
        child.link.sock.send(b"stop")

    def stopped(self, child: Child[_Link] | None, killed: bool) -> None:
        self.note("stopped", (child.pid if child else None, killed))


class _AsyncToy(_Toy):
    """The same owner for the asyncio flavour: it reads its socket on the loop itself."""

    def started(self, child: Child[_Link]) -> Readers:
        self.note("started", child.pid)
        asyncio.get_running_loop().add_reader(child.link.sock.fileno(), self._on_loop, child)
        return {}

    def _on_loop(self, child: Child[_Link]) -> None:
        if not self.read(child):
            asyncio.get_running_loop().remove_reader(child.link.sock.fileno())

    def serving(self, child: Child[_Link]) -> Readers:
        self.note("serving", child.pid)
        return {}

    def drain(self, child: Child[_Link]) -> None:
        asyncio.get_running_loop().remove_reader(child.link.sock.fileno())
        self.read(child)


POLICY = RestartPolicy(limit=2, window_s=60, backoff_s=0.4, max_backoff_s=5)


def test_the_budget_slides_and_backs_off() -> None:
    budget = RestartBudget(RestartPolicy(limit=3, window_s=10, backoff_s=1, max_backoff_s=1.5))
    assert [budget.charge(now=t) for t in (0, 1, 2)] == [0.0, 1.0, 1.5]  # doubling, capped
    assert budget.charge(now=3) is None and budget.recent(now=3) == 3  # spent
    assert budget.charge(now=10.5) == 1.5  # the first restart left the window: one more, after two others
    assert RestartBudget(RestartPolicy(limit=0, window_s=10)).charge(now=0) is None


def test_a_death_is_seen_at_once_its_last_words_read_first_then_it_restarts() -> None:
    toy = _Toy()
    sup = Supervisor(toy, POLICY, "toy")
    first = sup.start()
    try:
        assert toy.of("serving")[0][2] == first.pid and _alive(first.pid)
        first.link.sock.send(b"exit 3")
        (lost,) = toy.wait_for(1, "lost")
        end = lost[2]
        assert end.cause == "exited with code 3" and end.restart_in == 0.0 and end.restarts == 0
        got = [e for e in toy.events if e[1] in ("got", "lost")]
        assert got[0][1:] == ("got", "last words")  # read before the loss was reported
        (restarted,) = toy.wait_for(1, "restarted")
        assert sup.child is not None and sup.child.pid == restarted[2] != first.pid
        os.kill(restarted[2], signal.SIGKILL)
        lost2 = toy.wait_for(2, "lost")[1]
        assert lost2[2].cause == "killed by signal 9 (SIGKILL)" and lost2[0] - lost[0] < 10
    finally:
        sup.stop()
    assert not _alive(first.pid)


@pytest.mark.parametrize("flavour", ["thread", "asyncio"])
def test_restarts_back_off_then_the_budget_is_spent(flavour: str) -> None:
    """Both flavours: the first restart at once, the second after backoff_s, then no more."""
    toy = _Toy() if flavour == "thread" else _AsyncToy()

    def kill_three_times(child: Child[_Link], sup: Any) -> None:
        for n in range(1, 4):
            os.kill(sup.child.pid, signal.SIGKILL)
            toy.wait_for(n, "lost")
            if n < 3:
                toy.wait_for(n, "restarted")

    if flavour == "thread":
        sup: Any = Supervisor(toy, POLICY, "toy")
        kill_three_times(sup.start(), sup)
        sup.stop()
    else:
        async def main() -> None:
            asup = AsyncSupervisor(toy, POLICY, "toy", start_timeout_s=20)
            child = await asup.start()
            await asyncio.get_running_loop().run_in_executor(None, kill_three_times, child, asup)
            await asup.stop()
        asyncio.run(main())
    lost, restarted = toy.of("lost"), toy.of("restarted")
    assert [e[2].restart_in for e in lost] == [0.0, 0.4, None]
    assert [e[2].restarts for e in lost] == [0, 1, 2]
    assert restarted[0][0] - lost[0][0] < 0.4 + 5  # at once (a start takes a Python's start-up)
    assert restarted[1][0] - lost[1][0] >= 0.4  # after the backoff
    assert toy.of("stopped")[-1][2] == (None, False)  # down: nothing left to stop


def test_a_refused_dying_or_silent_start_fails_with_its_reason_and_leaves_nothing() -> None:
    for mode, error, text in (("refuse", RuntimeError, "no: the weights are missing"),
                              ("die", ChildExited, "exited with code 4"),
                              ("mute", StartTimeout, "not ready within 1 s")):
        toy = _Toy(mode)
        with pytest.raises(error, match=text):
            Supervisor(toy, POLICY, "toy", start_timeout_s=1).start()
        (started,) = toy.of("started")
        assert not _alive(started[2]) and not toy.of("lost")


def test_a_restart_that_fails_counts_as_a_death() -> None:
    toy = _Toy()
    sup = Supervisor(toy, POLICY, "toy")
    child = sup.start()
    toy.mode = "refuse"
    try:
        child.link.sock.send(b"exit 0")
        lost = toy.wait_for(3, "lost")
        assert [e[2].restart_in for e in lost] == [0.0, 0.4, None]
        assert lost[1][2].cause is None and "weights are missing" in str(lost[1][2].error)
    finally:
        sup.stop()
    assert not any(_alive(e[2]) for e in toy.of("started"))


@pytest.mark.parametrize("mode,killed", [("serve", False), ("stubborn", True)])
def test_stop_asks_then_kills(mode: str, killed: bool) -> None:
    toy = _Toy(mode)
    sup = Supervisor(toy, POLICY, "toy", stop_timeout_s=1)
    child = sup.start()
    began = time.monotonic()
    sup.stop()
    assert toy.of("stopped")[0][2] == (child.pid, killed) and not _alive(child.pid)
    assert (time.monotonic() - began >= 1) == killed
    assert child.pidfd == -1 and child.link.sock.fileno() == -1  # released


def test_the_asyncio_flavour_stops_and_fails_a_refused_start() -> None:
    async def main() -> None:
        toy = _AsyncToy()
        sup = AsyncSupervisor(toy, POLICY, "toy", start_timeout_s=20, stop_timeout_s=1)
        child = await sup.start()
        await sup.stop()
        assert toy.of("stopped")[0][2] == (child.pid, False) and not _alive(child.pid)
        refused = _AsyncToy("refuse")
        with pytest.raises(RuntimeError, match="weights are missing"):
            await AsyncSupervisor(refused, POLICY, "toy", start_timeout_s=20).start()
        assert not _alive(refused.of("started")[0][2])

    asyncio.run(main())


def test_a_child_dies_with_the_process_that_started_it(tmp_path: Path) -> None:
    """PR_SET_PDEATHSIG from die_with_parent: kill -9 of the parent takes the child with it (no
    polling thread in the child, no end-of-file needed: it never reads its socket here)."""
    script = tmp_path / "parent.py"
    script.write_text(
        "import sys, time\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from test_ipc_supervisor import _Toy, POLICY\n"
        "from pier.ipc.supervisor import Supervisor\n"
        "toy = _Toy('mute')\n"  # never ready: the start waits, the child sleeps
        "import threading\n"
        "threading.Thread(target=lambda: Supervisor(toy, POLICY, 'toy').start(), daemon=True).start()\n"
        "while not toy.of('got'):\n"  # past die_with_parent
        "    time.sleep(0.01)\n"
        "print(toy.of('started')[0][2], flush=True)\n"
        "time.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert _alive(child)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 5
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not _alive(child)
    finally:
        parent.kill()


def test_a_scratch_folder_leaves_room_for_socket_names_under_a_long_tmpdir(tmp_path: Path, monkeypatch) -> None:
    """A TMPDIR too long for a socket's path under it: the scratch folder is made in /tmp instead,
    and a socket with the longest name it promises binds there."""
    import tempfile

    from pier.ipc.child import SOCKET_NAME_MAX, drop_scratch, scratch_folder

    deep = tmp_path / ("d" * 60)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    short = scratch_folder("pier-x-")
    try:
        assert Path(short).parent == Path("/tmp")
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(os.path.join(short, "n" * SOCKET_NAME_MAX))
    finally:
        drop_scratch(short)
    roomy = tempfile.mkdtemp(dir="/tmp")  # short enough: TMPDIR is kept
    monkeypatch.setattr(tempfile, "tempdir", roomy)
    kept = scratch_folder("pier-x-")
    try:
        assert Path(kept).parent == Path(roomy)
    finally:
        drop_scratch(kept)
        os.rmdir(roomy)
