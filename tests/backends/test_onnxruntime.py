"""ONNX Runtime backend session options: Triton's thread-count parameters and `session.*` entries."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from backends.base import InstanceContext, ModelContext
from backends.onnxruntime.backend import BACKEND
from server.errors import PierError
from server.types import InstanceGroupSpec, ModelSpec, TensorSpec
from tests.conftest import EXAMPLE_REPO


def _model(tmp_path: Path, params: dict[str, str]) -> ModelContext:
    version_dir = tmp_path / "identity" / "1"
    version_dir.mkdir(parents=True)
    shutil.copy(EXAMPLE_REPO / "identity_fp32" / "1" / "model.onnx", version_dir / "model.onnx")
    spec = ModelSpec(name="identity", platform="onnxruntime_onnx", backend="onnxruntime", max_batch_size=64,
                     inputs=(TensorSpec("INPUT0", "FP32", (-1,)),), outputs=(TensorSpec("OUTPUT0", "FP32", (-1,)),),
                     instance_groups=(InstanceGroupSpec("identity_0", "KIND_CPU", 1),),
                     default_model_filename="model.onnx", parameters=params)
    return ModelContext(spec=spec, version=1, model_dir=version_dir.parent, version_dir=version_dir)


def _options(tmp_path: Path, params: dict[str, str]):
    instance = BACKEND.create_instance(_model(tmp_path, params), InstanceContext("identity_0", "KIND_CPU"))
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
