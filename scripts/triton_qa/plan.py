"""What a suite runs: groups of cases that share one server start (flags + repository), as its test.sh does."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Result:
    suite: str
    case: str
    status: str  # PASS | FAIL | SKIP
    detail: str = ""
    seconds: float = 0.0


@dataclass
class Unit:
    """`python FILE ARGS...` (unittest, as test.sh runs it): one case per test the file runs.
    `expect` lists the test ids ("Class.test") test.sh counts on; missing ones are failures."""

    file: str
    args: list[str] = field(default_factory=list)
    expect: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    suffix: str = ""
    timeout: float = 600.0


@dataclass
class Pytest:
    """`python -m pytest FILE::SEL ...` (as test.sh runs it): one case per collected test."""

    file: str
    selectors: list[str] = field(default_factory=list)
    expect_min: int = 1
    env: dict[str, str] = field(default_factory=dict)
    suffix: str = ""
    timeout: float = 600.0
    case_timeout: float = 120.0


@dataclass
class Script:
    """A client example: pass = exit status (0, or non-zero when `expect_rc0` is False) and the output checks
    test.sh makes: `grep_eq` {pattern: exact count}, `grep_min` {pattern: minimum count}."""

    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    expect_rc0: bool = True
    grep_eq: dict[str, int] = field(default_factory=dict)
    grep_min: dict[str, int] = field(default_factory=dict)
    server_log_min: dict[str, int] = field(default_factory=dict)
    timeout: float = 180.0


@dataclass
class Check:
    """A check test.sh makes itself (curl, log greps): fn(ctx) returns None when it passes, else the reason."""

    name: str
    fn: Callable[..., str | None]


@dataclass
class Skip:
    name: str
    reason: str


@dataclass
class Group:
    """One server start. `flags` are tritonserver's (`--model-repository=...` included). With `expect_start_failure`
    the group is one case: the server must fail to start and its log must hold that message once.
    `after_stop` checks run once the server has been stopped (e.g. on its log); `server_exit_zero` makes a
    non-zero exit status on SIGTERM a failure of every case of the group (L0_shared_memory)."""

    cwd: Path
    flags: list[str]
    steps: list[Unit | Pytest | Script | Check | Skip]
    env: dict[str, str] = field(default_factory=dict)
    label: str = ""
    expect_start_failure: str | None = None
    after_stop: list[Check] = field(default_factory=list)
    server_exit_zero: bool = False
    no_server: bool = False
    server_pid_env: bool = False
    wait_server_exit: bool = False
    server_log_env: bool = False
    prepare: Callable[..., None] | None = None
