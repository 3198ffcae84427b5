"""Health, metadata, config, statistics and inference: one method per operation, shared by the
HTTP and gRPC frontends. Takes and returns internal types only."""

from __future__ import annotations

import asyncio
from typing import Any

from server import __version__
from server.errors import PierError, invalid_arg, unavailable, unsupported
from server.lifecycle.loaded_model import LoadedModel
from server.protocol import model_config_pb2 as mc
from server.repository.manager import RepositoryManager
from server.scheduling.base import WorkItem
from server.types import InferenceRequest, InferenceResponse
from server.validation import to_api_outputs, validate_request

SERVER_NAME = "pier"

# What this build implements, in Triton's order and spelling.
EXTENSIONS = ("model_repository", "model_repository(unload_dependents)", "model_configuration",
              "binary_tensor_data", "parameters", "statistics")


class DataPlane:
    def __init__(self, manager: RepositoryManager, strict_readiness: bool) -> None:
        self._manager = manager
        self._strict = strict_readiness
        self._started = False
        self._exiting = False
        self._inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    # ---- server state --------------------------------------------------------------------

    def mark_started(self) -> None:
        self._started = True

    def begin_exit(self) -> None:
        self._exiting = True

    @property
    def exiting(self) -> bool:
        return self._exiting

    async def wait_idle(self) -> None:
        await self._idle.wait()

    def live(self) -> bool:
        if self._exiting:
            raise unavailable("Server exiting")
        return True

    def ready(self) -> bool:
        if self._exiting:
            raise unavailable("Server exiting")
        if not self._started:
            return False
        return self._manager.all_ready() if self._strict else True

    def server_metadata(self) -> dict[str, Any]:
        return {"name": SERVER_NAME, "version": __version__, "extensions": list(EXTENSIONS)}

    # ---- models --------------------------------------------------------------------------

    def _model(self, name: str, version: str) -> LoadedModel:
        if not name:
            raise invalid_arg("a model name is required")
        return self._manager.resolve(name, version)

    def model_ready(self, name: str, version: str = "") -> bool:
        """True when a version can serve; unknown models/versions raise as Triton's lookup does."""
        self._model(name, version)
        return True

    def model_metadata(self, name: str, version: str = "") -> dict[str, Any]:
        model = self._model(name, version)
        spec = model.spec
        versions = [model.version_str] if version else [str(v) for v in self._manager.ready_versions(name)]
        return {
            "name": spec.name,
            "versions": versions,
            "platform": spec.api_platform,
            "inputs": [{"name": t.name, "datatype": t.datatype, "shape": spec.api_shape(t)} for t in spec.inputs],
            "outputs": [{"name": t.name, "datatype": t.datatype, "shape": spec.api_shape(t)} for t in spec.outputs],
        }

    def model_config_json(self, name: str, version: str = "") -> dict[str, Any]:
        return dict(self._model(name, version).spec.config_json)

    def model_config(self, name: str, version: str = "") -> mc.ModelConfig:
        return self._model(name, version).config

    def statistics(self, name: str = "", version: str = "") -> list[dict[str, Any]]:
        """Triton's statistics lookup: all loaded versions, one model's, or one version's."""
        if not name:
            models = self._manager.loaded_models()
        else:
            models = [m for m in self._manager.loaded_models() if m.spec.name == name]
            if not models:
                raise invalid_arg(f"requested model '{name}' is not available")
            if version:
                models = [m for m in models if version.isdigit() and m.version == int(version)]
                if not models:
                    raise invalid_arg(f"requested model version is not available for model '{name}'")
        models.sort(key=lambda m: (m.spec.name, m.version))
        return [m.stats.as_dict(m.spec.name, m.version_str) for m in models]

    # ---- inference -----------------------------------------------------------------------

    async def infer(self, request: InferenceRequest) -> InferenceResponse:
        if self._exiting:
            raise unavailable("Server exiting: no new inference requests are accepted")
        model = self._model(request.model_name, request.model_version)
        spec = model.spec
        if spec.decoupled:
            raise unsupported(
                f"model '{spec.name}' is decoupled: use the streaming API (gRPC ModelStreamInfer)"
            )
        try:
            batch = validate_request(spec, request)
        except PierError:
            model.stats.record_request(False, 0, reason="OTHER")
            raise
        self._inflight += 1
        self._idle.clear()
        try:
            result = await model.scheduler.enqueue(WorkItem(request, batch))
        finally:
            self._inflight -= 1
            if self._inflight == 0:
                self._idle.set()
        if isinstance(result, PierError):
            raise result
        outputs = to_api_outputs(spec, result, batch)
        if request.outputs:
            by_name = {t.name: t for t in outputs}
            outputs = [by_name[o.name] for o in request.outputs if o.name in by_name]
        return InferenceResponse(spec.name, model.version_str, outputs, id=request.id)
