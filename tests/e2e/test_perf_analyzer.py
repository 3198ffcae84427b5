"""NVIDIA's perf_analyzer (the tool Triton users trust) drives `identity_fp32` over HTTP and
gRPC without errors: it reads metadata, config and statistics and uses binary tensors.

perf_analyzer is installed by `scripts/install_perf_analyzer.sh` (`make perf-analyzer`,
run by CI); set PERF_ANALYZER to its path, else ~/opt/perf-analyzer/perf_analyzer is used."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.frontends  # binary tensors under load, through the frontends

PA = Path(os.environ.get("PERF_ANALYZER", Path.home() / "opt/perf-analyzer/perf_analyzer"))


@pytest.mark.skipif(not PA.exists(), reason=f"perf_analyzer not installed at {PA} (make perf-analyzer)")
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_perf_analyzer_runs(pier, protocol):
    url = pier.http_url if protocol == "http" else pier.grpc_url
    cmd = [str(PA), "-m", "identity_fp32", "-i", protocol, "-u", url, "--shape", "INPUT0:16",
           "--concurrency-range", "2", "-p", "500", "-s", "100", "-r", "4"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "Throughput:" in out and "error" not in out.lower(), out
    assert "Successful request count" in out  # it read our statistics endpoint
