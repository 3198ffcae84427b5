"""What backends that run model code in child processes share (the LLM engine core, Python-model
stubs): how a child's end reads in an error message."""

from __future__ import annotations

import signal


def exit_cause(returncode: int) -> str:
    """How a process ended, as an operator reads it: "killed by signal 9 (SIGKILL)", "exited with code 3"."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = "unknown signal"
        return f"killed by signal {-returncode} ({name})"
    return f"exited with code {returncode}"
