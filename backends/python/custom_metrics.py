"""pb_utils custom metrics (Triton's python-backend MetricFamily / Metric): counters, gauges and
histograms a model defines, exported on the metrics port while the model that made them is
loaded. Models reach them as `pb_utils.MetricFamily` / `pb_utils.Metric`
(triton_python_backend_utils imports them from here); the python backend renders and releases
each instance's families with render_metric_families / release_metric_families.
"""

from __future__ import annotations

import re
import threading
from typing import Any

from pier.backends.python.errors import TritonModelException
from pier.contract import prometheus

_metrics_lock = threading.Lock()
_families: dict[str, dict[str, Any]] = {}  # name -> the family's shared state
_owner = threading.local()  # the model instance whose initialize/execute/finalize is running


_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


class Metric:
    """One labelled series of a MetricFamily (Triton's pb_utils.Metric): counters `increment`,
    gauges `increment` and `set`, histograms `observe`; `value()` reads it."""

    def __init__(self, family: MetricFamily, labels: dict[str, str], buckets: list[float] | None) -> None:
        for key, value in labels.items():
            if not isinstance(key, str) or not _LABEL_NAME.fullmatch(key):
                raise TritonModelException(f"Invalid label name: '{key}'")
            if not isinstance(value, str):
                raise TritonModelException(f"label '{key}': the value must be a string, got {type(value).__name__}")
        if buckets and any(b >= a for b, a in zip(buckets, buckets[1:])):
            raise TritonModelException("Bucket Boundaries must be strictly sorted.")
        self._family = family
        self._labels = dict(sorted(labels.items()))  # prometheus-cpp (Triton) prints labels by name
        self._value = 0.0
        self._sum = 0.0
        self._count = 0
        self._buckets = [float(b) for b in buckets] if buckets else []
        self._bucket_counts = [0] * len(self._buckets)

    def increment(self, value: float) -> None:
        if self._family._kind == MetricFamily.HISTOGRAM:
            raise TritonModelException("Failed to increment metric value: TRITONSERVER_METRIC_KIND_HISTOGRAM "
                                       "does not support Increment")
        if self._family._kind == MetricFamily.COUNTER and value < 0:
            raise TritonModelException("Failed to increment metric value: TRITONSERVER_METRIC_KIND_COUNTER can "
                                       "only be incremented monotonically by non-negative values.")
        self._value += value

    def set(self, value: float) -> None:
        if self._family._kind != MetricFamily.GAUGE:
            raise TritonModelException(f"Failed to set metric value: {self._family._kind_name()} does not "
                                       "support Set")
        self._value = float(value)

    def observe(self, value: float) -> None:
        if self._family._kind != MetricFamily.HISTOGRAM:
            raise TritonModelException(f"Failed to observe metric value: {self._family._kind_name()} does not "
                                       "support Observe")
        self._sum += value
        self._count += 1
        for i, bound in enumerate(self._buckets):
            if value <= bound:
                self._bucket_counts[i] += 1

    def value(self) -> float:
        if self._family._kind == MetricFamily.HISTOGRAM:
            raise TritonModelException("Failed to get metric value: TRITONSERVER_METRIC_KIND_HISTOGRAM does not "
                                       "support Value")
        return self._value

    def _render(self, name: str) -> str:
        if self._family._kind != MetricFamily.HISTOGRAM:
            return f"{prometheus.series(name, self._labels)} {prometheus.number(self._value)}\n"
        return "".join(prometheus.histogram(name, self._labels, self._buckets, self._bucket_counts, self._sum,
                                            self._count, cumulative=True, count_first=True))


class MetricFamily:
    """A custom metric family (Triton's pb_utils.MetricFamily), exported on the metrics port while
    the model that made it is loaded. A second family of the same name and kind is the same family;
    a Metric with the same labels is the same series."""

    COUNTER = 0
    GAUGE = 1
    HISTOGRAM = 2
    # The shared state (set through __dict__):
    _name: str
    _description: str
    _kind: int
    _metrics: dict[tuple[tuple[str, str], ...], Metric]
    _owners: list[object]

    def __init__(self, name: str, description: str, kind: int) -> None:
        if kind not in (self.COUNTER, self.GAUGE, self.HISTOGRAM):
            raise TritonModelException(f"metric family '{name}': kind must be COUNTER, GAUGE or HISTOGRAM")
        if not isinstance(name, str) or not _METRIC_NAME.fullmatch(name):
            raise TritonModelException(f"Invalid metric name: '{name}'")
        owner = getattr(_owner, "current", None)
        with _metrics_lock:
            state = _families.get(name)
            if state is None:
                state = _families[name] = {"_name": name, "_description": description, "_kind": kind,
                                           "_metrics": {}, "_owners": []}
            elif state["_kind"] != kind:
                raise TritonModelException(f"metric family '{name}' already exists with another kind")
            if owner is not None and owner not in state["_owners"]:
                state["_owners"].append(owner)
        self.__dict__ = state  # every MetricFamily object of this name shares one state

    def Metric(self, labels: dict[str, str] | None = None, buckets: list[float] | None = None) -> Metric:  # noqa: N802
        if self._kind == self.HISTOGRAM and not buckets:
            raise TritonModelException("a histogram metric needs buckets")
        made = Metric(self, labels or {}, buckets)  # checks the labels and buckets
        key = tuple(sorted(made._labels.items()))
        with _metrics_lock:
            metric = self._metrics.setdefault(key, made)
        return metric

    def _kind_name(self) -> str:
        return "TRITONSERVER_METRIC_KIND_" + ("COUNTER", "GAUGE", "HISTOGRAM")[self._kind]

    def _render(self) -> str:
        kind = ("counter", "gauge", "histogram")[self._kind]
        with _metrics_lock:
            metrics = list(self._metrics.values())
        return prometheus.family(self._name, kind, self._description, [m._render(self._name) for m in metrics])


def render_metric_families(owner: object) -> str:
    """The families `owner` (a model instance) is the first holder of, in Prometheus text."""
    with _metrics_lock:
        mine = [f for f in _families.values() if f["_owners"] and f["_owners"][0] is owner]
    parts = []
    for state in mine:
        family = object.__new__(MetricFamily)
        family.__dict__ = state
        parts.append(family._render())
    return "".join(parts)


def release_metric_families(owner: object) -> None:
    """A model instance unloaded: drop it as a holder; families nobody holds disappear."""
    with _metrics_lock:
        for name, state in list(_families.items()):
            if owner in state["_owners"]:
                state["_owners"].remove(owner)
                if not state["_owners"]:
                    del _families[name]
