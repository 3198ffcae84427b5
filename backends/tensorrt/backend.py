"""TensorRT backend (Triton's `tensorrt_plan` platform): one deserialized engine per instance.

TensorRT 10's name-based API: inputs and outputs are bound by tensor name, shapes are set per
request (`set_input_shape`), and `execute_async_v3` runs on a CUDA stream the instance owns.
Device memory and the stream come from torch (CUDA tensors), so no pycuda/cuda-python is needed.
Dynamic shapes: each request uses the first optimization profile whose [min, max] covers every
input's shape (one execution context per profile, created on first use); a request no profile
covers fails with the profiles listed. Needs an NVIDIA GPU, the `tensorrt` package and a CUDA
build of torch (`pip install pier[gpu]`); without them a TensorRT model fails to load with the
reason and every other model keeps serving. An engine only runs on the GPU model and TensorRT
version that built it (scripts/build_trt_engine.py builds one from an ONNX file).
Instances: KIND_GPU runs on the listed GPU; a KIND_CPU instance (the completed config's default
when no `gpus` are listed) runs on GPU 0, since a TensorRT engine cannot run on a CPU.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pier.contract.backend import Backend, InstanceContext, ModelContext, ModelInstance
from pier.contract.errors import PierError, internal, invalid_arg, unavailable
from pier.contract.types import ExecuteResult, InferenceRequest, ModelSignature, ModelSpec, Outputs, Tensor

log = logging.getLogger("pier.backends.tensorrt")

try:
    import tensorrt as trt
    import torch
except ImportError as exc:  # optional: only TensorRT models fail
    trt = None  # type: ignore[assignment]
    torch = None  # type: ignore[assignment]
    _IMPORT_ERROR = str(exc)
else:
    _IMPORT_ERROR = ""

_NEEDS = "TensorRT models need an NVIDIA GPU and the tensorrt package"

# TensorRT DataType member name -> (KServe datatype, torch dtype name). FP8/INT4/FP4 have no KServe type.
_TYPES = {
    "BOOL": ("BOOL", "bool"), "UINT8": ("UINT8", "uint8"), "INT8": ("INT8", "int8"),
    "INT32": ("INT32", "int32"), "INT64": ("INT64", "int64"), "HALF": ("FP16", "float16"),
    "FLOAT": ("FP32", "float32"), "BF16": ("BF16", "bfloat16"),
}


def unavailable_reason() -> str | None:
    """Why TensorRT cannot run here, or None when it can."""
    if trt is None:
        return f"{_NEEDS}: {_IMPORT_ERROR} (pip install pier[gpu])"
    if not torch.cuda.is_available():
        return (f"{_NEEDS}: torch {torch.__version__} sees no CUDA device (a CPU-only build of torch, or "
                "no NVIDIA driver/GPU visible)")
    return None


def _datatype(engine: Any, name: str) -> str:
    trt_type = engine.get_tensor_dtype(name)
    entry = _TYPES.get(getattr(trt_type, "name", str(trt_type)))
    if entry is None:
        raise invalid_arg(f"engine tensor '{name}' has TensorRT type {trt_type}, which KServe cannot carry")
    return entry[0]


def _torch_dtype(datatype: str) -> Any:
    return getattr(torch, next(t for dt, t in _TYPES.values() if dt == datatype))


_LOGGER_LOCK = threading.Lock()
_LOGGER: Any = None


def _logger() -> Any:
    """One TensorRT logger for the process (it must outlive every runtime built with it)."""
    global _LOGGER
    with _LOGGER_LOCK:
        if _LOGGER is None:
            _LOGGER = trt.Logger(trt.Logger.WARNING)
        return _LOGGER


def _deserialize(path: Path, device: Any) -> tuple[Any, Any]:
    """(runtime, engine) for the plan at `path`, on `device`."""
    if not path.exists():
        raise unavailable(f"model file '{path}' does not exist")
    why = "see the TensorRT log"
    with torch.cuda.device(device):
        runtime = trt.Runtime(_logger())
        try:
            engine = runtime.deserialize_cuda_engine(path.read_bytes())
        except Exception as exc:  # some versions raise instead of returning None
            engine, why = None, str(exc)
    if engine is None:
        raise invalid_arg(
            f"TensorRT {trt.__version__} could not deserialize '{path}' ({why}): an engine runs only with "
            "the TensorRT version and GPU model that built it"
        )
    return runtime, engine


def _io(engine: Any) -> tuple[dict[str, str], dict[str, str]]:
    """({input name: datatype}, {output name: datatype}) in engine order."""
    inputs: dict[str, str] = {}
    outputs: dict[str, str] = {}
    for i in range(engine.num_io_tensors):
        name = engine.get_tensor_name(i)
        if engine.is_shape_inference_io(name):
            raise invalid_arg(f"engine tensor '{name}' is a shape tensor, which Pier's TensorRT backend "
                              "does not support")
        is_input = engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT
        (inputs if is_input else outputs)[name] = _datatype(engine, name)
    return inputs, outputs


def _check_spec(spec: ModelSpec, engine: Any, inputs: dict[str, str], outputs: dict[str, str]) -> None:
    """The config must name the engine's tensors with their datatypes and ranks (Triton checks too)."""
    batch = 1 if spec.max_batch_size > 0 else 0
    for kind, tensors, actual in (("input", spec.inputs, inputs), ("output", spec.outputs, outputs)):
        for t in tensors:
            if t.name not in actual:
                raise invalid_arg(f"unable to load model '{spec.name}': configuration has {kind} '{t.name}' "
                                  f"but the engine's {kind}s are {sorted(actual)}")
            if actual[t.name] != t.datatype:
                raise invalid_arg(f"unable to load model '{spec.name}': {kind} '{t.name}' is "
                                  f"{actual[t.name]} in the engine but {t.datatype} in the configuration")
            dims = (-1,) * batch + tuple(t.reshape if t.reshape is not None else t.dims)
            shape = tuple(engine.get_tensor_shape(t.name))
            if len(shape) != len(dims) or any(a >= 0 and b >= 0 and a != b for a, b in zip(shape, dims)):
                raise invalid_arg(
                    f"unable to load model '{spec.name}': {kind} '{t.name}' has shape {list(shape)} in the "
                    f"engine, which the configuration's {list(dims)} (batch dim first when max_batch_size "
                    "> 0) does not match"
                )
    missing = [n for n in inputs if spec.input(n) is None]
    if missing:
        raise invalid_arg(f"unable to load model '{spec.name}': the engine needs inputs {missing} that the "
                          "configuration does not list")


def _bounds(engine: Any, name: str, profile: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(min, max) shape of input `name` under optimization profile `profile`."""
    static = tuple(int(d) for d in engine.get_tensor_shape(name))
    if all(d >= 0 for d in static):
        return static, static
    low, _, high = engine.get_tensor_profile_shape(name, profile)
    return tuple(int(d) for d in low), tuple(int(d) for d in high)


class TensorRTInstance(ModelInstance):
    def __init__(self, model: ModelContext, instance: InstanceContext) -> None:
        if instance.kind != "KIND_GPU":
            log.warning("instance '%s' of '%s' is %s: a TensorRT engine runs on a GPU, using GPU 0",
                        instance.name, model.spec.name, instance.kind)
        index = instance.device_id or 0
        if index >= torch.cuda.device_count():
            raise unavailable(f"instance '{instance.name}' asks for GPU {index} but torch sees "
                              f"{torch.cuda.device_count()} CUDA device(s)")
        self._device = torch.device("cuda", index)
        self._runtime, self._engine = _deserialize(model.model_path, self._device)
        self._inputs, self._outputs = _io(self._engine)
        _check_spec(model.spec, self._engine, self._inputs, self._outputs)
        self._spec_outputs = [t.name for t in model.spec.outputs]
        self._profiles = [{name: _bounds(self._engine, name, k) for name in self._inputs}
                          for k in range(max(self._engine.num_optimization_profiles, 1))]
        self._contexts: dict[int, Any] = {}
        with torch.cuda.device(self._device):
            self._stream = torch.cuda.Stream(device=self._device)
            self._context(0)  # fail at load, not on the first request, if the engine cannot run

    def _context(self, profile: int) -> Any:
        context = self._contexts.get(profile)
        if context is None:
            context = self._engine.create_execution_context()
            if context is None:
                raise unavailable("TensorRT could not create an execution context (out of GPU memory?)")
            if context.active_optimization_profile != profile:
                context.set_optimization_profile_async(profile, self._stream.cuda_stream)
                self._stream.synchronize()
            self._contexts[profile] = context
        return context

    def _pick_profile(self, shapes: dict[str, tuple[int, ...]]) -> int:
        for k, bounds in enumerate(self._profiles):
            if all(len(shapes[n]) == len(lo) and all(a <= d <= b for a, d, b in zip(lo, shapes[n], hi))
                   for n, (lo, hi) in bounds.items() if n in shapes):
                return k
        ranges = "; ".join(
            f"profile {k}: " + ", ".join(f"{n} {list(lo)}..{list(hi)}" for n, (lo, hi) in b.items())
            for k, b in enumerate(self._profiles))
        given = ", ".join(f"{n} {list(s)}" for n, s in shapes.items())
        raise invalid_arg(f"no optimization profile of the engine accepts input shapes {given} ({ranges})")

    def execute(self, requests: Sequence[InferenceRequest]) -> list[ExecuteResult]:
        return [self._run_one(r) for r in requests]

    def _run_one(self, request: InferenceRequest) -> ExecuteResult:
        try:
            with torch.cuda.device(self._device), torch.cuda.stream(self._stream):
                return Outputs(self._enqueue(request))
        except PierError as exc:
            return exc
        except Exception as exc:
            return internal(f"TensorRT execute failure: {exc}")

    def _enqueue(self, request: InferenceRequest) -> list[Tensor]:
        by_name = {t.name: t for t in request.inputs}
        missing = [n for n in self._inputs if n not in by_name]
        if missing:
            raise invalid_arg(f"the engine needs inputs {missing}")
        context = self._context(self._pick_profile({n: tuple(t.data.shape) for n, t in by_name.items()}))
        keep: list[Any] = []  # device buffers must outlive the execution
        for name in self._inputs:
            value = _to_device(by_name[name], self._device)
            keep.append(value)
            if not context.set_input_shape(name, tuple(value.shape)):
                raise invalid_arg(f"TensorRT rejected shape {list(value.shape)} for input '{name}'")
            context.set_tensor_address(name, value.data_ptr())
        results: dict[str, Any] = {}
        for name, datatype in self._outputs.items():  # every output needs an address, wanted or not
            shape = tuple(context.get_tensor_shape(name))
            if any(d < 0 for d in shape):
                raise internal(f"output '{name}' has a data-dependent shape {list(shape)}, which Pier's "
                               "TensorRT backend does not support")
            value = torch.empty(shape, dtype=_torch_dtype(datatype), device=self._device)
            results[name] = value
            context.set_tensor_address(name, value.data_ptr())
        if not context.execute_async_v3(self._stream.cuda_stream):
            raise internal("TensorRT execute_async_v3 failed (see the TensorRT log)")
        names = request.output_names() or self._spec_outputs
        outputs = []
        for name in names:
            datatype = self._outputs[name]
            arr = _to_host(results[name], datatype)  # blocking copy on this stream: waits for the engine
            outputs.append(Tensor(name, datatype, list(arr.shape), arr))
        self._stream.synchronize()
        del keep
        return outputs

    def close(self) -> None:
        self._stream.synchronize()
        self._contexts.clear()  # contexts before the engine before the runtime
        self._engine = None
        self._runtime = None


def _to_device(tensor: Tensor, device: Any) -> Any:
    arr = tensor.data
    if tensor.datatype == "BF16":
        arr = arr.view(np.int16)
    if not (arr.flags.writeable and arr.flags.c_contiguous):
        arr = np.array(arr, order="C")
    value = torch.from_numpy(arr)
    if tensor.datatype == "BF16":
        value = value.view(torch.bfloat16)
    return value.to(device)


def _to_host(value: Any, datatype: str) -> np.ndarray:
    value = value.cpu()
    if datatype == "BF16":
        return value.view(torch.int16).numpy().view(np.uint16)
    return value.numpy()


class TensorRTBackend(Backend):
    name = "tensorrt"
    default_model_filename = "model.plan"

    def describe(self, model_path: Path) -> ModelSignature | None:
        """The engine's IO, when TensorRT and a GPU are here (else None: the config must list them)."""
        if unavailable_reason() is not None:
            return None
        runtime, engine = _deserialize(model_path, torch.device("cuda", 0))
        inputs, outputs = _io(engine)
        shapes = {n: tuple(int(d) for d in engine.get_tensor_shape(n)) for n in (*inputs, *outputs)}
        signature = ModelSignature(
            inputs=tuple((n, dt, shapes[n]) for n, dt in inputs.items()),
            outputs=tuple((n, dt, shapes[n]) for n, dt in outputs.items()),
        )
        del engine, runtime  # the engine first: a runtime must outlive its engines
        return signature

    def create_instance(self, model: ModelContext, instance: InstanceContext) -> ModelInstance:
        reason = unavailable_reason()
        if reason is not None:
            raise unavailable(f"unable to load model '{model.spec.name}': {reason}")
        return TensorRTInstance(model, instance)


BACKEND = TensorRTBackend()
