"""Traffic routing: one immutable snapshot per model, published whole by the life cycle on every
change, so that a request reads one consistent view (the versions that serve, their weights and
specs). The data plane resolves a request's version once, here; everything after that
(decoding against the model's signature, validation, scheduling, statistics) uses that version.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from pier.contract.errors import invalid_arg, not_found, unavailable
from pier.lifecycle.loaded_model import LoadedModel
from pier.repository.source import is_version, model_name

_EMPTY: Mapping[int, LoadedModel] = MappingProxyType({})


@dataclass(frozen=True)
class Route:
    """What requests to one model see. `versions`: every version the life cycle knows (READY or
    not: a known version that is not READY is 'not at ready state', an unknown one 'not found');
    `ready`: those that serve; `weighted` / `cumulative`: the rollout split of unversioned
    traffic (empty: the newest READY version takes it all)."""

    name: str
    versions: frozenset[int] = frozenset()
    ready: Mapping[int, LoadedModel] = field(default_factory=lambda: _EMPTY)
    weighted: tuple[LoadedModel, ...] = ()
    cumulative: tuple[float, ...] = ()
    failed: bool = False  # a model-level failure (bad config): known, with no version to serve
    healthy: bool = True  # strict readiness: no version of it failed (unloaded on purpose is fine)
    why: str = ""  # why the versions that are not READY are not, in words (a request then says so)

    @classmethod
    def build(cls, name: str, versions: frozenset[int], ready: dict[int, LoadedModel],
              weights: dict[int, float], failed: bool = False, healthy: bool = True, why: str = "") -> Route:
        """The snapshot for `ready` versions split by `weights` (only READY versions with weight > 0)."""
        models, cumulative, total = [], [], 0.0
        for v in sorted(v for v, w in weights.items() if v in ready and w > 0):
            total += weights[v]
            models.append(ready[v])
            cumulative.append(total)
        return cls(name, versions, MappingProxyType(dict(ready)), tuple(models), tuple(cumulative), failed,
                   healthy, why)

    @property
    def known(self) -> bool:
        return bool(self.versions) or self.failed

    @property
    def newest(self) -> LoadedModel | None:
        return self.ready[max(self.ready)] if self.ready else None

    def pick(self, version: str = "") -> LoadedModel:
        """Triton's lookup: the named version if READY; else one drawn by the rollout weights, or
        the newest READY one. Raises as Triton does."""
        if version:
            v = int(version)
            if v not in self.versions:
                raise not_found(f"Request for unknown model: '{model_name(self.name)}' version {version} is not found")
            model = self.ready.get(v)
            if model is None:
                raise unavailable(f"Request for unknown model: '{model_name(self.name)}' version {version} is not "
                                  "at ready state")
            return model
        if self.weighted:
            i = bisect.bisect_right(self.cumulative, random.random() * self.cumulative[-1])
            return self.weighted[min(i, len(self.weighted) - 1)]
        newest = self.newest
        if newest is None:  # Triton's words, then why (a stub that died and restarts, a failed load, ...)
            raise not_found(f"Request for unknown model: '{model_name(self.name)}' has no available versions"
                            + (f" ({self.why})" if self.why else ""))
        return newest

    def traffic(self) -> dict[int, float]:
        """Percent of unversioned traffic per version."""
        if not self.weighted:
            newest = self.newest
            return {newest.version: 100.0} if newest is not None else {}
        total, prev, out = self.cumulative[-1], 0.0, {}
        for model, c in zip(self.weighted, self.cumulative):
            out[model.version] = round(100.0 * (c - prev) / total, 2)
            prev = c
        return out


class RoutingTable:
    """Model name -> its current Route. Replacing a dict entry is atomic for the event loop and
    for worker threads alike: a reader holds either the old snapshot or the new one."""

    def __init__(self) -> None:
        self._routes: dict[str, Route] = {}
        self._keys: dict[str, set[str]] = {}  # --model-namespacing: model name -> the keys that hold it

    def publish(self, route: Route) -> None:
        self._routes[route.name] = route
        name = model_name(route.name)
        if name != route.name:
            self._keys.setdefault(name, set()).add(route.name)

    def route(self, name: str) -> Route | None:
        return self._routes.get(name)

    def key(self, name: str) -> str:
        """The key a model name (or key) reaches. With --model-namespacing a name reaches the one
        namespace that serves it; a name in several is ambiguous (Triton's words), and a key whose
        namespace lost the model falls back to its name (an ensemble step then calls the other
        namespace's model, as Triton re-links it)."""
        route = self._routes.get(name)
        if route is not None and route.ready:
            return name
        plain = model_name(name)
        keys = self._keys.get(plain)
        if keys:
            serving = sorted(k for k in keys if self._routes[k].ready)
            if len(serving) == 1:
                return serving[0]
            known = serving or ([] if route is not None and route.known else sorted(k for k in keys
                                                                                      if self._routes[k].known))
            if len(known) > 1:
                raise invalid_arg(f"There are {len(known)} identifiers of model '{plain}' in global map, model "
                                  "namespace must be provided to resolve ambiguity.")
            if known:
                return known[0]
        if route is not None and route.known:
            return name
        raise not_found(f"Request for unknown model: '{plain}' is not found")

    def resolve(self, name: str, version: str = "") -> LoadedModel:
        """The one routing decision of a request (an empty name is an unknown model, as in Triton)."""
        if version and not is_version(version):  # as Triton, before the model lookup
            raise invalid_arg(f"failed to get model version from specified version string '{version}' "
                              "(details: stol), version should be an integral value > 0")
        route = self._routes.get(name)
        if route is None or not route.ready:
            route = self._routes[self.key(name)]
        return route.pick(version)

    def ready_versions(self, name: str) -> list[int]:
        route = self._routes.get(name)
        return sorted(route.ready) if route is not None else []

    def all_ready(self) -> bool:
        """Strict readiness: no model asked for failed."""
        return all(route.healthy for route in list(self._routes.values()))

    def loaded_models(self) -> list[LoadedModel]:
        """Every READY version of every model."""
        return [m for route in list(self._routes.values()) for m in route.ready.values()]
