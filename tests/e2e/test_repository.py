"""Model repository semantics against a real server: version policies, auto-complete from the
ONNX model, reshape, default_model_filename, name checks, KIND_GPU without a GPU."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from pier.lifecycle.lifecycle import gpu_count
from scripts.build_example_models import identity_model, write_model
from tests.conftest import EXAMPLE_REPO, start_pier


def _identity_config(name: str, extra: str = "", dims: str = "[ 3 ]", mbs: int = 4) -> str:
    return (f'name: "{name}"\nplatform: "onnxruntime_onnx"\nmax_batch_size: {mbs}\n'
            f'input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: {dims} }} ]\n'
            f'output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: {dims} }} ]\n{extra}')


@pytest.fixture(scope="module")
def repo_server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    fp32 = identity_model("FP32", [-1, 3])
    for v in (1, 2, 3):
        write_model(repo, "all_versions", _identity_config("all_versions", "version_policy: { all { } }"), fp32, v)
        latest = "version_policy: { latest { num_versions: 2 } }"
        write_model(repo, "latest_two", _identity_config("latest_two", latest), fp32, v)
        write_model(repo, "pinned", _identity_config("pinned", "version_policy: { specific { versions: [ 1, 3 ] } }"),
                    fp32, v)
        write_model(repo, "default_latest", _identity_config("default_latest"), fp32, v)
    (repo / "ignored_dirs" / "01").mkdir(parents=True)
    write_model(repo, "ignored_dirs", _identity_config("ignored_dirs"), fp32, 2)
    (repo / "ignored_dirs" / "not_a_version").mkdir()
    write_model(repo, "auto", None, fp32)  # no config.pbtxt at all
    write_model(repo, "reshaped", _identity_config(
        "reshaped", dims="[ 16 ] reshape: { shape: [ 4, 4 ] }", mbs=2), identity_model("FP32", [-1, 4, 4]))
    custom = repo / "custom_file"
    (custom / "1").mkdir(parents=True)
    (custom / "config.pbtxt").write_text(_identity_config("custom_file", 'default_model_filename: "net.onnx"\n'))
    (custom / "1" / "net.onnx").write_bytes(fp32)
    write_model(repo, "wrong_name", _identity_config("other_name"), fp32)
    write_model(repo, "on_gpu", _identity_config("on_gpu", "instance_group [ { kind: KIND_GPU } ]"), fp32)
    write_model(repo, "wrong_type", _identity_config("wrong_type").replace("TYPE_FP32", "TYPE_INT32"), fp32)
    write_model(repo, "no_policy_match", _identity_config("no_policy_match",
                                                          "version_policy: { specific { versions: [ 5 ] } }"), fp32)
    (repo / "no_versions").mkdir()
    (repo / "no_versions" / "config.pbtxt").write_text(_identity_config("no_versions"))
    server = start_pier([repo], "--exit-on-error=false", "--strict-readiness=false",
                        log_path=tmp_path_factory.mktemp("log") / "pier.log")
    server.repo = repo
    yield server
    assert server.stop() == 0


def _index(server) -> dict[str, list[dict]]:
    rows = requests.post(f"{server.base()}/v2/repository/index", json={}, timeout=10).json()
    out: dict[str, list[dict]] = {}
    for row in rows:
        out.setdefault(row["name"], []).append(row)
    return out


def _infer(server, model: str, data: np.ndarray, version: str = "") -> np.ndarray:
    client = httpclient.InferenceServerClient(server.http_url)
    inp = httpclient.InferInput("INPUT0", list(data.shape), "FP32")
    inp.set_data_from_numpy(data)
    return client.infer(model, [inp], model_version=version).as_numpy("OUTPUT0")


def test_version_policies(repo_server):
    client = httpclient.InferenceServerClient(repo_server.http_url)
    assert client.get_model_metadata("all_versions")["versions"] == ["1", "2", "3"]
    assert client.get_model_metadata("latest_two")["versions"] == ["2", "3"]
    assert client.get_model_metadata("pinned")["versions"] == ["1", "3"]
    assert client.get_model_metadata("default_latest")["versions"] == ["3"]
    assert client.get_model_metadata("ignored_dirs")["versions"] == ["2"]
    assert client.is_model_ready("all_versions", "1") and client.is_model_ready("pinned", "3")
    assert not client.is_model_ready("pinned", "2")
    x = np.ones((1, 3), dtype=np.float32)
    np.testing.assert_array_equal(_infer(repo_server, "all_versions", x, "2"), x)
    result = client.infer("all_versions", [_input(x)])
    assert result.get_response()["model_version"] == "3"  # newest READY version
    index = _index(repo_server)
    assert [r["version"] for r in index["latest_two"]] == ["2", "3"]


def _input(x: np.ndarray):
    inp = httpclient.InferInput("INPUT0", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return inp


def test_auto_complete_fills_io_from_the_onnx_model(repo_server):
    config = httpclient.InferenceServerClient(repo_server.http_url).get_model_config("auto")
    assert config["platform"] == "onnxruntime_onnx" and config["backend"] == "onnxruntime"
    assert config["max_batch_size"] == 4
    assert [(i["name"], i["data_type"], i["dims"]) for i in config["input"]] == [("INPUT0", "TYPE_FP32", [3])]
    assert [(o["name"], o["dims"]) for o in config["output"]] == [("OUTPUT0", [3])]
    assert "dynamic_batching" in config
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(_infer(repo_server, "auto", x), x)


def test_reshape(repo_server):
    x = np.arange(32, dtype=np.float32).reshape(2, 16)
    out = _infer(repo_server, "reshaped", x)
    assert out.shape == (2, 16)
    np.testing.assert_array_equal(out, x)
    meta = httpclient.InferenceServerClient(repo_server.http_url).get_model_metadata("reshaped")
    assert meta["inputs"][0]["shape"] == [-1, 16]


def test_default_model_filename(repo_server):
    x = np.ones((1, 3), dtype=np.float32)
    np.testing.assert_array_equal(_infer(repo_server, "custom_file", x), x)


@pytest.mark.parametrize("model,fragment", [
    ("wrong_name", "does not match the name of its folder 'wrong_name'"),
    ("wrong_type", "is FP32 in the ONNX model but INT32 in the configuration"),
    ("no_versions", "has no version folders"),
    ("no_policy_match", "at least one version must be available under the version policy of model "
                        "'no_policy_match'"),  # Triton's words
])
def test_bad_models_fail_alone_with_a_reason(repo_server, model, fragment):
    rows = _index(repo_server)[model]
    assert all(r["state"] == "UNAVAILABLE" for r in rows)
    assert any(fragment in r.get("reason", "") for r in rows), rows
    assert requests.get(f"{repo_server.base()}/v2/models/{model}/ready", timeout=5).status_code == 400


@pytest.mark.skipif(gpu_count() > 0, reason="this machine has a GPU; the no-GPU load error does not apply")
def test_kind_gpu_without_a_gpu_fails_clearly(repo_server):
    rows = _index(repo_server)["on_gpu"]
    assert rows[0]["state"] == "UNAVAILABLE"
    assert "KIND_GPU" in rows[0]["reason"] or "GPU" in rows[0]["reason"], rows


def test_grpc_sees_the_same_repository(repo_server):
    client = grpcclient.InferenceServerClient(repo_server.grpc_url)
    assert list(client.get_model_metadata("all_versions").versions) == ["1", "2", "3"]
    index = client.get_model_repository_index()
    names = {m.name for m in index.models}
    assert {"auto", "reshaped", "wrong_name"} <= names


def test_disable_auto_complete_rejects_a_model_without_config(tmp_path):
    repo = tmp_path / "repo"
    write_model(repo, "auto", None, identity_model("FP32", [-1, 3]))
    shutil.copytree(EXAMPLE_REPO / "simple", repo / "simple")
    server = start_pier([repo], "--disable-auto-complete-config", "--exit-on-error=false",
                        "--strict-readiness=false", log_path=tmp_path / "log")
    try:
        rows = [r for r in requests.post(f"{server.base()}/v2/repository/index", timeout=5).json()
                if r["name"] == "auto"]
        assert rows[0]["state"] == "UNAVAILABLE" and "auto-complete is disabled" in rows[0]["reason"]
        assert requests.get(f"{server.base()}/v2/models/simple/ready", timeout=5).status_code == 200
    finally:
        assert server.stop() == 0
