"""The TorchScript example against its ONNX twin through a real `pier serve`, over tritonclient
HTTP and gRPC: the same answers (and the numpy reference's) for batch 1, a request carrying a
batch, concurrent requests the dynamic batcher merges, and an unbatched configuration. Also: a
server whose Python cannot import torch still serves everything else and says why the
TorchScript model failed, and a TorchScript file without a config says the config must list
its tensors."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from scripts.build_torch_examples import mlp_reference
from tests.conftest import EXAMPLE_REPO, ROOT, PierProcess, free_port, start_pier

PROTOCOLS = [(httpclient, "http_url"), (grpcclient, "grpc_url")]
TOL = {"rtol": 1e-5, "atol": 1e-5}


def _variant(repo: Path, source: str, name: str, edit) -> None:
    shutil.copytree(EXAMPLE_REPO / source, repo / name)
    config = (repo / name / "config.pbtxt").read_text().replace(f'name: "{source}"', f'name: "{name}"')
    (repo / name / "config.pbtxt").write_text(edit(config))


def _unbatched(config: str) -> str:
    config = config.replace("max_batch_size: 8", "max_batch_size: 0").replace("dims: [ 4 ]", "dims: [ -1, 4 ]")
    config = config.replace("dims: [ 3 ]", "dims: [ -1, 3 ]")
    return "\n".join(line for line in config.splitlines() if not line.startswith("dynamic_batching")) + "\n"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    for name in ("mlp_torchscript", "mlp_onnx"):
        shutil.copytree(EXAMPLE_REPO / name, repo / name)
        _variant(repo, name, f"{name}_unbatched", _unbatched)
    # Waits up to 1 s for a full batch of 8 rows, so 8 concurrent requests form one execution.
    _variant(repo, "mlp_torchscript", "mlp_torchscript_wait",
             lambda c: c.replace("max_queue_delay_microseconds: 1000", "max_queue_delay_microseconds: 1000000"))
    s = start_pier([repo], log_path=tmp_path_factory.mktemp("log") / "pier.log")
    yield s
    assert s.stop() == 0, s.log()


def _infer(module, url: str, model: str, x: np.ndarray) -> np.ndarray:
    client = module.InferenceServerClient(url)
    inp = module.InferInput("INPUT__0", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return client.infer(model, [inp], outputs=[module.InferRequestedOutput("OUTPUT__0")]).as_numpy("OUTPUT__0")


def _rows(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 4)).astype(np.float32)


@pytest.mark.parametrize("module,attr", PROTOCOLS, ids=["http", "grpc"])
@pytest.mark.parametrize("batch", [1, 5])
def test_torchscript_and_onnx_agree(server, module, attr, batch):
    x = _rows(batch, batch)
    torchscript = _infer(module, getattr(server, attr), "mlp_torchscript", x)
    onnx = _infer(module, getattr(server, attr), "mlp_onnx", x)
    assert torchscript.shape == onnx.shape == (batch, 3) and torchscript.dtype == np.float32
    np.testing.assert_allclose(torchscript, onnx, **TOL)
    np.testing.assert_allclose(torchscript, mlp_reference(x), **TOL)


@pytest.mark.parametrize("module,attr", PROTOCOLS, ids=["http", "grpc"])
def test_unbatched_configuration(server, module, attr):
    x = _rows(3, 7)
    torchscript = _infer(module, getattr(server, attr), "mlp_torchscript_unbatched", x)
    onnx = _infer(module, getattr(server, attr), "mlp_onnx_unbatched", x)
    np.testing.assert_allclose(torchscript, onnx, **TOL)
    np.testing.assert_allclose(torchscript, mlp_reference(x), **TOL)


@pytest.mark.parametrize("module,attr", PROTOCOLS, ids=["http", "grpc"])
def test_concurrent_requests_are_batched(server, module, attr):
    url = getattr(server, attr)
    stats = httpclient.InferenceServerClient(server.http_url)

    def counts() -> tuple[int, int]:
        s = stats.get_inference_statistics("mlp_torchscript_wait")["model_stats"][0]
        return int(s.get("inference_count", 0)), int(s.get("execution_count", 0))

    before = counts()
    rows = _rows(8, 11)
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda i: _infer(module, url, "mlp_torchscript_wait", rows[i:i + 1]), range(8)))
    after = counts()
    onnx = _infer(module, url, "mlp_onnx", rows)
    for i, answer in enumerate(answers):  # each client gets its own row back
        np.testing.assert_allclose(answer, onnx[i:i + 1], **TOL)
    assert after[0] - before[0] == 8
    assert after[1] - before[1] < 8, f"8 requests took {after[1] - before[1]} executions: none were merged"


def test_metadata_names_the_platform(server):
    meta = httpclient.InferenceServerClient(server.http_url).get_model_metadata("mlp_torchscript")
    assert meta["platform"] == "pytorch_libtorch"
    assert meta["inputs"] == [{"name": "INPUT__0", "datatype": "FP32", "shape": [-1, 4]}]
    assert meta["outputs"] == [{"name": "OUTPUT__0", "datatype": "FP32", "shape": [-1, 3]}]
    config = grpcclient.InferenceServerClient(server.grpc_url).get_model_config("mlp_torchscript").config
    assert config.backend == "pytorch" and config.default_model_filename == "model.pt"


def test_without_torch_other_models_keep_serving(tmp_path):
    repo = tmp_path / "repo"
    for name in ("simple", "mlp_torchscript"):
        shutil.copytree(EXAMPLE_REPO / name, repo / name)
    (repo / "no_config" / "1").mkdir(parents=True)  # a TorchScript file alone cannot be auto-completed
    shutil.copy(EXAMPLE_REPO / "mlp_torchscript" / "1" / "model.pt", repo / "no_config" / "1" / "model.pt")
    ports = free_port(), free_port(), free_port()
    blocker = "import sys; sys.modules['torch'] = None; from pier.cli import main; sys.exit(main(sys.argv[1:]))"
    cmd = [sys.executable, "-c", blocker, "serve", f"--model-repository={repo}", f"--http-port={ports[0]}",
           f"--grpc-port={ports[1]}", f"--metrics-port={ports[2]}", "--http-address=127.0.0.1",
           "--grpc-address=127.0.0.1", "--metrics-address=127.0.0.1", "--exit-on-error=false",
           "--strict-readiness=false"]
    log_path = tmp_path / "log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    server = PierProcess(proc, *ports, log_path)
    try:
        deadline = time.monotonic() + 60
        while "Pier is ready" not in server.log():
            assert proc.poll() is None and time.monotonic() < deadline, server.log()
            time.sleep(0.1)
        base = server.base()
        body = {"inputs": [{"name": n, "shape": [1, 16], "datatype": "INT32", "data": [2] * 16}
                           for n in ("INPUT0", "INPUT1")]}
        r = requests.post(f"{base}/v2/models/simple/infer", json=body, timeout=10)
        assert r.status_code == 200 and r.json()["outputs"][0]["data"] == [4] * 16
        index = requests.post(f"{base}/v2/repository/index", timeout=10).json()
        [row] = [r for r in index if r["name"] == "mlp_torchscript"]
        assert row["state"] == "UNAVAILABLE"
        assert "backend 'pytorch' is not available" in row["reason"] and "install pier[torch]" in row["reason"]
        assert requests.get(f"{base}/v2/models/mlp_torchscript/ready", timeout=5).status_code == 400
        [row] = [r for r in index if r["name"] == "no_config"]
        assert row["state"] == "UNAVAILABLE" and "config.pbtxt must list every input and output" in row["reason"]
    finally:
        assert server.stop() == 0, server.log()
