"""THE backend contract (version 1). Every backend implements it and imports only this module,
`server.types` and `server.errors`.

Lifecycle, as Triton's TRITONBACKEND_* API: the server builds one `ModelContext` per model
version, asks the backend for one `ModelInstance` per configured instance, calls
`ModelInstance.execute` with a batch of validated requests (from a worker thread, never on
the event loop; one call at a time per instance), and finally `close()`.

Tensors handed to `execute` already have the shapes the framework expects (config `reshape`
applied, batch dim first when the model batches). `execute` returns, in request order, either
the output tensors for that request or a `PierError` that fails that request alone.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from server.errors import PierError
from server.types import InferenceRequest, ModelSignature, ModelSpec, Tensor

BACKEND_API_VERSION = 1


@dataclass(frozen=True)
class ModelContext:
    """What a backend knows about the model version it serves."""

    spec: ModelSpec
    version: int
    model_dir: Path  # <repository>/<model>
    version_dir: Path  # <repository>/<model>/<version>

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


ExecuteResult = list[Tensor] | PierError


class ModelInstance(abc.ABC):
    """One loaded copy of a model that executes batches."""

    @abc.abstractmethod
    def execute(self, requests: Sequence[InferenceRequest]) -> list[ExecuteResult]:
        """Run `requests`; return one result per request, in order."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources. Called once, after the last execute."""


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
