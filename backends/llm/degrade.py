"""The KV watermark of one LLM model (issue 34, part 4): `kv_cache_degrade_threshold` (a fraction of
the KV cache; off by default) and `fallback_model` (another LLM model of the same server). While the
KV usage that vllm:kv_cache_usage_perc reports is at or above the threshold, a new request is not
queued into preemption and swapping: the server hands it to the fallback, or refuses it with
UNAVAILABLE and Retry-After (pier.dataplane.degrade does either; this says when, and counts what was
done in pier_llm_degraded_requests_total{model,action}). Requests already running are untouched.

A server-wide default comes from `--backend-config=llm,kv_cache_degrade_threshold=F` (the Helm
chart's `llm.kvCacheDegradeThreshold`); a model's own parameter wins ("off" or "0" turns it off)."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping

from pier.contract import llm, prometheus
from pier.contract.backend import Overload
from pier.contract.types import InferenceRequest

log = logging.getLogger(__name__)

THRESHOLD = "kv_cache_degrade_threshold"
FALLBACK = "fallback_model"
ACTIONS = ("refused", "fallback")
_DEFAULTS: dict[str, str] = {}  # --backend-config=llm,KEY=VALUE
_NOT_GENERATING = (llm.TOKENIZE, llm.DETOKENIZE)  # requests that take no KV: never turned away


def threshold_of(raw: object) -> float | None:
    """A threshold parameter: a fraction in (0, 1]; "", "0" or "off": none. ValueError names it."""
    text = str(raw).strip().lower()
    if text in ("", "0", "off", "false", "none"):
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= 1:
        raise ValueError(f"parameter {THRESHOLD}: {raw!r} is not a fraction of the KV cache in (0, 1] "
                         "(e.g. 0.9; 0 or off: no degrading)")
    return value


def configure(settings: Mapping[str, str]) -> tuple[str, ...]:
    """`--backend-config=llm,...`: the server-wide default threshold; any other key is refused."""
    for key, value in settings.items():
        if key != THRESHOLD:
            raise ValueError(f"--backend-config llm,{key}: the llm backend takes only {THRESHOLD} here "
                             "(the other engine settings are model parameters in config.pbtxt)")
        threshold_of(value)
    _DEFAULTS.update(settings)
    return ()


class Watermark:
    """When one model turns new requests away, and the count of what happened to them. Counts are
    written on the server's loop only (the data plane's routing runs there)."""

    def __init__(self, params: Mapping[str, str], model: str) -> None:
        self.threshold = threshold_of(params.get(THRESHOLD, _DEFAULTS.get(THRESHOLD, "")))
        self.fallback = str(params.get(FALLBACK, "")).strip()
        if self.fallback and self.threshold is None:
            raise ValueError(f"parameter {FALLBACK} needs {THRESHOLD} (the KV usage at which requests go to it)")
        if self.fallback == model:
            raise ValueError(f"parameter {FALLBACK}: '{model}' cannot be its own fallback")
        self.counts = dict.fromkeys(ACTIONS, 0)
        if self.threshold is not None:
            log.info("model '%s': at %g of the KV cache new requests %s", model, self.threshold,
                     f"go to '{self.fallback}'" if self.fallback else "are refused (503, Retry-After)")

    def check(self, usage: float, request: InferenceRequest, retry_after_s: float) -> Overload | None:
        """An Overload when `usage` (the KV fraction in use) is at or above the threshold and the
        request generates; `retry_after_s`: a guess at when blocks free up (whole seconds, >= 1)."""
        if self.threshold is None or usage < self.threshold:
            return None
        for t in request.inputs:
            if t.name in _NOT_GENERATING and t.data.size == 1 and bool(t.data.reshape(-1)[0]):
                return None
        reason = f"its KV cache is {usage:.0%} full (kv_cache_degrade_threshold {self.threshold:g})"
        return Overload(reason, max(1, math.ceil(retry_after_s)), self.fallback, self._count)

    def _count(self, action: str) -> None:
        self.counts[action] += 1

    def render(self, model: str) -> str:
        rows = [f'pier_llm_degraded_requests_total{{model="{model}",action="{a}"}} {n}\n'
                for a, n in self.counts.items()]
        return prometheus.family("pier_llm_degraded_requests", "counter",
                                 "New requests an LLM turned away over its kv_cache_degrade_threshold, by what "
                                 "was done: refused (503 / UNAVAILABLE) or fallback (served by its fallback_model).",
                                 rows)
