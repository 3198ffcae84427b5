"""Degrade instead of thrash: a model whose instances all say they are overloaded (an LLM whose KV
cache is past its `kv_cache_degrade_threshold`) starts no new request. The request is routed to the
model's fallback when one is named and serves now (the response then names the fallback: the OpenAI
API's `model` field, generate's and gRPC's model_name), else refused with UNAVAILABLE (HTTP 503 and
Retry-After, gRPC UNAVAILABLE). Requests already running are not touched. Every endpoint's requests
pass here (the data plane's routing of a new request), so each is counted once, by the instance that
asked (pier_llm_degraded_requests_total{model,action})."""

from __future__ import annotations

import logging
from collections.abc import Callable

from pier.contract.backend import Overload
from pier.contract.errors import PierError, unavailable
from pier.contract.types import InferenceRequest
from pier.lifecycle.loaded_model import LoadedModel

log = logging.getLogger(__name__)


def _overload(model: LoadedModel, request: InferenceRequest) -> Overload | None:
    """The first instance's Overload when every instance has one (one with room takes the request)."""
    first: Overload | None = None
    for instance in model.instances:
        said = instance.overload(request) if instance.degrades else None
        if said is None:
            return None
        first = first or said
    return first


def admit(model: LoadedModel, request: InferenceRequest, resolve: Callable[[str], LoadedModel]) -> LoadedModel:
    """The model that serves the new `request` for `model`: itself, or its fallback; raises
    UNAVAILABLE (with retry_after) when neither can take it. `resolve` routes a model name."""
    if not model.instances or not model.instances[0].degrades:  # the common case: one attribute read
        return model
    over = _overload(model, request)
    if over is None:
        return model
    why = ""
    if over.fallback:
        try:
            other = resolve(over.fallback)
        except PierError as exc:
            other, why = None, f"; its fallback_model '{over.fallback}' cannot serve: {exc.message}"
        if other is not None and other.spec.backend != model.spec.backend:
            why = f"; its fallback_model '{over.fallback}' is not a {model.spec.backend} model"
        elif other is not None and other is not model:
            if _overload(other, request) is None:
                over.count("fallback")
                return other
            why = f"; its fallback_model '{over.fallback}' is overloaded too"
    over.count("refused")
    log.debug("model '%s' refused a request: %s%s", model.spec.name, over.reason, why)
    raise unavailable(f"model '{model.spec.name}' is overloaded and takes no new requests now: {over.reason}{why}. "
                      f"Retry after {over.retry_after} s.", retry_after=over.retry_after)
