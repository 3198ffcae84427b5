"""ONNX Runtime backend: one InferenceSession per instance.

CPU execution provider by default; KIND_GPU instances use the CUDA provider (and TensorRT when
the config's `optimization.execution_accelerators.gpu_execution_accelerator` names
`tensorrt`), which needs onnxruntime-gpu (`pip install pier[gpu]`).
Config parameters: `intra_op_thread_count`, `inter_op_thread_count` (as Triton's ORT backend), and
any `session.*` key, passed to onnxruntime as a session config entry (e.g.
`session.intra_op.allow_spinning: "0"`, see `_session_options`). Without `intra_op_thread_count`,
several CPU instances split the cores between them (see `_session_options`).
"""

from __future__ import annotations

import ctypes
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort

from pier.contract.backend import Backend, InstanceContext, ModelContext, ModelInstance, thread_count
from pier.contract.errors import ErrorCode, PierError, internal, invalid_arg, unavailable
from pier.contract.types import ExecuteResult, InferenceRequest, ModelSignature, ModelSpec, Outputs, Tensor, TensorSpec

# ONNX tensor type strings -> KServe datatypes.
_ORT_TYPES = {
    "tensor(bool)": "BOOL",
    "tensor(uint8)": "UINT8",
    "tensor(uint16)": "UINT16",
    "tensor(uint32)": "UINT32",
    "tensor(uint64)": "UINT64",
    "tensor(int8)": "INT8",
    "tensor(int16)": "INT16",
    "tensor(int32)": "INT32",
    "tensor(int64)": "INT64",
    "tensor(float16)": "FP16",
    "tensor(float)": "FP32",
    "tensor(double)": "FP64",
    "tensor(string)": "BYTES",
    "tensor(bfloat16)": "BF16",
}
_ONNX_BF16 = 16  # TensorProto.BFLOAT16


def _datatype(ort_type: str, name: str) -> str:
    try:
        return _ORT_TYPES[ort_type]
    except KeyError:
        raise invalid_arg(f"onnx tensor '{name}' has type {ort_type}, which KServe cannot carry") from None


def _shape(shape: Sequence[object]) -> tuple[int, ...]:
    return tuple(d if isinstance(d, int) and d >= 0 else -1 for d in shape)


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _session_options(model: ModelContext, instance: InstanceContext) -> ort.SessionOptions:
    opts = ort.SessionOptions()
    params = model.spec.parameters
    for key, attr in (("intra_op_thread_count", "intra_op_num_threads"),
                      ("inter_op_thread_count", "inter_op_num_threads")):
        if key in params:
            setattr(opts, attr, thread_count(params[key], key))
    # onnxruntime's default gives every session a thread per core, so N CPU instances run N x cores
    # threads that preempt each other mid-operator (2 instances of text_embedding on 2 cores served
    # 25 % less than one). Unless the config says otherwise, the CPU instances share the cores:
    # cores // instances intra-op threads each (Triton leaves onnxruntime's default).
    cpu_instances = sum(g.count for g in model.spec.instance_groups if g.kind != "KIND_GPU")
    if "intra_op_thread_count" not in params and instance.kind == "KIND_CPU" and cpu_instances > 1:
        opts.intra_op_num_threads = max(1, _cores() // cpu_instances)
    # ORT's thread-pool workers spin between runs by default. Kept: served text_embedding ran
    # 10-25 % faster with it than with either switch below (alternating bench runs, c=1 and c=32),
    # though it holds a core after every run of a tiny model; `session.intra_op.allow_spinning: "0"` or
    # `session.force_spinning_stop: "1"` (any `session.*` config entry) is the per-model switch.
    for key, value in params.items():
        if key.startswith("session."):
            try:
                opts.add_session_config_entry(key, str(value))
            except Exception as exc:  # noqa: BLE001 - ORT raises its own Fail type
                raise invalid_arg(f"parameter '{key}': onnxruntime rejects it: {exc}") from None
    return opts


def _providers(model: ModelContext, instance: InstanceContext) -> list[object]:
    if instance.kind != "KIND_GPU":
        return ["CPUExecutionProvider"]
    available = ort.get_available_providers()
    if "CUDAExecutionProvider" not in available:
        raise unavailable(
            f"instance '{instance.name}' asks for KIND_GPU but onnxruntime has no CUDA execution "
            f"provider (available: {', '.join(available)}); install onnxruntime-gpu (pier[gpu])"
        )
    device = {"device_id": instance.device_id or 0}
    providers: list[object] = [("CUDAExecutionProvider", device)]
    accel = (json.loads(model.config_json).get("optimization", {}).get("execution_accelerators", {})
             .get("gpu_execution_accelerator", []))
    if any(a.get("name") == "tensorrt" for a in accel):
        if "TensorrtExecutionProvider" not in available:
            raise unavailable("config asks for the tensorrt accelerator but onnxruntime lacks it")
        providers.insert(0, ("TensorrtExecutionProvider", device))
    return providers


def _check_shape(model: ModelSpec, spec: TensorSpec, onnx: tuple[int, ...], kind: str) -> None:
    """A config shape the ONNX model can never take loads as READY and then fails every request:
    refuse it at load. The batch dim (max_batch_size > 0) and dims either side leaves variable (-1)
    always match; an ONNX tensor of rank 0 (a scalar, or no shape recorded) and ragged inputs
    are not checked."""
    if not onnx or spec.allow_ragged_batch:
        return
    batch = [-1] if model.max_batch_size > 0 else []
    full = batch + list(spec.reshape if spec.reshape is not None else spec.dims)
    fits = len(full) == len(onnx) and all(
        c == o or c < 0 or o < 0 for c, o in zip(full[len(batch):], onnx[len(batch):]))
    if not fits:
        where = " (a batch dim for max_batch_size > 0, then its dims)" if batch else ""
        raise invalid_arg(
            f"unable to load model '{model.name}', configuration expects {kind} '{spec.name}' with shape "
            f"{full}{where} but the ONNX model's shape is {list(onnx)}"
        )


class OnnxInstance(ModelInstance):
    def __init__(self, model: ModelContext, instance: InstanceContext) -> None:
        path = model.model_path
        if not path.exists():
            raise unavailable(f"model file '{path}' does not exist")
        try:
            self._session = ort.InferenceSession(
                str(path), sess_options=_session_options(model, instance), providers=_providers(model, instance)
            )
        except PierError:
            raise
        except Exception as exc:  # onnxruntime raises its own exception types
            raise invalid_arg(f"onnxruntime failed to load '{path}': {exc}") from exc
        self._in_types = {i.name: _datatype(i.type, i.name) for i in self._session.get_inputs()}
        self._out_types = {o.name: _datatype(o.type, o.name) for o in self._session.get_outputs()}
        self._all_outputs = list(self._out_types)
        self._check_spec(model)
        self._bf16 = "BF16" in self._in_types.values() or "BF16" in self._out_types.values()
        self._bytes_in = "BYTES" in self._in_types.values()
        self._bytes_out = "BYTES" in self._out_types.values()
        # The session's C++ run, called without the Python wrapper's per-call checks (about a third
        # of a tiny model's run) when those checks cannot matter: CPU provider only (the wrapper's
        # provider fallback is for the others) and every input the model requires is fed (else the
        # wrapper's own error). Everything else goes through InferenceSession.run.
        self._required_inputs = frozenset(i.name for i in self._session.get_inputs()
                                          if not i.type.startswith("optional"))
        sess = getattr(self._session, "_sess", None)
        cpu_only = self._session.get_providers() == ["CPUExecutionProvider"]
        self._raw_run = sess.run if sess is not None and cpu_only else None

    def _check_spec(self, model: ModelContext) -> None:
        """The config must describe tensors the model really has, with its datatypes and shapes."""
        shapes = {t.name: _shape(t.shape) for t in (*self._session.get_inputs(), *self._session.get_outputs())}
        ragged = any(i.allow_ragged_batch for i in model.spec.inputs)  # outputs of a flattened batch
        for specs, actual, kind in ((model.spec.inputs, self._in_types, "input"),
                                    (model.spec.outputs, self._out_types, "output")):
            for spec in specs:
                if spec.name not in actual:
                    raise invalid_arg(
                        f"unable to load model '{model.spec.name}', configuration expects {kind} "
                        f"'{spec.name}' but the ONNX model has {sorted(actual)}"
                    )
                if actual[spec.name] != spec.datatype:
                    raise invalid_arg(
                        f"unable to load model '{model.spec.name}', {kind} '{spec.name}' is "
                        f"{actual[spec.name]} in the ONNX model but {spec.datatype} in the configuration"
                    )
                if not (ragged and kind == "output"):
                    _check_shape(model.spec, spec, shapes[spec.name], kind)

    def execute(self, requests: Sequence[InferenceRequest]) -> list[ExecuteResult]:
        return [self._run_one(r) for r in requests]

    def _run_one(self, request: InferenceRequest) -> ExecuteResult:
        names = [o.name for o in request.outputs] if request.outputs else self._all_outputs
        try:
            if self._bf16:
                values = self._run_ortvalues(request, names)
            else:
                if self._bytes_in:
                    feed = {t.name: _to_ort(t) for t in request.inputs}
                else:
                    feed = {t.name: t.data for t in request.inputs}
                if self._raw_run is not None and self._required_inputs.issubset(feed):
                    values = self._raw_run(names, feed, None)
                else:
                    values = self._session.run(names, feed)
        except PierError as exc:
            return exc
        except Exception as exc:
            code = ErrorCode.INVALID_ARG if "INVALID_ARGUMENT" in str(exc) else ErrorCode.INTERNAL
            return PierError(code, f"onnxruntime error: {exc}")
        out_types = self._out_types
        outputs = []
        for name, value in zip(names, values):
            dt = out_types[name]
            arr = _from_ort(value, dt) if self._bytes_out else np.asarray(value)
            outputs.append(Tensor(name, dt, list(arr.shape), arr))
        return Outputs(outputs)

    def _run_ortvalues(self, request: InferenceRequest, names: list[str]) -> list[np.ndarray]:
        """Path for models with BF16 tensors: numpy has no bfloat16, so feed OrtValues."""
        feed = {}
        for t in request.inputs:
            if t.datatype == "BF16":
                feed[t.name] = ort.OrtValue.ortvalue_from_numpy_with_onnx_type(
                    np.ascontiguousarray(t.data), _ONNX_BF16)
            else:
                feed[t.name] = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(_to_ort(t)))
        outs = self._session.run_with_ort_values(names, feed)
        return [_bf16_bits(ov) if self._out_types[name] == "BF16" else ov.numpy() for name, ov in zip(names, outs)]

    def close(self) -> None:
        del self._session


def _bf16_bits(value: ort.OrtValue) -> np.ndarray:
    """Copy a BF16 OrtValue's 16-bit patterns (numpy has no bfloat16, so .numpy() refuses)."""
    if value.device_name().lower() != "cpu":
        raise internal("BF16 outputs on a GPU instance are not supported by onnxruntime's Python API")
    shape = value.shape()
    count = math.prod(shape)
    buffer = (ctypes.c_uint16 * count).from_address(value.data_ptr())
    return np.ctypeslib.as_array(buffer).copy().reshape(shape)


def _to_ort(tensor: Tensor) -> np.ndarray:
    if tensor.datatype == "BYTES":
        # onnxruntime string tensors take Python str.
        try:
            flat = [b.decode("utf-8") if isinstance(b, bytes) else str(b) for b in tensor.data.reshape(-1)]
        except UnicodeDecodeError as exc:  # onnxruntime would fail the run with it (a 500)
            raise invalid_arg(f"input '{tensor.name}' holds an element that is not UTF-8 text, which an "
                              f"onnxruntime string tensor needs ({exc.reason} at byte {exc.start})") from None
        return np.array(flat, dtype=np.object_).reshape(tensor.data.shape)
    return tensor.data


def _from_ort(value: np.ndarray, datatype: str) -> np.ndarray:
    value = np.asarray(value)
    if datatype == "BYTES":
        out = np.empty(value.shape, dtype=np.object_)
        for idx, v in np.ndenumerate(value):
            out[idx] = v.encode("utf-8", "surrogateescape") if isinstance(v, str) else bytes(v)
        return out
    return value


class OnnxRuntimeBackend(Backend):
    name = "onnxruntime"
    default_model_filename = "model.onnx"

    def describe(self, model_path: Path) -> ModelSignature | None:
        try:
            sess = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
        except Exception as exc:
            raise invalid_arg(f"onnxruntime failed to read '{model_path}': {exc}") from exc
        return ModelSignature(
            inputs=tuple((i.name, _datatype(i.type, i.name), _shape(i.shape)) for i in sess.get_inputs()),
            outputs=tuple((o.name, _datatype(o.type, o.name), _shape(o.shape)) for o in sess.get_outputs()),
        )

    def create_instance(self, model: ModelContext, instance: InstanceContext) -> ModelInstance:
        return OnnxInstance(model, instance)


BACKEND = OnnxRuntimeBackend()
