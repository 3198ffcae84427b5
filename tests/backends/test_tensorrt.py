"""The TensorRT backend. Everywhere: a `tensorrt_plan` model that cannot load says why and the
other models keep serving. With an NVIDIA GPU, tensorrt and a CUDA torch (scripts/gpu_check.sh):
an engine built from the mlp_onnx example serves the same answers as onnxruntime over HTTP and
gRPC, dynamic batch sizes go through the optimization profile, a batch no profile covers fails
with the profile's range, and a config-less engine is auto-completed."""

from __future__ import annotations

import dataclasses
import shutil

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from pier.backends.tensorrt.backend import BACKEND, unavailable_reason
from pier.contract.backend import InstanceContext, ModelContext
from pier.contract.errors import ErrorCode, PierError
from pier.contract.types import ModelSpec, TensorSpec
from tests.conftest import EXAMPLE_REPO, start_pier

REASON = unavailable_reason()
needs_trt = pytest.mark.skipif(REASON is not None, reason=f"needs TensorRT: {REASON}")

TRT_CONFIG = """\
name: "{name}"
platform: "tensorrt_plan"
max_batch_size: 8
input [ {{ name: "INPUT__0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [ {{ name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 3 ] }} ]
dynamic_batching {{ max_queue_delay_microseconds: 1000 }}
instance_group [ {{ count: 1 kind: {kind} }} ]
"""


def _spec(name: str = "plan") -> ModelSpec:
    return ModelSpec(name=name, platform="tensorrt_plan", backend="tensorrt", max_batch_size=8,
                     inputs=(TensorSpec("INPUT__0", "FP32", (4,)),), outputs=(TensorSpec("OUTPUT__0", "FP32", (3,)),),
                     instance_groups=(), default_model_filename="model.plan", parameters={})


def test_unloadable_plan_says_why_and_others_keep_serving(tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(EXAMPLE_REPO / "simple", repo / "simple")
    (repo / "plan" / "1").mkdir(parents=True)
    (repo / "plan" / "config.pbtxt").write_text(TRT_CONFIG.format(name="plan", kind="KIND_AUTO"))
    (repo / "plan" / "1" / "model.plan").write_bytes(b"not an engine")
    server = start_pier([repo], "--exit-on-error=false", "--strict-readiness=false", log_path=tmp_path / "log")
    try:
        base = server.base()
        body = {"inputs": [{"name": n, "shape": [1, 16], "datatype": "INT32", "data": [3] * 16}
                           for n in ("INPUT0", "INPUT1")]}
        r = requests.post(f"{base}/v2/models/simple/infer", json=body, timeout=10)
        assert r.status_code == 200 and r.json()["outputs"][1]["data"] == [0] * 16
        [row] = [r for r in requests.post(f"{base}/v2/repository/index", timeout=10).json() if r["name"] == "plan"]
        assert row["state"] == "UNAVAILABLE"
        expected = ("TensorRT models need an NVIDIA GPU and the tensorrt package" if REASON
                    else "could not deserialize")
        assert expected in row["reason"], row["reason"]
        assert requests.get(f"{base}/v2/models/plan/ready", timeout=5).status_code == 400
    finally:
        assert server.stop() == 0, server.log()


@pytest.mark.skipif(REASON is None, reason="TensorRT is usable here")
def test_without_tensorrt_create_instance_and_describe(tmp_path):
    ctx = ModelContext(_spec(), 1, tmp_path, tmp_path / "1")
    with pytest.raises(PierError) as err:
        BACKEND.create_instance(ctx, InstanceContext("plan_0_gpu0", "KIND_GPU", 0))
    assert err.value.code is ErrorCode.UNAVAILABLE
    assert err.value.message == f"unable to load model 'plan': {REASON}"
    assert REASON.startswith("TensorRT models need an NVIDIA GPU and the tensorrt package: ")
    assert BACKEND.describe(tmp_path / "1" / "model.plan") is None  # the config must list the tensors


@pytest.fixture(scope="module")
def trt_server(tmp_path_factory):
    from scripts.build_trt_engine import build_engine

    repo = tmp_path_factory.mktemp("repo")
    shutil.copytree(EXAMPLE_REPO / "mlp_onnx", repo / "mlp_onnx")
    onnx = (EXAMPLE_REPO / "mlp_onnx" / "1" / "model.onnx").read_bytes()
    engines = {"mlp_trt": build_engine(onnx, max_batch=8), "mlp_trt_small": build_engine(onnx, max_batch=4)}
    for name, plan in engines.items():
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "config.pbtxt").write_text(TRT_CONFIG.format(name=name, kind="KIND_GPU"))
        (repo / name / "1" / "model.plan").write_bytes(plan)
    (repo / "mlp_trt_auto" / "1").mkdir(parents=True)  # no config.pbtxt: read from the engine
    (repo / "mlp_trt_auto" / "1" / "model.plan").write_bytes(engines["mlp_trt"])
    server = start_pier([repo], log_path=tmp_path_factory.mktemp("log") / "pier.log", timeout=300)
    yield server
    assert server.stop() == 0, server.log()


def _infer(module, url: str, model: str, x: np.ndarray) -> np.ndarray:
    inp = module.InferInput("INPUT__0", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return module.InferenceServerClient(url).infer(model, [inp]).as_numpy("OUTPUT__0")


@needs_trt
@pytest.mark.parametrize("module,attr", [(httpclient, "http_url"), (grpcclient, "grpc_url")], ids=["http", "grpc"])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_engine_matches_onnxruntime(trt_server, module, attr, batch):
    from scripts.build_torch_examples import mlp_reference

    x = np.random.default_rng(batch).standard_normal((batch, 4)).astype(np.float32)
    trt_out = _infer(module, getattr(trt_server, attr), "mlp_trt", x)
    ort_out = _infer(module, getattr(trt_server, attr), "mlp_onnx", x)
    assert trt_out.shape == (batch, 3) and trt_out.dtype == np.float32
    np.testing.assert_allclose(trt_out, ort_out, rtol=1e-3, atol=1e-3)  # TF32 is off in build_engine
    np.testing.assert_allclose(ort_out, mlp_reference(x), rtol=1e-5, atol=1e-5)


@needs_trt
def test_batch_outside_every_profile_fails_with_the_range(trt_server):
    x = np.ones((6, 4), dtype=np.float32)  # config allows 8, the engine's profile 1..4
    with pytest.raises(InferenceServerException, match=r"no optimization profile .*INPUT__0 \[1, 4\]\.\.\[4, 4\]"):
        _infer(grpcclient, trt_server.grpc_url, "mlp_trt_small", x)
    small = _infer(grpcclient, trt_server.grpc_url, "mlp_trt_small", x[:4])
    assert small.shape == (4, 3)


@needs_trt
def test_config_is_auto_completed_from_the_engine(trt_server):
    config = httpclient.InferenceServerClient(trt_server.http_url).get_model_config("mlp_trt_auto")
    assert config["platform"] == "tensorrt_plan" and config["backend"] == "tensorrt"
    assert [(t["name"], t["data_type"], t["dims"]) for t in config["input"]] == [("INPUT__0", "TYPE_FP32", [4])]
    assert [(t["name"], t["data_type"], t["dims"]) for t in config["output"]] == [("OUTPUT__0", "TYPE_FP32", [3])]
    x = np.ones((2, 4), dtype=np.float32)
    np.testing.assert_allclose(_infer(httpclient, trt_server.http_url, "mlp_trt_auto", x),
                               _infer(httpclient, trt_server.http_url, "mlp_onnx", x), rtol=1e-3, atol=1e-3)


@needs_trt
def test_instance_rejects_a_config_unlike_the_engine(tmp_path):
    from scripts.build_trt_engine import build_engine

    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "model.plan").write_bytes(build_engine((EXAMPLE_REPO / "mlp_onnx" / "1" / "model.onnx")
                                                            .read_bytes(), max_batch=8))
    spec = _spec()
    wrong = dataclasses.replace(spec, inputs=(TensorSpec("INPUT__0", "INT32", (4,)),))
    with pytest.raises(PierError, match="'INPUT__0' is FP32 in the engine but INT32 in the configuration"):
        BACKEND.create_instance(ModelContext(wrong, 1, tmp_path, tmp_path / "1"),
                                InstanceContext("plan_0_gpu0", "KIND_GPU", 0))
    instance = BACKEND.create_instance(ModelContext(spec, 1, tmp_path, tmp_path / "1"),
                                       InstanceContext("plan_0_gpu0", "KIND_GPU", 0))
    instance.close()
