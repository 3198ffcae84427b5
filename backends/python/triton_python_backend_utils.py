"""`import triton_python_backend_utils as pb_utils`: the utility module of Triton's python
backend, as its documentation defines it, so a model.py written for Triton runs on Pier
unchanged. Pier registers this module under that name in sys.modules before loading models.

Implemented: Tensor (numpy and DLPack), InferenceRequest (inputs, requested outputs, ids,
parameters, response sender, cancellation; and as a BLS request: exec / async_exec, decoupled
too), InferenceResponse, InferenceResponseSender, TritonError, TritonModelException, the
get_*_by_name helpers, type conversions, the decoupled-policy check, Logger, custom
metrics (MetricFamily / Metric: counters, gauges, histograms, on the metrics port; defined in
custom_metrics.py and imported here), and model management from a model (load_model,
unload_model, is_model_ready).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

# custom metrics: the names models use, and the hooks the python backend (and its tests) call
from pier.backends.python.custom_metrics import Metric as Metric
from pier.backends.python.custom_metrics import MetricFamily as MetricFamily
from pier.backends.python.custom_metrics import _families as _families
from pier.backends.python.custom_metrics import _owner as _owner
from pier.backends.python.custom_metrics import release_metric_families as release_metric_families
from pier.backends.python.custom_metrics import render_metric_families as render_metric_families
from pier.backends.python.errors import TritonModelException as TritonModelException

TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_START = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_END = 2
TRITONSERVER_REQUEST_RELEASE_ALL = 1
TRITONSERVER_REQUEST_RELEASE_RESCHEDULE = 2
TRITONSERVER_MEMORY_CPU = 0
TRITONSERVER_MEMORY_CPU_PINNED = 1
TRITONSERVER_MEMORY_GPU = 2


class PreferredMemory:
    """Where a BLS request would like its outputs (accepted; Pier's outputs are host numpy arrays)."""

    def __init__(self, preferred_memory_type: int, preferred_device_id: int = 0) -> None:
        self.preferred_memory_type = preferred_memory_type
        self.preferred_device_id = preferred_device_id

_log = logging.getLogger("pier.python_model")
_bls: Any = None  # pier.backends.python.bls.BlsClient (the server's services), set by the python backend


# ---- errors -----------------------------------------------------------------------------------

class TritonError:
    UNKNOWN = 0
    INTERNAL = 1
    NOT_FOUND = 2
    INVALID_ARG = 3
    UNAVAILABLE = 4
    UNSUPPORTED = 5
    ALREADY_EXISTS = 6
    CANCELLED = 7

    def __init__(self, message: str, code: int = INTERNAL) -> None:
        self._message = str(message)
        self._code = code

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code

    def __repr__(self) -> str:
        return f"TritonError({self._message!r}, code={self._code})"




# ---- tensors ----------------------------------------------------------------------------------

_TRITON_TO_NUMPY: dict[str, Any] = {
    "TYPE_BOOL": np.bool_, "TYPE_UINT8": np.uint8, "TYPE_UINT16": np.uint16, "TYPE_UINT32": np.uint32,
    "TYPE_UINT64": np.uint64, "TYPE_INT8": np.int8, "TYPE_INT16": np.int16, "TYPE_INT32": np.int32,
    "TYPE_INT64": np.int64, "TYPE_FP16": np.float16, "TYPE_FP32": np.float32, "TYPE_FP64": np.float64,
    "TYPE_STRING": np.object_, "TYPE_BF16": np.uint16,
}


def triton_string_to_numpy(triton_type_string: str) -> Any:
    """'TYPE_FP32' (as in model_config JSON) -> numpy dtype."""
    return _TRITON_TO_NUMPY[triton_type_string]


def numpy_to_triton_type(data_type: Any) -> str:
    """numpy dtype -> 'TYPE_...' string."""
    dt = np.dtype(data_type)
    if dt.kind in ("O", "S", "U"):
        return "TYPE_STRING"
    for name, np_type in _TRITON_TO_NUMPY.items():
        if name != "TYPE_BF16" and np.dtype(np_type) == dt:
            return name
    raise TritonModelException(f"unsupported numpy type {dt}")


class Tensor:
    def __init__(self, name: str, data: Any) -> None:
        if not isinstance(data, np.ndarray):
            data = np.asarray(data)
        if data.dtype.kind in ("S", "U"):
            data = np.array([v.encode() if isinstance(v, str) else bytes(v) for v in data.reshape(-1)],
                            dtype=object).reshape(data.shape)
        self._name = name
        self._data = data

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._data

    def shape(self) -> list[int]:
        return list(self._data.shape)

    def is_cpu(self) -> bool:
        return True

    def to_dlpack(self) -> Any:
        if self._data.dtype == np.object_:
            raise TritonModelException("BYTES tensors cannot be exported with DLPack")
        return self._data.__dlpack__()

    @staticmethod
    def from_dlpack(name: str, capsule: Any) -> Tensor:
        """From an object with __dlpack__ (a torch tensor, a numpy array) or a DLPack capsule."""
        if hasattr(capsule, "__dlpack__"):
            if hasattr(capsule, "cpu") and hasattr(capsule, "numpy"):  # torch: avoid the capsule dance
                return Tensor(name, capsule.detach().cpu().numpy())
            return Tensor(name, np.from_dlpack(capsule))
        import torch  # a raw capsule: torch knows how to read one

        return Tensor(name, torch.utils.dlpack.from_dlpack(capsule).cpu().numpy())

    def __repr__(self) -> str:
        return f"Tensor({self._name!r}, shape={self.shape()}, dtype={self._data.dtype})"


# ---- responses --------------------------------------------------------------------------------

class InferenceResponse:
    def __init__(self, output_tensors: list[Tensor] | None = None, error: TritonError | None = None,
                 parameters: dict[str, Any] | str | None = None) -> None:
        self._outputs = list(output_tensors or [])
        self._error = error
        self._parameters = parameters if isinstance(parameters, str) else json.dumps(parameters) if parameters else "{}"

    def output_tensors(self) -> list[Tensor]:
        return self._outputs

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error

    def parameters(self) -> str:
        return self._parameters


class InferenceResponseSender:
    """Decoupled models send any number of responses per request, then the FINAL flag. Other
    models may answer through a sender too (as Triton 23.10+): exactly one response, and the
    FINAL flag (with it, or after it)."""

    def __init__(self, request: InferenceRequest) -> None:
        self._request = request
        self._closed = False

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        if self._closed:
            raise TritonModelException("Unable to send response. Response sender has been closed.")
        final = bool(flags & TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        if response is None and not final:
            raise TritonModelException("a response is required unless the flags say COMPLETE_FINAL")
        self._closed = final
        self._request._send(response, final)

    def is_cancelled(self) -> bool:
        return self._request.is_cancelled()


# ---- requests ---------------------------------------------------------------------------------

class InferenceTrace:
    """A request's trace, as `request.trace()` gives it: hand it to a BLS request
    (`InferenceRequest(..., trace=request.trace())`) and, in the OpenTelemetry trace mode, that
    request's spans hang under this one's. `get_context()`: Triton's JSON
    {"traceparent": "00-<trace id>-<span id>-<flags>"}, or None when the request is not traced."""

    def __init__(self, traceparent: str = "") -> None:
        self._traceparent = traceparent

    def get_context(self, key: str = "") -> str | None:
        return json.dumps({"traceparent": self._traceparent}) if self._traceparent else None


class InferenceRequest:
    """A request a model executes, or (constructed by model code) a BLS request to another model."""

    def __init__(self, model_name: str = "", inputs: list[Tensor] | None = None,
                 requested_output_names: list[str] | None = None, correlation_id: int | str = 0,
                 request_id: str = "", flags: int = 0, timeout: int = 0, model_version: int = -1,
                 preferred_memory: Any = None, trace: Any = None,
                 parameters: dict[str, Any] | str | None = None) -> None:
        # as Triton, names may be bytes (e.g. a BYTES tensor's element): they are UTF-8 text
        self._model_name = model_name.decode() if isinstance(model_name, bytes) else model_name
        self._inputs = list(inputs or [])
        self._requested = [n.decode() if isinstance(n, bytes) else n for n in requested_output_names or []]
        self._correlation_id = correlation_id
        self._request_id = request_id
        self._flags = flags
        self._timeout = timeout
        self._model_version = model_version
        self._traceparent = trace._traceparent if isinstance(trace, InferenceTrace) else ""
        if isinstance(parameters, str):
            parameters = json.loads(parameters) if parameters else {}
        self._parameters: dict[str, Any] = dict(parameters or {})
        self._server_request: Any = None  # server.types.InferenceRequest, for requests we execute
        self._to_result: Any = None  # response -> backend result (set by the backend)
        self._sender: InferenceResponseSender | None = None
        # a model that is not decoupled answering through its sender: the one response, set when final
        self._answer: list[InferenceResponse] = []
        self._answered: threading.Event | None = None  # made with the sender (most requests have none)
        self._release_flags = TRITONSERVER_REQUEST_RELEASE_ALL

    # what a model reads from a request it executes
    def inputs(self) -> list[Tensor]:
        return self._inputs

    def requested_output_names(self) -> list[str]:
        return self._requested

    def request_id(self) -> str:
        return self._request_id

    def correlation_id(self) -> int | str:
        return self._correlation_id

    def flags(self) -> int:
        return self._flags

    def timeout(self) -> int:
        return self._timeout

    def model_name(self) -> str:
        return self._model_name

    def model_version(self) -> int:
        return self._model_version

    def parameters(self) -> str:
        return json.dumps(self._parameters)

    def trace(self) -> InferenceTrace:
        return InferenceTrace(self._traceparent)

    def is_cancelled(self) -> bool:
        return bool(self._server_request is not None and self._server_request.cancelled)

    def get_response_sender(self) -> InferenceResponseSender:
        if self._server_request is None:
            raise TritonModelException("get_response_sender() is only available to requests the model executes")
        if self._sender is None:
            self._answered = threading.Event()
            self._sender = InferenceResponseSender(self)
        return self._sender

    def set_release_flags(self, flags: int) -> None:
        """TRITONSERVER_REQUEST_RELEASE_RESCHEDULE: run this request again (models with
        `sequence_batching { iterative_sequence: true }`; an error for any other)."""
        self._release_flags = int(flags)

    def _send(self, response: InferenceResponse | None, final: bool) -> None:
        sink = self._server_request.response_sink
        if sink is not None:  # decoupled
            sink(None if response is None else self._to_result(response), final)
            return
        if response is not None:
            if self._answer:
                raise TritonModelException("a model that is not decoupled sends one response per request")
            self._answer.append(response)
        if final and self._answered is not None:
            self._answered.set()

    # BLS
    def exec(self, decoupled: bool = False) -> InferenceResponse | Iterator[InferenceResponse]:
        """Run this request on another loaded model and wait (Triton's BLS)."""
        return _require_bls().exec(self, decoupled)

    def async_exec(self, decoupled: bool = False) -> Any:
        """Awaitable form of exec, for `async def execute`."""
        return _require_bls().async_exec(self, decoupled)


def _require_bls() -> Any:
    if _bls is None:
        raise TritonModelException("BLS requests can only be executed inside a running server")
    return _bls


# ---- helpers ----------------------------------------------------------------------------------

def get_input_tensor_by_name(request: InferenceRequest, name: str) -> Tensor | None:
    for t in request.inputs():
        if t.name() == name:
            return t
    return None


def get_output_tensor_by_name(response: InferenceResponse, name: str) -> Tensor | None:
    for t in response.output_tensors():
        if t.name() == name:
            return t
    return None


def get_input_config_by_name(model_config: dict[str, Any], name: str) -> dict[str, Any] | None:
    for cfg in model_config.get("input", []):
        if cfg.get("name") == name:
            return cfg
    return None


def get_output_config_by_name(model_config: dict[str, Any], name: str) -> dict[str, Any] | None:
    for cfg in model_config.get("output", []):
        if cfg.get("name") == name:
            return cfg
    return None


def using_decoupled_model_transaction_policy(model_config: dict[str, Any]) -> bool:
    return bool(model_config.get("model_transaction_policy", {}).get("decoupled", False))


class Logger:
    """pb_utils.Logger.log_info("...") etc.; goes to the server's log."""

    class LogLevel:
        INFO = 0
        WARNING = 1
        ERROR = 2
        VERBOSE = 3

    @staticmethod
    def log(message: str, level: int = 0) -> None:
        _log.log({0: logging.INFO, 1: logging.WARNING, 2: logging.ERROR, 3: logging.DEBUG}.get(level, logging.INFO),
                 "%s", message)

    @staticmethod
    def log_info(message: str) -> None:
        _log.info("%s", message)

    @staticmethod
    def log_warn(message: str) -> None:
        _log.warning("%s", message)

    @staticmethod
    def log_error(message: str) -> None:
        _log.error("%s", message)

    @staticmethod
    def log_verbose(message: str) -> None:
        _log.debug("%s", message)


LogLevel = Logger.LogLevel


# ---- model management (BLS) -----------------------------------------------------------------------

def load_model(model_name: str, config: str = "", files: dict[str, bytes] | None = None) -> None:
    """Load (or reload) a model, as the repository API does: `config` is its ModelConfig as JSON,
    `files` maps "file:<version>/<name>" to contents. Explicit model control mode only; blocking,
    so call it from execute, not from initialize or finalize."""
    parameters: dict[str, Any] = dict(files or {})
    if config:
        parameters["config"] = config
    try:
        _require_bls().services.load_model(model_name, parameters)
    except Exception as exc:
        raise TritonModelException(f"Failed to load the model '{model_name}': {getattr(exc, 'message', exc)}") from None


def unload_model(model_name: str, unload_dependents: bool = False) -> None:
    try:
        _require_bls().services.unload_model(model_name, {"unload_dependents": unload_dependents})
    except Exception as exc:
        raise TritonModelException(f"Failed to unload the model '{model_name}': {getattr(exc, 'message', exc)}") \
            from None


def is_model_ready(model_name: str, model_version: str = "") -> bool:
    if model_version and not (model_version.isdigit() and int(model_version) > 0):
        raise TritonModelException(f"Failed to check the readiness of model '{model_name}': model_version "
                                   "should be an integral value > 0")
    return bool(_require_bls().services.model_ready(model_name, model_version))


class ModelConfig:
    """What `TritonPythonModel.auto_complete_config(auto_complete_model_config)` receives: the
    model's configuration so far, to which the model adds its inputs, outputs and settings."""

    def __init__(self, config: dict[str, Any]) -> None:
        self._config = config
        config.setdefault("input", [])
        config.setdefault("output", [])

    def as_dict(self) -> dict[str, Any]:
        return self._config

    def _add(self, kind: str, tensor: dict[str, Any]) -> None:
        for key in ("name", "data_type", "dims"):
            if key not in tensor:
                raise TritonModelException(f"{kind} '{tensor.get('name', '')}' is missing '{key}'")
        existing = [t for t in self._config[kind] if t.get("name") == tensor["name"]]
        if existing:
            old = existing[0]
            if old.get("data_type") != tensor["data_type"] or list(old.get("dims", [])) != list(tensor["dims"]):
                raise TritonModelException(f"{kind} '{tensor['name']}' already exists in the configuration with a "
                                           "different data_type or dims")
            return
        self._config[kind].append(dict(tensor))

    def add_input(self, input: dict[str, Any]) -> None:  # noqa: A002 - Triton's parameter name
        self._add("input", input)

    def add_output(self, output: dict[str, Any]) -> None:
        self._add("output", output)

    def set_max_batch_size(self, max_batch_size: int) -> None:
        self._config["max_batch_size"] = int(max_batch_size)

    def set_dynamic_batching(self) -> None:
        self._config.setdefault("dynamic_batching", {})

    def set_model_transaction_policy(self, transaction_policy_dict: dict[str, Any]) -> None:
        self._config["model_transaction_policy"] = dict(transaction_policy_dict)

    def add_input_output_names(self) -> None:  # pragma: no cover - accepted for compatibility
        pass
