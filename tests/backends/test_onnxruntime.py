"""ONNX Runtime backend session options: Triton's thread-count parameters and `session.*` entries."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from pier.backends.onnxruntime.backend import BACKEND
from pier.contract.backend import InstanceContext, ModelContext
from pier.contract.errors import PierError
from pier.contract.types import InstanceGroupSpec, ModelSpec, TensorSpec
from tests.conftest import EXAMPLE_REPO


def _model(tmp_path: Path, params: dict[str, str], dims: tuple[int, ...] = (-1,), count: int = 1) -> ModelContext:
    version_dir = tmp_path / "identity" / "1"
    version_dir.mkdir(parents=True)
    shutil.copy(EXAMPLE_REPO / "identity_fp32" / "1" / "model.onnx", version_dir / "model.onnx")
    spec = ModelSpec(name="identity", platform="onnxruntime_onnx", backend="onnxruntime", max_batch_size=64,
                     inputs=(TensorSpec("INPUT0", "FP32", dims),), outputs=(TensorSpec("OUTPUT0", "FP32", (-1,)),),
                     instance_groups=(InstanceGroupSpec("identity_0", "KIND_CPU", count),),
                     default_model_filename="model.onnx", parameters=params)
    return ModelContext(spec=spec, version=1, model_dir=version_dir.parent, version_dir=version_dir)


def _options(tmp_path: Path, params: dict[str, str], count: int = 1):
    instance = BACKEND.create_instance(_model(tmp_path, params, count=count), InstanceContext("identity_0", "KIND_CPU"))
    try:
        return instance._session.get_session_options()
    finally:
        instance.close()


def test_no_session_entries_unless_asked(tmp_path):
    opts = _options(tmp_path, {})
    with pytest.raises(RuntimeError, match="does not have configuration"):  # ORT's default: workers spin
        opts.get_session_config_entry("session.intra_op.allow_spinning")


def test_session_parameters_pass_through(tmp_path):
    opts = _options(tmp_path, {"session.intra_op.allow_spinning": "1", "intra_op_thread_count": "1",
                               "session.use_env_allocators": "1"})
    assert opts.get_session_config_entry("session.intra_op.allow_spinning") == "1"
    assert opts.get_session_config_entry("session.use_env_allocators") == "1"
    assert opts.intra_op_num_threads == 1


def test_bad_thread_count_fails_at_load(tmp_path):
    with pytest.raises(PierError, match="intra_op_thread_count.*must be an integer"):
        _options(tmp_path, {"intra_op_thread_count": "many"})


def test_absurd_thread_count_fails_at_load(tmp_path):
    """100000 intra-op threads made onnxruntime start threads until memory ran out."""
    with pytest.raises(PierError, match="intra_op_thread_count' must be between 0 and 1024, got 100000"):
        _options(tmp_path, {"intra_op_thread_count": "100000"})


def test_config_shape_the_onnx_model_cannot_take_fails_at_load(tmp_path):
    """identity_fp32's ONNX input is [batch, n]: a config with two dims (three with the batch
    dim) would load READY and fail every request."""
    ctx = _model(tmp_path, {}, dims=(-1, 4))
    with pytest.raises(PierError, match=r"expects input 'INPUT0' with shape \[-1, -1, 4\].*ONNX model's shape is"):
        BACKEND.create_instance(ctx, InstanceContext("identity_0", "KIND_CPU"))


@pytest.mark.parametrize("in_dims,out_dims,fragment", [
    ((5,), (3,), "input 'INPUT__0' with shape [-1, 5] (a batch dim for max_batch_size > 0, then its dims) "
                 "but the ONNX model's shape is [-1, 4]"),
    ((4,), (7,), "output 'OUTPUT__0' with shape [-1, 7]"),
])
def test_config_dims_that_differ_from_the_onnx_model_fail_at_load(tmp_path, in_dims, out_dims, fragment):
    version_dir = tmp_path / "mlp" / "1"
    version_dir.mkdir(parents=True)
    shutil.copy(EXAMPLE_REPO / "mlp_onnx" / "1" / "model.onnx", version_dir / "model.onnx")

    def context(ins: tuple[int, ...], outs: tuple[int, ...]) -> ModelContext:
        spec = ModelSpec(name="mlp", platform="onnxruntime_onnx", backend="onnxruntime", max_batch_size=8,
                         inputs=(TensorSpec("INPUT__0", "FP32", ins),),
                         outputs=(TensorSpec("OUTPUT__0", "FP32", outs),),
                         instance_groups=(InstanceGroupSpec("mlp_0", "KIND_CPU", 1),),
                         default_model_filename="model.onnx", parameters={})
        return ModelContext(spec=spec, version=1, model_dir=version_dir.parent, version_dir=version_dir)

    with pytest.raises(PierError) as err:
        BACKEND.create_instance(context(in_dims, out_dims), InstanceContext("mlp_0", "KIND_CPU"))
    assert fragment in err.value.message
    BACKEND.create_instance(context((4,), (-1,)), InstanceContext("mlp_0", "KIND_CPU")).close()  # -1 fits any


def test_cpu_instances_share_the_cores(tmp_path):
    """onnxruntime's default is a thread per core per session: N instances would run N x cores
    threads. Several CPU instances get cores // N each, unless the config sets the count."""
    cores = len(os.sched_getaffinity(0))
    assert _options(tmp_path / "a", {}).intra_op_num_threads == 0  # one instance: onnxruntime's default
    assert _options(tmp_path / "b", {}, count=2).intra_op_num_threads == max(1, cores // 2)
    assert _options(tmp_path / "c", {}, count=4 * cores).intra_op_num_threads == 1
    assert _options(tmp_path / "d", {"intra_op_thread_count": "3"}, count=2).intra_op_num_threads == 3
