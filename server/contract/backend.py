"""The backend interfaces (contract version 1). Every backend implements them and imports only
`pier.contract` (this module, `types` and `errors`) and its own folder.

Lifecycle, as Triton's TRITONBACKEND_* API: the server builds one `ModelContext` per model
version, asks the backend for one `ModelInstance` per configured instance, calls
`ModelInstance.execute` with a batch of validated requests (from a worker thread, never on
the event loop; one call at a time per instance), and finally `close()`.

Tensors handed to `execute` already have the shapes the framework expects (config `reshape`
applied, batch dim first when the model batches). `execute` returns, in request order, either
the `Outputs` of that request or a `PierError` that fails that request alone.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

from pier.contract.errors import PierError, invalid_arg
from pier.contract.types import (
    ExecuteResult,
    InferenceRequest,
    InferenceResponse,
    ModelSignature,
    ModelSpec,
)

BACKEND_API_VERSION = 1
MAX_THREADS = 1024  # a thread-count parameter past this is a typo, not a machine: refused at load


def thread_count(raw: object, key: str) -> int:
    """A thread-count config parameter (0: the framework's default), bounded so that a typo
    cannot make a load start threads until memory runs out."""
    try:
        n = int(str(raw))
    except ValueError:
        raise invalid_arg(f"parameter '{key}' must be an integer, got '{raw}'") from None
    if not 0 <= n <= MAX_THREADS:
        raise invalid_arg(f"parameter '{key}' must be between 0 and {MAX_THREADS}, got {n}")
    return n


class ServerServices(Protocol):
    """What the server offers backends that call other models (Triton's BLS). Requests go
    through the data plane: validated, scheduled and counted like a client's."""

    def infer(self, request: InferenceRequest) -> InferenceResponse:
        """Blocking; call from a worker thread (never from the server's event loop)."""

    def infer_stream(self, request: InferenceRequest) -> Iterator[InferenceResponse | PierError]:
        """Blocking iterator over a (decoupled) model's responses (errors in-band)."""

    async def infer_async(self, request: InferenceRequest) -> InferenceResponse:
        """Awaitable from any event loop (a backend's own included)."""

    def infer_stream_async(self, request: InferenceRequest) -> AsyncIterator[InferenceResponse | PierError]:
        """Async iterator over a (decoupled) model's responses, from any event loop."""

    def load_model(self, name: str, parameters: dict[str, Any]) -> None:
        """Blocking explicit-mode load (the repository API's parameters); raises PierError."""

    def unload_model(self, name: str, parameters: dict[str, Any]) -> None:
        """Blocking explicit-mode unload; raises PierError."""

    def model_ready(self, name: str, version: str) -> bool:
        """Whether the model (version) can serve now."""

    @property
    def event_loop(self) -> asyncio.AbstractEventLoop:
        """The server's event loop, where the data plane runs: a backend with async work of its
        own (the LLM backend's response streams) runs it there, so that what it sends reaches
        the frontends without another thread hop."""


def _no_health_sink(instance: str, reason: str | None) -> None:
    """Where health reports go when nobody listens (a backend used outside the server)."""


@dataclass(frozen=True)
class LoadProgress:
    """How far a long step of a load has come, so that "loading 7/12 shards" tells apart from
    "stuck": `stage` says what is being done ("loading weights"), `done` of `total` parts (shards;
    total 0: a step that is not counted), `bytes_done` of `bytes_total` (0: not counted)."""

    stage: str
    done: int = 0
    total: int = 0
    bytes_done: int = 0
    bytes_total: int = 0
    unit: str = "shards"

    def __str__(self) -> str:
        parts = [f"{self.done}/{self.total} {self.unit}"] if self.total else []
        if self.bytes_total:
            unit, size = next(((u, z) for u, z in (("GB", 1 << 30), ("MB", 1 << 20), ("kB", 1 << 10))
                               if self.bytes_total >= z), ("B", 1))
            digits = 1 if size > 1 else 0
            parts.append(f"{self.bytes_done / size:.{digits}f}/{self.bytes_total / size:.{digits}f} {unit}")
        return self.stage + (": " + ", ".join(parts) if parts else "")


def _no_progress_sink(instance: str, progress: LoadProgress) -> None:
    """Where load progress goes when nobody listens (a backend used outside the server)."""


@dataclass(frozen=True)
class ModelContext:
    """What a backend knows about the model version it serves.

    `report_health(instance, reason)`: an instance whose process died (or that cannot serve for
    another reason it finds out on its own) says why; `reason=None` once it serves again (e.g.
    after it restarted its process). Callable from any thread. When every instance of the version
    is unhealthy the version is UNAVAILABLE with that reason (the repository index shows it,
    strict readiness fails, requests get Triton's "no available versions"); one report of None
    brings it back to READY. A reload replaces the version whatever its instances said.

    `report_progress(instance, progress)`: how far a long load has come (weights loading shard by
    shard); callable from any thread, as often as it likes (the server keeps the latest). While the
    version is LOADING its reason says it (the repository index, model ready, the status page), and
    the server shows it on its terminal (a bar) or log (a line per shard)."""

    spec: ModelSpec
    version: int
    model_dir: Path  # <repository>/<model>
    version_dir: Path  # <repository>/<model>/<version>
    config_json: str = "{}"  # the completed model configuration, as Triton's JSON
    services: ServerServices | None = None
    report_health: Callable[[str, str | None], None] = _no_health_sink
    report_progress: Callable[[str, LoadProgress], None] = _no_progress_sink

    @property
    def model_path(self) -> Path:
        """The model file (or folder) named by `default_model_filename`."""
        return self.version_dir / self.spec.default_model_filename


@dataclass(frozen=True)
class InstanceContext:
    """One execution instance: `kind` is KIND_CPU or KIND_GPU (KIND_AUTO is resolved before)."""

    name: str
    kind: str
    device_id: int | None = None


def _not_counted(action: str) -> None:
    """Where an Overload's outcome goes when the instance does not count them."""


@dataclass(frozen=True)
class Overload:
    """Why an instance should start no new request now (an LLM's KV cache past its degrade
    threshold), and what to do instead: serve it with the model `fallback` ("": refuse it with
    UNAVAILABLE and Retry-After `retry_after` whole seconds). Requests already running are not
    touched. The data plane calls `count("fallback" | "refused")` once it acted."""

    reason: str
    retry_after: int = 1
    fallback: str = ""
    count: Callable[[str], None] = _not_counted


Finish = Callable[[list[ExecuteResult]], None]  # an execution's results, given on the event loop


class ModelInstance(abc.ABC):
    """One loaded copy of a model that executes batches.

    `may_run_on_event_loop`: a very fast instance may be run inline on the server's event loop
    (see server/scheduling/instance_pool.py); instances that can block on the server (BLS
    calls) must say False. `unbatched`: give `execute` the queued requests as they are, not
    merged into one batch (Triton's python backend receives a list of requests). Decoupled
    models send their responses through `InferenceRequest.response_sink` (`ResponseSink`) and
    return `Outputs([])` for each request (or a PierError that fails it)."""

    may_run_on_event_loop: ClassVar[bool] = True
    unbatched: ClassVar[bool] = False
    # True when the instance runs its batches elsewhere (its own process) and waits for them on the
    # server's event loop: the scheduler calls `begin_execute` there, with no worker thread
    # between (a thread's two hand-offs and its share of the interpreter lock cost more than the
    # wait). `execute` still works, from any other thread.
    awaits_execute: ClassVar[bool] = False
    # True when overload() may say something: the data plane asks only these (one attribute read
    # per request for every other model)
    degrades: bool = False

    @abc.abstractmethod
    def execute(self, requests: Sequence[InferenceRequest]) -> list[ExecuteResult]:
        """Run `requests`; return one result per request, in order."""

    def begin_execute(self, requests: Sequence[InferenceRequest], finish: Finish) -> None:
        """Start `requests` from the server's event loop (for instances with `awaits_execute`) and
        return at once; `finish(results)` is called on the loop, once, when they are done (one
        result per request, as `execute` returns). Never blocks the loop."""
        raise NotImplementedError(f"{type(self).__name__} does not run its executions elsewhere")

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources. Called once, after the last execute."""

    def prometheus(self, model: str, version: str) -> str:
        """Extra Prometheus text (whole families) this instance exports; "" for none."""
        return ""

    def overload(self, request: InferenceRequest) -> Overload | None:
        """Asked (when `degrades`) before the new `request` is routed here: None admits it; an
        Overload turns it away (see Overload). Cheap: it runs on the server's event loop."""
        return None

    def info(self) -> dict[str, Any]:
        """Facts a frontend may report about the loaded model (the LLM's max_model_len for the
        OpenAI API's /v1/models); {} for none."""
        return {}

    async def reset_prefix_cache(self) -> bool:
        """Forget cached prefixes (the LLM's prefix cache; vLLM's POST /reset_prefix_cache): False
        when it cannot now (requests hold cached blocks), True when done or nothing to forget.
        Called on the server's event loop."""
        return True

    async def update_lora(self, name: str, path: str | None, inplace: bool) -> tuple[int, str]:
        """Load (`path` given) or unload a LoRA adapter (the LLM's; vLLM's /v1/load_lora_adapter and
        /v1/unload_lora_adapter): (HTTP status, vLLM's text). Called on the server's event loop."""
        return 400, "LoRA feature is not enabled."

    def load_report(self) -> dict[str, float]:
        """The instance's load now, for the ORCA `endpoint-load-metrics` header that inference
        gateways read (vLLM's named metrics: the LLM's kv_cache_usage_perc, a fraction, and
        num_requests_waiting); {} for none. Called on the server's event loop: must not block."""
        return {}


class Backend(abc.ABC):
    """A framework adapter. Stateless apart from caches; one object serves every model."""

    name: ClassVar[str]
    default_model_filename: ClassVar[str]

    def describe(self, model_path: Path) -> ModelSignature | None:
        """Inputs/outputs read from the model file, for config auto-complete (None: unknown)."""
        return None

    @abc.abstractmethod
    def create_instance(self, model: ModelContext, instance: InstanceContext) -> ModelInstance:
        """Load the model for one instance. Raise PierError with a clear reason on failure."""
