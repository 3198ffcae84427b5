"""ONNX Runtime on the GPU: KIND_GPU instances use the CUDA execution provider (and TensorRT
when the config asks for it). Needs onnxruntime-gpu and a GPU; skipped otherwise, with the
reason. `scripts/gpu_check.sh` runs these on a GPU machine."""

from __future__ import annotations

import shutil

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient

from pier.lifecycle.lifecycle import gpu_count
from tests.conftest import EXAMPLE_REPO, numpy_inputs, start_pier

pytestmark = pytest.mark.skipif(
    gpu_count() == 0 or "CUDAExecutionProvider" not in ort.get_available_providers(),
    reason=f"needs a GPU and onnxruntime-gpu (GPUs: {gpu_count()}, providers: {ort.get_available_providers()})",
)

GPU_GROUP = "instance_group [ { count: 1 kind: KIND_CPU } ]"


@pytest.mark.parametrize("accelerator", ["", "tensorrt"])
def test_simple_on_gpu_matches_cpu(tmp_path, accelerator):
    if accelerator and "TensorrtExecutionProvider" not in ort.get_available_providers():
        pytest.skip("onnxruntime has no TensorRT execution provider")
    repo = tmp_path / "repo"
    shutil.copytree(EXAMPLE_REPO / "simple", repo / "simple")
    config = (repo / "simple" / "config.pbtxt").read_text()
    gpu = "instance_group [ { count: 1 kind: KIND_GPU gpus: [ 0 ] } ]"
    if accelerator:
        gpu += ('\noptimization { execution_accelerators { gpu_execution_accelerator : '
                f'[ {{ name : "{accelerator}" }} ] }} }}')
    (repo / "simple" / "config.pbtxt").write_text(config.replace(GPU_GROUP, gpu))
    server = start_pier([repo], log_path=tmp_path / "log", timeout=300)
    try:
        client = grpcclient.InferenceServerClient(server.grpc_url)
        a = np.arange(64, dtype=np.int32).reshape(4, 16)
        b = np.full((4, 16), 5, dtype=np.int32)
        result = client.infer("simple", numpy_inputs(grpcclient, {"INPUT0": a, "INPUT1": b}))
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
        assert client.get_model_config("simple").config.instance_group[0].kind == 2  # KIND_GPU
    finally:
        assert server.stop() == 0
