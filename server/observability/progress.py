"""Load progress as a person watching the server sees it: a bar per load on a terminal (tqdm,
redrawn in place), else one log line per step (each shard of weights), so that a log read later,
or by an orchestrator, tells "loading 7/12 shards" from "stuck". The model's state reason says the
same (pier.lifecycle.lifecycle); this is only the display. Runs on the event loop."""

from __future__ import annotations

import logging
import shutil
import sys
from typing import Any

from pier.contract.backend import LoadProgress
from pier.observability import log_settings

log = logging.getLogger("pier.repository")


class LoadProgressView:
    def __init__(self, tty: bool | None = None) -> None:
        """`tty`: draw bars (default: when the log goes to a terminal, stderr, not to --log-file)."""
        self._tty = sys.stderr.isatty() and not log_settings.current().log_file if tty is None else tty
        self._bars: dict[str, tuple[str, Any]] = {}  # load -> (stage, its tqdm bar)
        self._said: dict[str, tuple[str, int]] = {}  # load -> the (stage, step) last logged

    def update(self, load: str, progress: LoadProgress) -> None:
        """`load` ("'llama' version 1") has come this far."""
        step = (progress.stage, progress.done)
        if self._tty and progress.total:
            self._draw(load, progress)
        elif self._said.get(load) != step:
            self._close(load)  # a bar of an earlier stage ends before a line of this one
            log.info("%s: %s", load, progress)
        self._said[load] = step

    def finish(self, load: str) -> None:
        """The load ended (loaded or failed: the life cycle says which)."""
        self._close(load)
        self._said.pop(load, None)

    def _draw(self, load: str, progress: LoadProgress) -> None:
        from tqdm import tqdm

        stage, bar = self._bars.get(load, ("", None))
        if bar is None or stage != progress.stage:
            self._close(load)
            counted = progress.bytes_total or progress.total
            bar = tqdm(total=counted, desc=f"{load}: {progress.stage}", unit="B" if progress.bytes_total else "",
                       unit_scale=bool(progress.bytes_total), unit_divisor=1024, file=sys.stderr, leave=True,
                       ncols=shutil.get_terminal_size((100, 24)).columns)  # a terminal of 0 columns: 100
            self._bars[load] = (progress.stage, bar)
        bar.n = progress.bytes_done if progress.bytes_total else progress.done
        bar.set_postfix_str(f"{progress.done}/{progress.total} {progress.unit}", refresh=False)
        bar.refresh()

    def _close(self, load: str) -> None:
        _, bar = self._bars.pop(load, ("", None))
        if bar is not None:
            bar.close()
