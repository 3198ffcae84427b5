"""Poll mode: watch the repositories with watchdog (inotify on Linux) and apply what changed,
after a quiet period so that a folder being copied is read once it is complete; also poll every
--repository-poll-secs in case events are lost (network filesystems send none)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer

from pier.control.manager import RepositoryManager

log = logging.getLogger("pier.watcher")

QUIET_SECONDS = 0.5  # no events for this long -> the change is applied


class _Forward(FileSystemEventHandler):
    def __init__(self, loop: asyncio.AbstractEventLoop, changed: asyncio.Event) -> None:
        self._loop = loop
        self._changed = changed

    def on_any_event(self, event: FileSystemEvent) -> None:
        if event.event_type in ("opened", "closed_no_write"):
            return  # reads (our own fingerprinting included) change nothing
        self._loop.call_soon_threadsafe(self._changed.set)


class RepositoryWatcher:
    def __init__(self, manager: RepositoryManager, repositories: list[Path], period_s: float) -> None:
        self._manager = manager
        self._repositories = repositories
        self._period = max(period_s, 0.1)
        self._changed = asyncio.Event()
        self._observer: Observer | None = None  # type: ignore[valid-type]
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            observer = Observer()
            handler = _Forward(loop, self._changed)
            for repo in self._repositories:
                observer.schedule(handler, str(repo), recursive=True)
            observer.daemon = True
            observer.start()
            self._observer = observer
        except OSError as exc:  # e.g. inotify watch limit: the periodic poll still works
            log.warning("cannot watch the model repositories (%s): polling every %.0fs only", exc, self._period)
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._changed.wait(), self._period)
                # debounce: wait until the repository has been quiet for QUIET_SECONDS
                while True:
                    self._changed.clear()
                    await asyncio.sleep(QUIET_SECONDS)
                    if not self._changed.is_set():
                        break
            except asyncio.TimeoutError:
                pass
            try:
                for error in await self._manager.poll():
                    log.error("%s", error)
            except Exception:  # the watcher must survive anything one poll does
                log.exception("repository poll failed")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._observer is not None:
            self._observer.stop()
            self._observer.join(timeout=2)
