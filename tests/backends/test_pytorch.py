"""The TorchScript backend on real torch.jit archives: Triton's input/output naming rules, dict
inputs and outputs, datatypes, parameters, load errors, and the message when torch is missing.
The CUDA test runs where torch sees a GPU (scripts/gpu_check.sh) and skips elsewhere."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pier.backends.pytorch.backend import BACKEND
from pier.contract.backend import InstanceContext, ModelContext
from pier.contract.errors import ErrorCode, PierError
from pier.contract.types import InferenceRequest, InstanceGroupSpec, ModelSpec, RequestedOutput, Tensor, TensorSpec
from tests.conftest import EXAMPLE_REPO, ROOT

torch = pytest.importorskip("torch", reason="the TorchScript backend tests need torch (pip install pier[torch])")

CPU = InstanceContext("m_0", "KIND_CPU")
# torch 2.13 marks torch.jit deprecated (in favour of torch.export); TorchScript is what Triton's
# pytorch_libtorch platform serves, so the tests script and save with it all the same.
pytestmark = pytest.mark.filterwarnings(r"ignore:`torch\.jit\.\w+` is deprecated:DeprecationWarning")


class SumDiff(torch.nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return a + b, a - b


class DictInOut(torch.nn.Module):
    def forward(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"sum": inputs["a"] + inputs["b"], "product": inputs["a"] * inputs["b"]}


class Identity(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.clone()


class GradProbe(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tensor([torch.is_grad_enabled()]), x


class Optional2(torch.nn.Module):
    def forward(self, x: torch.Tensor, scale: float = 2.0) -> torch.Tensor:
        return x * scale


def _specs(items: list[tuple[str, str]], dims: tuple[int, ...] = (-1,)) -> tuple[TensorSpec, ...]:
    return tuple(TensorSpec(name, dt, dims) for name, dt in items)


def _model(tmp_path: Path, module: torch.nn.Module, inputs: list[tuple[str, str]],
           outputs: list[tuple[str, str]], params: dict[str, str] | None = None,
           name: str = "m") -> ModelContext:
    version_dir = tmp_path / name / "1"
    version_dir.mkdir(parents=True, exist_ok=True)
    torch.jit.save(torch.jit.script(module), str(version_dir / "model.pt"))
    spec = ModelSpec(name=name, platform="pytorch_libtorch", backend="pytorch", max_batch_size=0,
                     inputs=_specs(inputs), outputs=_specs(outputs),
                     instance_groups=(InstanceGroupSpec(f"{name}_0", "KIND_CPU", 1),),
                     default_model_filename="model.pt", parameters=params or {})
    return ModelContext(spec=spec, version=1, model_dir=tmp_path / name, version_dir=version_dir)


def _request(tensors: dict[str, np.ndarray], datatype: str = "FP32", outputs: list[str] | None = None,
             ) -> InferenceRequest:
    inputs = [Tensor(n, datatype, list(a.shape), a) for n, a in tensors.items()]
    return InferenceRequest("m", "", inputs, [RequestedOutput(o) for o in outputs or []])


def _run(instance, request: InferenceRequest) -> dict[str, np.ndarray]:
    [result] = instance.execute([request])
    if isinstance(result, PierError):
        raise result
    return {t.name: t.data for t in result.tensors}


A = np.array([5.0, 7.0], dtype=np.float32)
B = np.array([1.0, 2.0], dtype=np.float32)


def test_named_index_inputs_and_outputs_follow_the_index_not_config_order(tmp_path):
    # Config lists INPUT__1 first: the index, not the order, says it is forward()'s second argument.
    model = _model(tmp_path, SumDiff(), [("INPUT__1", "FP32"), ("INPUT__0", "FP32")],
                   [("OUTPUT__1", "FP32"), ("OUTPUT__0", "FP32")])
    inst = BACKEND.create_instance(model, CPU)
    out = _run(inst, _request({"INPUT__0": A, "INPUT__1": B}))
    np.testing.assert_array_equal(out["OUTPUT__0"], A + B)
    np.testing.assert_array_equal(out["OUTPUT__1"], A - B)
    assert list(out) == ["OUTPUT__1", "OUTPUT__0"]  # all outputs, in config order
    only = _run(inst, _request({"INPUT__0": A, "INPUT__1": B}, outputs=["OUTPUT__0"]))
    assert list(only) == ["OUTPUT__0"]


def test_inputs_named_after_forward_arguments_map_by_name(tmp_path):
    model = _model(tmp_path, SumDiff(), [("b", "FP32"), ("a", "FP32")], [("sum", "FP32"), ("diff", "FP32")])
    out = _run(BACKEND.create_instance(model, CPU), _request({"a": A, "b": B}))
    np.testing.assert_array_equal(out["diff"], A - B)  # a - b, though the config lists b first
    np.testing.assert_array_equal(out["sum"], A + B)


def test_other_names_map_in_config_order(tmp_path):
    model = _model(tmp_path, SumDiff(), [("X", "FP32"), ("Y", "FP32")], [("S", "FP32"), ("D", "FP32")])
    out = _run(BACKEND.create_instance(model, CPU), _request({"Y": B, "X": A}))
    np.testing.assert_array_equal(out["D"], A - B)
    np.testing.assert_array_equal(out["S"], A + B)


def test_dict_input_and_dict_output_by_key(tmp_path):
    model = _model(tmp_path, DictInOut(), [("a", "FP32"), ("b", "FP32")],
                   [("product", "FP32"), ("sum", "FP32")])
    inst = BACKEND.create_instance(model, CPU)
    out = _run(inst, _request({"a": A, "b": B}))
    np.testing.assert_array_equal(out["product"], A * B)
    np.testing.assert_array_equal(out["sum"], A + B)
    assert list(_run(inst, _request({"a": A, "b": B}, outputs=["sum"]))) == ["sum"]


def test_dict_output_without_the_configured_key_fails_the_request(tmp_path):
    model = _model(tmp_path, DictInOut(), [("a", "FP32"), ("b", "FP32")], [("difference", "FP32")])
    [result] = BACKEND.create_instance(model, CPU).execute([_request({"a": A, "b": B})])
    assert isinstance(result, PierError) and result.code is ErrorCode.INTERNAL
    assert "'difference'" in result.message and "product, sum" in result.message


def test_optional_forward_argument_may_be_left_out(tmp_path):
    model = _model(tmp_path, Optional2(), [("x", "FP32")], [("OUTPUT__0", "FP32")])
    out = _run(BACKEND.create_instance(model, CPU), _request({"x": A}))
    np.testing.assert_array_equal(out["OUTPUT__0"], A * 2)


@pytest.mark.parametrize("datatype", ["BOOL", "UINT8", "INT8", "INT16", "INT32", "INT64",
                                      "FP16", "FP32", "FP64", "BF16"])
def test_datatypes_round_trip(tmp_path, datatype):
    from pier.tensors.datatypes import numpy_dtype

    model = _model(tmp_path, Identity(), [("INPUT__0", datatype)], [("OUTPUT__0", datatype)])
    data = (np.arange(12).reshape(3, 4) % 2 == 1) if datatype == "BOOL" else np.arange(12).reshape(3, 4)
    if datatype == "BF16":
        data = np.array([0x3F80, 0x4000, 0xC040, 0x0000] * 3, dtype=np.uint16).reshape(3, 4)  # 1, 2, -3, 0
    data = data.astype(numpy_dtype(datatype))
    data.flags.writeable = False  # as a frontend hands it over: read-only views of the wire bytes
    [result] = BACKEND.create_instance(model, CPU).execute([_request({"INPUT__0": data}, datatype)])
    assert not isinstance(result, PierError), result
    [out] = result.tensors
    assert out.datatype == datatype and out.shape == [3, 4] and out.data.dtype == numpy_dtype(datatype)
    np.testing.assert_array_equal(out.data, data)


@pytest.mark.parametrize("datatype", ["BYTES", "UINT16", "UINT64"])
def test_datatypes_torchscript_cannot_hold_fail_at_load(tmp_path, datatype):
    model = _model(tmp_path, Identity(), [("INPUT__0", datatype)], [("OUTPUT__0", datatype)])
    with pytest.raises(PierError) as err:
        BACKEND.create_instance(model, CPU)
    assert err.value.code is ErrorCode.INVALID_ARG
    assert f"input 'INPUT__0' is {datatype}" in err.value.message and "supports" in err.value.message


def test_output_dtype_unlike_the_config_fails_the_request(tmp_path):
    model = _model(tmp_path, Identity(), [("INPUT__0", "FP32")], [("OUTPUT__0", "FP32")])
    model = dataclasses.replace(model, spec=dataclasses.replace(model.spec, outputs=_specs([("OUTPUT__0", "INT32")])))
    [result] = BACKEND.create_instance(model, CPU).execute([_request({"INPUT__0": A})])
    assert isinstance(result, PierError)
    assert "expects datatype INT32 for output 'OUTPUT__0', model provides float32" in result.message


def test_model_error_fails_only_that_request(tmp_path):
    model = _model(tmp_path, SumDiff(), [("a", "FP32"), ("b", "FP32")], [("s", "FP32"), ("d", "FP32")])
    inst = BACKEND.create_instance(model, CPU)
    bad = _request({"a": A, "b": np.ones(3, dtype=np.float32)})
    good = _request({"a": A, "b": B})
    results = inst.execute([bad, good])
    assert isinstance(results[0], PierError) and "PyTorch execute failure" in results[0].message
    np.testing.assert_array_equal(results[1].tensors[0].data, A + B)


def test_more_inputs_than_forward_takes_fails_at_load(tmp_path):
    model = _model(tmp_path, SumDiff(), [("INPUT__0", "FP32"), ("INPUT__1", "FP32"), ("INPUT__2", "FP32")],
                   [("OUTPUT__0", "FP32")])
    with pytest.raises(PierError, match=r"input 'INPUT__2' is argument 2 but the model's forward\(\) takes 2"):
        BACKEND.create_instance(model, CPU)


def test_required_argument_without_an_input_fails_at_load(tmp_path):
    model = _model(tmp_path, SumDiff(), [("a", "FP32")], [("OUTPUT__0", "FP32")])
    with pytest.raises(PierError, match=r"forward\(\) argument 'b' has no default"):
        BACKEND.create_instance(model, CPU)


def test_not_a_torchscript_file_fails_at_load(tmp_path):
    model = _model(tmp_path, Identity(), [("INPUT__0", "FP32")], [("OUTPUT__0", "FP32")])
    model.model_path.write_bytes(b"not a zip archive")
    with pytest.raises(PierError) as err:
        BACKEND.create_instance(model, CPU)
    assert err.value.code is ErrorCode.INVALID_ARG and "is not a TorchScript archive" in err.value.message


def test_missing_file_fails_at_load(tmp_path):
    model = _model(tmp_path, Identity(), [("INPUT__0", "FP32")], [("OUTPUT__0", "FP32")])
    model.model_path.unlink()
    with pytest.raises(PierError, match="does not exist"):
        BACKEND.create_instance(model, CPU)


def test_runs_under_inference_mode_without_grad(tmp_path):
    model = _model(tmp_path, GradProbe(), [("INPUT__0", "FP32")], [("OUTPUT__0", "BOOL"), ("OUTPUT__1", "FP32")])
    out = _run(BACKEND.create_instance(model, CPU), _request({"INPUT__0": A}))
    assert out["OUTPUT__0"].tolist() == [False]
    assert torch.is_grad_enabled()  # only inside execute


@pytest.mark.parametrize("key", ["INTRA_OP_THREAD_COUNT", "intra_op_thread_count"])
def test_intra_op_thread_count(tmp_path, key):
    before = torch.get_num_threads()
    wanted = 1 if before != 1 else 2
    try:
        model = _model(tmp_path, Identity(), [("INPUT__0", "FP32")], [("OUTPUT__0", "FP32")], {key: str(wanted)})
        inst = BACKEND.create_instance(model, CPU)
        torch.set_num_threads(before)  # another model on this thread in between
        _run(inst, _request({"INPUT__0": A}))
        assert torch.get_num_threads() == wanted
    finally:
        torch.set_num_threads(before)


def test_bad_parameter_values_fail_at_load(tmp_path):
    for params, message in (({"INTRA_OP_THREAD_COUNT": "many"}, "must be an integer"),
                            ({"INFERENCE_MODE": "maybe"}, "must be true or false")):
        model = _model(tmp_path, Identity(), [("INPUT__0", "FP32")], [("OUTPUT__0", "FP32")], params)
        with pytest.raises(PierError, match=message):
            BACKEND.create_instance(model, CPU)


@pytest.mark.skipif(torch.cuda.is_available(), reason="torch sees a GPU here")
def test_kind_gpu_without_cuda_says_why(tmp_path):
    model = _model(tmp_path, Identity(), [("INPUT__0", "FP32")], [("OUTPUT__0", "FP32")])
    with pytest.raises(PierError) as err:
        BACKEND.create_instance(model, InstanceContext("m_0_gpu0", "KIND_GPU", 0))
    assert err.value.code is ErrorCode.UNAVAILABLE
    assert "is KIND_GPU but torch" in err.value.message and "cannot use CUDA" in err.value.message


@pytest.mark.skipif(not torch.cuda.is_available(), reason=f"torch {torch.__version__} sees no CUDA device")
def test_example_mlp_on_cuda_matches_cpu():
    from scripts.build_torch_examples import mlp_reference

    folder = EXAMPLE_REPO / "mlp_torchscript"
    spec = ModelSpec(name="mlp_torchscript", platform="pytorch_libtorch", backend="pytorch", max_batch_size=8,
                     inputs=_specs([("INPUT__0", "FP32")], (4,)), outputs=_specs([("OUTPUT__0", "FP32")], (3,)),
                     instance_groups=(), default_model_filename="model.pt", parameters={})
    model = ModelContext(spec, 1, folder, folder / "1")
    x = np.random.default_rng(3).standard_normal((8, 4)).astype(np.float32)
    outs = []
    for where in (CPU, InstanceContext("mlp_0_gpu0", "KIND_GPU", 0)):
        inst = BACKEND.create_instance(model, where)
        outs.append(_run(inst, _request({"INPUT__0": x}))["OUTPUT__0"])
        inst.close()
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(outs[0], mlp_reference(x), rtol=1e-5, atol=1e-5)


def test_describe_says_the_config_must_list_tensors(tmp_path):
    with pytest.raises(PierError) as err:
        BACKEND.describe(tmp_path / "model.pt")
    assert "config.pbtxt must list every input and output" in err.value.message


def test_without_torch_the_load_error_says_to_install_it(tmp_path):
    model = _model(tmp_path, Identity(), [("INPUT__0", "FP32")], [("OUTPUT__0", "FP32")])
    script = (
        "import sys; sys.modules['torch'] = None\n"  # makes `import torch` raise ImportError
        "from pathlib import Path\n"
        "from pier.contract.backend import InstanceContext, ModelContext\n"
        "from pier.backends.pytorch.backend import BACKEND\n"
        "from pier.contract.errors import PierError\n"
        "from pier.contract.types import ModelSpec, TensorSpec\n"
        "spec = ModelSpec('m', 'pytorch_libtorch', 'pytorch', 0, (TensorSpec('INPUT__0', 'FP32', (-1,)),),\n"
        "                 (TensorSpec('OUTPUT__0', 'FP32', (-1,)),), (), 'model.pt', {})\n"
        f"ctx = ModelContext(spec, 1, Path({str(model.model_dir)!r}), Path({str(model.version_dir)!r}))\n"
        "try:\n"
        "    BACKEND.create_instance(ctx, InstanceContext('m_0', 'KIND_CPU'))\n"
        "except PierError as exc:\n"
        "    print(exc.code.name, exc.message)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("UNAVAILABLE backend 'pytorch' is not available:"), proc.stdout
    assert "install pier[torch]" in proc.stdout


def test_example_models_rebuild_byte_identically(tmp_path):
    """scripts/build_torch_examples.py gives the committed bytes (TorchScript: with torch 2.13.0)."""
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "build_torch_examples.py"), "--out",
                           str(tmp_path)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for name, filename in (("mlp_onnx", "model.onnx"), ("mlp_torchscript", "model.pt")):
        if filename == "model.pt" and torch.__version__.split("+")[0] != "2.13.0":
            continue  # another torch writes other (equally valid) bytes
        built = (tmp_path / name / "1" / filename).read_bytes()
        assert built == (EXAMPLE_REPO / name / "1" / filename).read_bytes(), f"{name} differs"
        assert (tmp_path / name / "config.pbtxt").read_text() == (EXAMPLE_REPO / name / "config.pbtxt").read_text()
