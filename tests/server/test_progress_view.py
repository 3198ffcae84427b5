"""What a person watching the server sees of a long load (server/observability/progress.py): on a
terminal a bar (tqdm) that counts the bytes and says the shards, a stage without counts as a line;
elsewhere one log line per step."""

from __future__ import annotations

import logging

import pytest

from pier.contract.backend import LoadProgress
from pier.observability.progress import LoadProgressView

STEPS = [LoadProgress("loading weights", i, 2, i << 29, 1 << 30) for i in range(3)]


def test_a_terminal_gets_a_bar_and_no_log_lines(capsys: pytest.CaptureFixture[str],
                                                caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="pier.repository")
    view = LoadProgressView(tty=True)
    for step in STEPS:
        view.update("'llm' version 1", step)
    view.update("'llm' version 1", LoadProgress("building the CPU kernels"))  # not counted: a line
    view.finish("'llm' version 1")
    err = capsys.readouterr().err
    assert "'llm' version 1: loading weights" in err and "2/2 shards" in err and "1.00G/1.00G" in err
    assert [r.getMessage() for r in caplog.records] == ["'llm' version 1: building the CPU kernels"]


def test_a_log_gets_one_line_per_step(capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="pier.repository")
    view = LoadProgressView(tty=False)
    for step in (STEPS[0], STEPS[1], LoadProgress("loading weights", 1, 2, 600 << 20, 1 << 30), STEPS[2]):
        view.update("'llm' version 1", step)  # the third is within shard 2: no line of its own
    view.finish("'llm' version 1")
    assert [r.getMessage() for r in caplog.records] == [
        "'llm' version 1: loading weights: 0/2 shards, 0.0/1.0 GB",
        "'llm' version 1: loading weights: 1/2 shards, 0.5/1.0 GB",
        "'llm' version 1: loading weights: 2/2 shards, 1.0/1.0 GB"]
    assert capsys.readouterr().err == ""
