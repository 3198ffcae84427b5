"""Fixtures of the e2e tests that several modules share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.conftest import ROOT, PierProcess, start_pier
from tests.otlp_receiver import OtlpReceiver


@pytest.fixture(scope="module")
def examples(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PierProcess]:
    """The example repository (model_repository/), every model loaded, in explicit mode: a module's
    own server, which its tests may load and unload models on (the status page, the fuzzer)."""
    log = tmp_path_factory.mktemp("examples") / "pier.log"
    server = start_pier([ROOT / "model_repository"], "--model-control-mode=explicit", "--load-model=*",
                        log_path=log, timeout=120)
    yield server
    assert server.stop() == 0, server.log()


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    """A real OTLP/HTTP receiver (tests/otlp_receiver.py) on a free loopback port, one per module:
    the server under test exports its spans to it."""
    r = OtlpReceiver()
    yield r
    r.close()
