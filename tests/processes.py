"""Process trees read from /proc, for the tests and the fault campaign (bench/chaos.py): which
processes a server started, and which of them still run."""

from __future__ import annotations

import os
from pathlib import Path


def descendants(pid: int) -> set[int]:
    """Every process below `pid` (children, theirs, ...), read from /proc: a server's stubs, LLM
    engine core and frontend processes are its children, each forked from one of its threads."""
    found: set[int] = set()
    todo = [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:  # it ended meanwhile
            continue
        for task in tasks:
            try:
                children = Path(f"/proc/{parent}/task/{task}/children").read_text().split()
            except OSError:
                continue
            for child in map(int, children):
                if child not in found:
                    found.add(child)
                    todo.append(child)
    return found


def alive(pids: set[int]) -> set[int]:
    """Those of `pids` that still run (a zombie has ended)."""
    running = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0]
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if state != "Z":
            running.add(pid)
    return running
