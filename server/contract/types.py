"""The internal types that cross the edges: tensors, requests, responses, tensor specs.

Frontends convert wire formats into these; the planes, schedulers and backends see nothing else.
Tensor data is always a numpy array (object dtype of `bytes` for BYTES, uint16 bits for BF16).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pier.contract.errors import PierError
from pier.contract.policies import BatchingPolicy, SequencePolicy

ParamValue = Any  # bool | int | float | str


@dataclass(slots=True)
class Tensor:
    """A named tensor. `shape` is the API shape (with the batch dim when the model batches)."""

    name: str
    datatype: str
    shape: list[int]
    data: np.ndarray
    parameters: dict[str, ParamValue] = field(default_factory=dict)


@dataclass(slots=True)
class RequestedOutput:
    name: str
    parameters: dict[str, ParamValue] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Outputs:
    """One request's answer, or one response of a decoupled model (see `ResponseSink`).

    `tensors`: the output tensors. `parameters`: response parameters (Triton's InferenceResponse
    parameters: bool, int or str values) that the response carries to the client (the python
    backend's models set them).
    `reschedule`: the request was not answered: its model released it with Triton's RESCHEDULE
    flag (python backend's `set_release_flags`), and the sequence batcher of a model with
    `iterative_sequence` runs it again (tensors and parameters are then empty). Backends set it
    only for such models; the schedulers between the backend and that batcher pass the result
    on unchanged, and nothing else looks at it."""

    tensors: list[Tensor]
    parameters: Mapping[str, bool | int | str] = field(default_factory=dict)
    reschedule: bool = False


ExecuteResult = Outputs | PierError
"""What `ModelInstance.execute` returns per request: its outputs, or an error that fails it alone."""

ResponseSink = Callable[[Outputs | PierError | None, bool], None]
"""`InferenceRequest.response_sink(result, final)`, set by the data plane for decoupled models and
callable from any thread: each call sends one response (`Outputs`: its tensors and parameters,
never `reschedule`; `PierError`: an error, in-band) or, with None, no response at all (the final
flag alone). `final` marks the last call for the request."""


@dataclass(slots=True)
class InferenceRequest:
    """One client request. `model_version` is "" when the client named none."""

    model_name: str
    model_version: str
    inputs: list[Tensor]
    outputs: list[RequestedOutput] = field(default_factory=list)
    id: str = ""
    parameters: dict[str, ParamValue] = field(default_factory=dict)
    # Decoupled models answer through this (from any thread; see pier.contract.backend.ResponseSink).
    # Set by the data plane for models with a decoupled transaction policy.
    response_sink: ResponseSink | None = None
    cancelled: bool = False  # the client went away (decoupled streams): models may stop early
    # Called once, on the server's event loop, when the data plane's stream of this request closes
    # (the client went away, or it ended): a decoupled model cancels its work there instead of
    # polling `cancelled`. A model that sets it after the stream closed finds `cancelled` true.
    on_cancel: Callable[[], object] | None = None
    trace: Any = None  # pier.observability's Trace/OtelTrace when traced; False when its frontend sampled it out
    # The W3C traceparent of the request's caller (OpenTelemetry trace mode): a client's, from the
    # HTTP header or gRPC metadata, or a BLS call's (its caller's `request.trace()`). Once the
    # request is traced, its own model span's: what a model hands on to the requests it makes.
    trace_context: str = ""
    shm_regions: tuple[str, ...] = ()  # shared-memory regions its inputs and outputs name

    def output_names(self) -> list[str]:
        return [o.name for o in self.outputs]


@dataclass(slots=True)
class InferenceResponse:
    model_name: str
    model_version: str
    outputs: list[Tensor]
    id: str = ""
    parameters: dict[str, ParamValue] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One model input or output as the config declares it. `dims` excludes the batch dim;
    -1 is a variable dim. `reshape` is what the framework sees, when it differs from `dims`."""

    name: str
    datatype: str
    dims: tuple[int, ...]
    reshape: tuple[int, ...] | None = None
    optional: bool = False
    allow_ragged_batch: bool = False
    is_shape_tensor: bool = False


@dataclass(frozen=True, slots=True)
class BatchInputSpec:
    """A config `batch_input`: a tensor the server computes from the batch it formed (Triton's
    ragged batching). `kind` is the BatchInput.Kind name; `datatype` is INT32 or FP32."""

    kind: str
    target_names: tuple[str, ...]
    datatype: str
    source_inputs: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class BatchOutputSpec:
    """A config `batch_output`: an output split back per request by a source input's shape
    (kind BATCH_SCATTER_WITH_INPUT_SHAPE, the only kind Triton has)."""

    kind: str
    target_names: tuple[str, ...]
    source_inputs: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class InstanceGroupSpec:
    name: str
    kind: str  # KIND_CPU | KIND_GPU | KIND_MODEL | KIND_AUTO
    count: int
    gpus: tuple[int, ...] = ()


@dataclass(frozen=True)
class ModelSpec:
    """What requests and backends need of a completed model configuration, derived once per load
    (pier.repository.spec) and never mutated; the completed protobuf stays the one source."""

    name: str
    platform: str
    backend: str
    max_batch_size: int
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    instance_groups: tuple[InstanceGroupSpec, ...]
    default_model_filename: str
    parameters: Mapping[str, str]
    decoupled: bool = False
    batch_inputs: tuple[BatchInputSpec, ...] = ()
    batch_outputs: tuple[BatchOutputSpec, ...] = ()
    labels: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # output -> its label_filename's lines
    batching: BatchingPolicy | None = None  # dynamic batching (or a sequence batcher's, across sequences)
    sequence: SequencePolicy | None = None  # sequence_batching: controls and implicit states
    response_cache: bool = False  # response_cache { enable: true } (the server's --cache-config decides)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_inputs_by_name", {t.name: t for t in self.inputs})
        object.__setattr__(self, "_outputs_by_name", {t.name: t for t in self.outputs})

    def input(self, name: str) -> TensorSpec | None:
        return self._inputs_by_name.get(name)  # type: ignore[attr-defined]

    def output(self, name: str) -> TensorSpec | None:
        return self._outputs_by_name.get(name)  # type: ignore[attr-defined]

    @property
    def api_platform(self) -> str:
        """What metadata reports as `platform`: the config platform, else the backend."""
        return self.platform or self.backend

    def api_shape(self, spec: TensorSpec) -> list[int]:
        """Shape shown in metadata: a leading -1 when the model batches."""
        return ([-1] if self.max_batch_size > 0 else []) + list(spec.dims)


@dataclass(frozen=True, slots=True)
class ModelSignature:
    """Inputs and outputs a backend reads from a model file, for auto-complete. Shapes are the
    framework's full shapes (including any batch dim), -1 where variable."""

    inputs: tuple[tuple[str, str, tuple[int, ...]], ...]
    outputs: tuple[tuple[str, str, tuple[int, ...]], ...]
    optional_inputs: tuple[str, ...] = ()  # inputs a request may leave out
    decoupled: bool = False  # the model answers with any number of responses per request
    max_batch_size: int | None = None  # when the model says so itself
    dynamic_batching: bool = False  # the model asks for a dynamic batcher
    shapes_include_batch: bool = True  # False: shapes are config dims (no batch dim), as Triton's python models give
