"""TorchScript backend, as Triton's PyTorch (libtorch) backend: one `torch.jit` module per instance.

Tensor mapping, decided once at load from the config and forward()'s signature (Triton's rules):
  inputs   a `forward(self, inputs: Dict[str, Tensor])` gets every input in one dict, by name;
           else, when every config input is a forward() argument name, by name;
           else, when every config input is named `<name>__<index>` (INPUT__0, ...), by position;
           else by position in config order.
  outputs  a model that returns a dict: by key;
           else, when every config output is named `<name>__<index>` (OUTPUT__0, ...), by the
           index into the returned tuple; else in config order.
KIND_GPU instances load onto cuda:<device_id> and run on a CUDA stream of their own.
Config parameters (Triton's names; lower-case spellings accepted):
  INTRA_OP_THREAD_COUNT        torch.set_num_threads, applied on the thread that runs the instance
  INFERENCE_MODE               default true (torch.inference_mode); false runs under torch.no_grad
  DISABLE_OPTIMIZED_EXECUTION  true turns the TorchScript graph executor's optimizations off
torch is optional (`pip install pier[torch]`): without it only the models that need it fail.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pier.contract.backend import Backend, InstanceContext, ModelContext, ModelInstance, thread_count
from pier.contract.errors import PierError, internal, invalid_arg, unavailable
from pier.contract.types import ExecuteResult, InferenceRequest, ModelSignature, ModelSpec, Outputs, Tensor

try:
    import torch
except ImportError as exc:  # optional dependency: fail only the TorchScript models
    torch = None  # type: ignore[assignment]
    _IMPORT_ERROR: str = str(exc)
else:
    _IMPORT_ERROR = ""

# KServe datatype -> torch dtype name (BYTES and the wide unsigned types have no TorchScript tensor).
_TORCH_TYPES = {
    "BOOL": "bool", "UINT8": "uint8", "INT8": "int8", "INT16": "int16", "INT32": "int32",
    "INT64": "int64", "FP16": "float16", "FP32": "float32", "FP64": "float64", "BF16": "bfloat16",
}
_DELIMITER = "__"


def _torch_dtype(datatype: str) -> Any:
    return getattr(torch, _TORCH_TYPES[datatype])


def _named_index(name: str) -> int | None:
    """The index of a `<name>__<index>` tensor name (Triton splits at the first `__`), else None."""
    pos = name.find(_DELIMITER)
    if pos < 0:
        return None
    digits = name[pos + len(_DELIMITER):]
    return int(digits) if digits.isdigit() else None


def _param(spec: ModelSpec, key: str) -> str | None:
    for k in (key, key.lower()):
        if k in spec.parameters and spec.parameters[k].strip():
            return spec.parameters[k].strip()
    return None


def _bool_param(spec: ModelSpec, key: str, default: bool) -> bool:
    raw = _param(spec, key)
    if raw is None:
        return default
    if raw.lower() in ("true", "1", "yes", "on"):
        return True
    if raw.lower() in ("false", "0", "no", "off"):
        return False
    raise invalid_arg(f"parameter '{key}' must be true or false, got '{raw}'")


def _thread_count(spec: ModelSpec) -> int | None:
    raw = _param(spec, "INTRA_OP_THREAD_COUNT")
    if raw is None:
        return None
    return thread_count(raw, "INTRA_OP_THREAD_COUNT") or None  # 0: torch's default, as in Triton


def _check_datatypes(spec: ModelSpec) -> None:
    for kind, tensors in (("input", spec.inputs), ("output", spec.outputs)):
        for t in tensors:
            if t.datatype not in _TORCH_TYPES:
                why = (" (strings are not TorchScript tensors)" if t.datatype == "BYTES"
                       else " (torch has no tensors of that type)")
                raise invalid_arg(
                    f"unable to load model '{spec.name}': {kind} '{t.name}' is {t.datatype}{why}; the "
                    f"PyTorch backend supports {', '.join(_TORCH_TYPES)}"
                )


def _input_arguments(spec: ModelSpec, schema: Any) -> tuple[bool, dict[str, str]]:
    """(dict input?, config input name -> forward() argument name), by Triton's naming rules."""
    args = list(schema.arguments)[1:]  # [0] is self
    names = [t.name for t in spec.inputs]
    if len(args) == 1 and args[0].type.kind() == "DictType":
        return True, {}
    arg_names = [a.name for a in args]
    if all(n in arg_names for n in names):
        mapping = {n: n for n in names}
    else:
        indices = [_named_index(n) for n in names]
        if all(i is not None for i in indices):
            positions = dict(zip(names, indices))
            if len(set(indices)) != len(indices):
                raise invalid_arg(f"unable to load model '{spec.name}': two inputs have the same "
                                  f"__<index> ({names})")
        else:
            positions = {n: i for i, n in enumerate(names)}
        for n, i in positions.items():
            if i is None or i >= len(args):
                raise invalid_arg(
                    f"unable to load model '{spec.name}': input '{n}' is argument {i} but the model's "
                    f"forward() takes {len(args)} ({', '.join(arg_names) or 'none'})"
                )
        mapping = {n: args[i].name for n, i in positions.items() if i is not None}
    covered = set(mapping.values())
    for a in args:
        if a.name not in covered and not a.has_default_value():
            raise invalid_arg(
                f"unable to load model '{spec.name}': forward() argument '{a.name}' has no default and no "
                f"configured input maps to it (configured: {', '.join(names)}; forward() takes "
                f"{', '.join(arg_names)}). Name the inputs after forward()'s arguments or INPUT__<index>."
            )
    return False, mapping


def _output_indices(spec: ModelSpec) -> dict[str, int]:
    """Config output name -> index into the returned tuple (when the model returns no dict)."""
    names = [t.name for t in spec.outputs]
    indices = [_named_index(n) for n in names]
    if all(i is not None for i in indices):
        return {n: i for n, i in zip(names, indices) if i is not None}
    return {n: i for i, n in enumerate(names)}


def _to_torch(tensor: Tensor, device: Any) -> Any:
    arr = tensor.data
    if tensor.datatype == "BF16":
        arr = arr.view(np.int16)  # same 16-bit patterns; torch has no uint16 -> bfloat16 view
    if not (arr.flags.writeable and arr.flags.c_contiguous):
        arr = np.array(arr, order="C")  # torch cannot wrap read-only or strided numpy memory
    value = torch.from_numpy(arr)
    if tensor.datatype == "BF16":
        value = value.view(torch.bfloat16)
    return value if device.type == "cpu" else value.to(device)


def _to_numpy(value: Any, name: str, datatype: str) -> np.ndarray:
    if not isinstance(value, torch.Tensor):
        raise internal(f"output '{name}' is a {type(value).__name__}, not a tensor")
    if value.dtype != _torch_dtype(datatype):
        raise internal(f"configuration expects datatype {datatype} for output '{name}', model provides "
                       f"{str(value.dtype).removeprefix('torch.')}")
    value = value.detach().cpu().contiguous()
    if datatype == "BF16":
        return value.view(torch.int16).numpy().view(np.uint16)
    return value.numpy()


class TorchScriptInstance(ModelInstance):
    def __init__(self, model: ModelContext, instance: InstanceContext) -> None:
        spec = model.spec
        _check_datatypes(spec)
        path = model.model_path
        if not path.exists():
            raise unavailable(f"model file '{path}' does not exist")
        self._device, self._stream = _device(instance)
        self._threads = _thread_count(spec)
        self._inference_mode = _bool_param(spec, "INFERENCE_MODE", True)
        self._optimized = not _bool_param(spec, "DISABLE_OPTIMIZED_EXECUTION", False)
        self._apply_threads()
        try:
            module = torch.jit.load(str(path), map_location=self._device)
        except Exception as exc:  # torch raises RuntimeError/ValueError with a long trace
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise invalid_arg(
                f"unable to load model '{spec.name}': '{path}' is not a TorchScript archive that torch "
                f"{torch.__version__} can read (save one with torch.jit.save after torch.jit.script or "
                f"torch.jit.trace): {first}"
            ) from exc
        module.eval()
        self._module = module
        self._dict_input, self._arg_of = _input_arguments(spec, module.forward.schema)
        self._out_index = _output_indices(spec)
        self._outputs = {t.name: t.datatype for t in spec.outputs}

    def _apply_threads(self) -> None:
        # torch's intra-op thread count is per calling thread once initialised: set it where we run.
        if self._threads and torch.get_num_threads() != self._threads:
            torch.set_num_threads(self._threads)

    @contextlib.contextmanager
    def _guards(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.inference_mode() if self._inference_mode else torch.no_grad())
            if not self._optimized:
                stack.enter_context(torch.jit.optimized_execution(False))
            if self._stream is not None:
                stack.enter_context(torch.cuda.device(self._device))
                stack.enter_context(torch.cuda.stream(self._stream))
            yield

    def execute(self, requests: Sequence[InferenceRequest]) -> list[ExecuteResult]:
        self._apply_threads()
        return [self._run_one(r) for r in requests]

    def _run_one(self, request: InferenceRequest) -> ExecuteResult:
        try:
            with self._guards():
                feeds = {t.name: _to_torch(t, self._device) for t in request.inputs}
                if self._dict_input:
                    result = self._module(feeds)
                else:
                    result = self._module(**{self._arg_of[name]: value for name, value in feeds.items()})
                return Outputs(self._collect(result, request.output_names() or list(self._outputs)))
        except PierError as exc:
            return exc
        except Exception as exc:  # the model's own errors (shapes, dtypes, raise in forward())
            return internal(f"PyTorch execute failure: {str(exc).strip()}")

    def _collect(self, result: Any, names: list[str]) -> list[Tensor]:
        values: list[Any] = []
        if isinstance(result, Mapping):
            for name in names:
                if name not in result:
                    raise internal(f"output '{name}' is not among the keys the model returned "
                                   f"({', '.join(sorted(map(str, result)))})")
                values.append(result[name])
        else:
            returned = list(result) if isinstance(result, (tuple, list)) else [result]
            for name in names:
                index = self._out_index[name]
                if index >= len(returned):
                    raise internal(f"output '{name}' is the model's output {index} but it returned "
                                   f"{len(returned)}")
                values.append(returned[index])
        outputs = []
        for name, value in zip(names, values):
            arr = _to_numpy(value, name, self._outputs[name])
            outputs.append(Tensor(name, self._outputs[name], list(arr.shape), arr))
        return outputs

    def close(self) -> None:
        del self._module
        self._stream = None


def _device(instance: InstanceContext) -> tuple[Any, Any]:
    """(torch device, CUDA stream or None) for an instance."""
    if instance.kind != "KIND_GPU":
        return torch.device("cpu"), None
    if not torch.cuda.is_available():
        raise unavailable(
            f"instance '{instance.name}' is KIND_GPU but torch {torch.__version__} cannot use CUDA "
            "(a CPU-only build of torch, or no NVIDIA driver/GPU visible); install a CUDA build of torch "
            "or use kind: KIND_CPU"
        )
    index = instance.device_id or 0
    if index >= torch.cuda.device_count():
        raise unavailable(f"instance '{instance.name}' asks for GPU {index} but torch sees "
                          f"{torch.cuda.device_count()} CUDA device(s)")
    device = torch.device("cuda", index)
    return device, torch.cuda.Stream(device=device)


class PyTorchBackend(Backend):
    name = "pytorch"
    default_model_filename = "model.pt"

    def describe(self, model_path: Path) -> ModelSignature | None:
        """TorchScript archives do not record tensor names, datatypes or shapes, so there is
        nothing to auto-complete from: say so, instead of a generic 'no inputs' error."""
        raise invalid_arg(
            f"cannot auto-complete the configuration from '{model_path}': TorchScript models do not "
            "record their inputs' and outputs' names, datatypes and shapes, so config.pbtxt must list "
            "every input and output (as Triton's PyTorch backend requires)"
        )

    def create_instance(self, model: ModelContext, instance: InstanceContext) -> ModelInstance:
        if torch is None:
            raise unavailable(
                f"backend 'pytorch' is not available: {_IMPORT_ERROR}; install pier[torch] to serve "
                "TorchScript models"
            )
        return TorchScriptInstance(model, instance)


BACKEND = PyTorchBackend()
