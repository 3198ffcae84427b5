"""Triton's request tracing (trace extension, `--trace-config`): sampled requests record
timestamps (and, at level TENSORS, their tensors) into a JSON trace file.

Settings are global, and a model may override any of them (an update with `null` drops the
override). Values travel as strings, `trace_level` as a list, as in Triton's API. A request is
traced when its model's level is not OFF, `trace_count` is not used up (-1: unlimited) and it is
the `trace_rate`-th request of that model since the rate was set. Finished traces are buffered and
written as one JSON array per file: every `log_frequency` traces to `<trace_file>.<n>` (n counts
from 0), or, with `log_frequency` 0, to `<trace_file>` itself at shutdown.

Timestamps are the monotonic clock in ns (perf_counter_ns), named as Triton's: the frontend's
(HTTP_RECV_START/END, HTTP_SEND_START/END; GRPC_WAITREAD_START/END, GRPC_SEND_START/END for
gRPC), the server's (REQUEST_START, QUEUE_START, REQUEST_END) and the backend's (COMPUTE_START,
COMPUTE_INPUT_END, COMPUTE_OUTPUT_START, COMPUTE_END). With tracing off, a request costs one
attribute check.

`--trace-config mode=opentelemetry` keeps the same settings, sampling and API, and turns each
sampled request into spans instead (observability/otel.py). There, as in Triton, a request that
carries its caller's W3C `traceparent` is traced whatever the rate and count (when its model's
level is not OFF), `rate=0` on the command line traces only those, and no trace file is needed.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from pier.contract.errors import ErrorCode, PierError, invalid_arg
from pier.observability.otel import OtelConfig, OtelExporter, OtelTrace, parent_context

log = logging.getLogger("pier.trace")

LEVELS = ("OFF", "TIMESTAMPS", "TENSORS")
KEYS = ("trace_level", "trace_rate", "trace_count", "log_frequency", "trace_file")  # Triton's order
DEFAULTS: dict[str, Any] = {"trace_level": ["OFF"], "trace_rate": "1000", "trace_count": "-1",
                            "log_frequency": "0", "trace_file": ""}


@dataclass(slots=True)
class Trace:
    """One traced request: its records in the order they happened, as Triton writes them (one
    object per timestamp; the model's object when the server takes the request)."""

    id: int
    model_name: str
    request_id: str
    timestamps: bool  # level TIMESTAMPS
    tensors: bool  # level TENSORS
    records: list[dict[str, Any]] = field(default_factory=list)
    context: ClassVar[str] = ""  # OpenTelemetry mode's traceparent of the model span: none here

    def child(self, model_name: str, request_id: str) -> None:
        """An ensemble step's trace: in this mode the step is sampled on its own, as before."""
        return None

    def stamp(self, name: str, ns: int | None = None) -> None:
        if self.timestamps:
            self.records.append({"id": self.id, "timestamps": [
                {"name": name, "ns": time.perf_counter_ns() if ns is None else ns}]})

    def start(self, model_version: int) -> None:
        """The server took the request (REQUEST_START)."""
        if self.timestamps:
            head: dict[str, Any] = {"id": self.id, "model_name": self.model_name, "model_version": model_version}
            if self.request_id:
                head["request_id"] = self.request_id
            self.records.append(head)
        self.stamp("REQUEST_START")

    def compute(self, picked_ns: int, start_ns: int, end_ns: int, done_ns: int) -> None:
        """The backend's four timestamps (an instance took the job, inputs ready, execute
        returned, outputs ready)."""
        for name, ns in (("COMPUTE_START", picked_ns), ("COMPUTE_INPUT_END", start_ns),
                         ("COMPUTE_OUTPUT_START", end_ns), ("COMPUTE_END", done_ns)):
            self.stamp(name, ns)

    def tensor(self, activity: str, name: str, datatype: str, shape: list[int], data: np.ndarray) -> None:
        if not self.tensors:
            return
        values = [v.decode("utf-8", "replace") if isinstance(v, bytes) else v for v in data.ravel().tolist()]
        self.records.append({"id": self.id, "activity": activity, "tensor": {
            "name": name, "data": ",".join(str(v) for v in values), "shape": ",".join(str(d) for d in shape),
            "dtype": datatype}})


def _check(key: str, value: Any) -> Any:
    """A setting as the API gives it (string, or list of strings for trace_level), normalised."""
    if key == "trace_level":
        if not isinstance(value, list):
            raise invalid_arg("'trace_level' must be an array of strings (OFF, TIMESTAMPS, TENSORS)")
        if not all(isinstance(v, str) and v in LEVELS for v in value):
            raise invalid_arg(f"invalid value for 'trace_level': {value!r} (expected OFF, TIMESTAMPS or TENSORS)")
        if "OFF" in value and len(set(value)) > 1:
            raise invalid_arg("'trace_level' cannot combine OFF with other levels")
        return ["OFF"] if "OFF" in value else sorted(set(value), key=LEVELS.index)
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if not isinstance(value, str):  # Triton's API carries every value as a string
        raise invalid_arg(f"'{key}' must be a string")
    if key == "trace_file":
        return value
    low = {"trace_rate": 1, "trace_count": -1, "log_frequency": 0}[key]
    try:
        number = int(value)
    except ValueError:
        number = low - 1
    if number > 0xFFFFFFFF:
        raise invalid_arg(f"Unable to parse '{key}'. Value out of range: {value}")  # Triton holds 32 bits
    if number < low:
        raise invalid_arg(f"Unable to parse '{key}'. Expecting value >= {low}, got:{value}")
    return str(number)


class _Scope:
    """The settings of one scope (global, or one model's overrides) and its sampling state."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.values = values
        self.seen = 0  # requests since the rate was set
        self.own_count = False  # a model scope: its trace_count was set for it (else the global one's copy)


class Tracer:
    """`settings` as parse_trace_config gives them (`trace_mode` and `opentelemetry` included)."""

    def __init__(self, settings: dict[str, Any] | None = None) -> None:
        settings = dict(settings or {})
        self.mode: str = settings.pop("trace_mode", "triton")
        otel_config: OtelConfig | None = settings.pop("opentelemetry", None)
        values = dict(DEFAULTS)
        for key, value in settings.items():  # rate=0 is the command line's "traceparent only" (OpenTelemetry)
            values[key] = value if key == "trace_rate" and value == "0" and self.mode != "triton" \
                else _check(key, value)
        self.otel = OtelExporter(otel_config or OtelConfig()) if self.mode == "opentelemetry" else None
        self.propagates = self.otel is not None  # frontends hand on the caller's traceparent
        self._global = _Scope(values)
        self._models: dict[str, _Scope] = {}
        self._ids = itertools.count(1)
        self._buffer: list[dict[str, Any]] = []  # finished traces' records, for the current file
        self._file_index = 0
        self._pending = 0  # traces in the buffer
        self.on = self._active()

    # ---- settings --------------------------------------------------------------------------

    def settings(self, model: str = "") -> dict[str, Any]:
        values = dict(self._global.values)
        if model and model in self._models:
            values.update(self._models[model].values)
        out = {k: (list(v) if isinstance(v, list) else v) for k, v in values.items()}
        if self.otel is None:
            return {**out, "trace_mode": "triton"}
        # as Triton: no trace file or log frequency, then the mode's own settings
        return {**{k: out[k] for k in ("trace_level", "trace_rate", "trace_count")}, "trace_mode": self.mode,
                **self.otel.config.settings()}

    def update(self, changes: dict[str, Any], model: str = "") -> dict[str, Any]:
        """Apply an update (all keys checked first; `None` or an empty list clears a model's
        override, or resets a global setting to its default); return the scope's settings.
        Unknown keys are ignored, as Triton does."""
        checked: dict[str, Any] = {}
        for key, value in changes.items():
            if key in KEYS:
                checked[key] = None if value is None or value == [] else _check(key, value)
        if "trace_file" in checked:  # Triton 2.51 refuses the key whatever its value
            raise PierError(ErrorCode.UNSUPPORTED, "trace file location can not be updated through network protocol")
        current = self.settings(model)
        if self.otel is None and (checked.get("trace_level") or current["trace_level"]) != ["OFF"] \
                and not current["trace_file"]:
            raise invalid_arg("Attempting to set invalid trace setting :trace file name is not given")
        if model:
            if model not in self._models:  # as Triton: a model's override counts its own traces
                self._models[model] = _Scope({"trace_count": self._global.values["trace_count"]})
            scope = self._models[model]
            for key, value in checked.items():
                if value is None:
                    scope.values.pop(key, None)
                else:
                    scope.values[key] = value
            if "trace_count" in checked:
                scope.own_count = checked["trace_count"] is not None
                scope.values.setdefault("trace_count", self._global.values["trace_count"])
            scope.seen = 0
        else:
            for key, value in checked.items():
                self._global.values[key] = DEFAULTS[key] if value is None else value
            self._global.seen = 0
            if "trace_count" in checked:  # as Triton: models that did not set their own get the new count
                for scope in self._models.values():
                    if not scope.own_count:
                        scope.values["trace_count"] = self._global.values["trace_count"]
        self.on = self._active()
        return self.settings(model)

    def _active(self) -> bool:
        scopes = [self._global.values, *({**self._global.values, **m.values} for m in self._models.values())]
        if self.otel is not None:  # a request with a traceparent is traced even with the count used up
            return any(s["trace_level"] != ["OFF"] for s in scopes)
        return any(s["trace_level"] != ["OFF"] and s["trace_count"] != "0" and s["trace_file"] for s in scopes)

    # ---- tracing ---------------------------------------------------------------------------

    def sample(self, model: str, request_id: str = "", context: str = "", root: str = "InferRequest",
               start_ns: int | None = None) -> Trace | OtelTrace | None:
        """A trace for this request if its model's settings sample it (call only when `on`).
        OpenTelemetry mode: `context`, the caller's traceparent, is the root span's parent and
        forces the trace; `root` names the root span, which starts at `start_ns`."""
        scope = self._models.get(model)
        values = {**self._global.values, **scope.values} if scope is not None else self._global.values
        if values["trace_level"] == ["OFF"]:
            return None
        if self.otel is None:
            if values["trace_count"] == "0" or not values["trace_file"] or not self._hit(scope, values):
                return None
            levels = values["trace_level"]
            return Trace(next(self._ids), model, request_id, "TIMESTAMPS" in levels, "TENSORS" in levels)
        parent = parent_context(context)
        if not self._hit(scope, values) and parent is None:
            return None
        return OtelTrace(self.otel, next(self.otel.ids), model, request_id, parent, root, start_ns)

    def _hit(self, scope: _Scope | None, values: dict[str, Any]) -> bool:
        """Count this request against the rate; True when it is the rate-th (and the count allows)."""
        rate = int(values["trace_rate"])
        if rate == 0 or values["trace_count"] == "0":  # OpenTelemetry: only requests with a traceparent
            return False
        counter = scope if scope is not None and "trace_rate" in scope.values else self._global
        counter.seen += 1
        if counter.seen % rate:  # as Triton: the rate-th request, the 2*rate-th, ...
            return False
        if values["trace_count"] != "-1":
            owner = scope if scope is not None and "trace_count" in scope.values else self._global
            owner.values["trace_count"] = str(int(values["trace_count"]) - 1)
            self.on = self._active()
        return True

    def begin(self, request: Any, protocol: str, received_ns: int) -> Trace | OtelTrace | None:
        """A frontend samples `request` (HTTP or GRPC): its trace starts with the frontend's
        receive timestamps; untraced requests are marked so the data plane does not sample them
        again."""
        trace = self.sample(request.model_name, request.id, request.trace_context, start_ns=received_ns) \
            if self.on else None
        if trace is not None:
            start, end = ("HTTP_RECV_START", "HTTP_RECV_END") if protocol == "HTTP" else \
                ("GRPC_WAITREAD_START", "GRPC_WAITREAD_END")
            trace.stamp(start, received_ns)
            trace.stamp(end)
        request.trace = trace if trace is not None else False
        return trace

    def begin_call(self, root: str, model: str, request_id: str, context: str, received_ns: int) -> OtelTrace | None:
        """OpenTelemetry mode: a frontend's own root span for a call it serves with requests of
        its own (the OpenAI API's `llm_request`), sampled by `model`'s settings; each request's
        trace is then `trace.child(...)`. None in Triton's mode or when not sampled."""
        if self.otel is None or not self.on:
            return None
        trace = self.sample(model, request_id, context, root, received_ns)
        return trace if isinstance(trace, OtelTrace) else None

    def child_of(self, context: str, model: str, request_id: str) -> OtelTrace | None:
        """OpenTelemetry mode: the trace of a request made by a model on behalf of another (BLS),
        whose spans hang under `context` (the caller's model span's traceparent)."""
        parent = parent_context(context) if self.otel is not None else None
        if self.otel is None or parent is None:
            return None
        return OtelTrace(self.otel, next(self.otel.ids), model, request_id, parent, None)

    def prometheus(self) -> str:
        """The exporter's span counts (OpenTelemetry mode), for the metrics endpoint."""
        return self.otel.counts.prometheus() if self.otel is not None else ""

    def _value(self, model: str, key: str) -> Any:
        scope = self._models.get(model)
        return scope.values[key] if scope is not None and key in scope.values else self._global.values[key]

    def finish(self, trace: Trace | OtelTrace) -> None:
        if isinstance(trace, OtelTrace):
            trace.end()
            return
        self._buffer += trace.records
        self._pending += 1
        frequency = int(self._value(trace.model_name, "log_frequency"))  # the traced model's setting
        if frequency and (self._pending >= frequency or not self.on):  # as Triton: the last of trace_count too
            self.flush(indexed=True)

    def flush(self, indexed: bool) -> None:
        """Write the buffered traces to `<file>.<n>` (`indexed`, log_frequency set) or `<file>`."""
        if not self._buffer:
            return
        path = self._global.values["trace_file"]
        if indexed:
            path = f"{path}.{self._file_index}"
            self._file_index += 1
        try:
            with open(path, "w") as f:
                json.dump(self._buffer, f)
        except OSError as exc:
            log.error("cannot write trace file '%s': %s", path, exc)
        self._buffer, self._pending = [], 0

    def close(self) -> None:
        """At shutdown: what is left goes to `<file>`, or to the next `<file>.<n>` once any was written
        (OpenTelemetry: to the collector, within a bounded wait)."""
        if self.otel is not None:
            self.otel.shutdown()
            return
        self.flush(indexed=self._file_index > 0 or int(self._global.values["log_frequency"]) > 0)


_CONFIG_KEYS = {"file": "trace_file", "log-frequency": "log_frequency", "rate": "trace_rate",
                "count": "trace_count", "level": "trace_level"}


def parse_trace_config(items: list[str]) -> dict[str, Any]:
    """tritonserver's `--trace-config [<mode>,]key=value` items -> the Tracer's settings (`level`
    may repeat). `mode=opentelemetry` adds `trace_mode` and the `opentelemetry,...` items
    (`opentelemetry`: an OtelConfig); the other mode's items are ignored, as in Triton."""
    settings: dict[str, Any] = {}
    mode = "triton"
    modes: dict[str, list[tuple[str, str]]] = {"triton": [], "opentelemetry": []}
    for item in items:
        spec, scope = item, ""
        if "," in item.split("=", 1)[0]:
            scope, spec = item.split(",", 1)
            if scope not in modes:
                raise ValueError(f"--trace-config: trace mode '{scope}' is not supported "
                                 "(expected triton or opentelemetry)")
        key, sep, value = spec.partition("=")
        if not sep:
            raise ValueError(f"--trace-config: unknown setting '{item}' (expected file, log-frequency, rate, "
                             "count, level or mode)")
        if scope == "opentelemetry":
            modes[scope].append((key, value))
            continue
        if key == "mode" and not scope:
            if value not in modes:
                raise ValueError(f"--trace-config: trace mode '{value}' is not supported "
                                 "(expected triton or opentelemetry)")
            mode = value
            continue
        if key not in _CONFIG_KEYS:
            raise ValueError(f"--trace-config: unknown setting '{item}' (expected file, log-frequency, rate, "
                             "count, level or mode)")
        name = _CONFIG_KEYS[key]
        if name == "trace_level":
            settings.setdefault(name, []).append(value.upper())
        elif name in ("trace_file", "log_frequency"):
            modes["triton"].append((name, value))
        else:
            settings[name] = value
    if mode == "triton":
        settings.update(modes["triton"])
    else:
        for name, _ in modes["triton"]:
            log.warning("--trace-config: '%s' is ignored in the opentelemetry trace mode", name)
        settings["trace_mode"] = mode
        settings["opentelemetry"] = OtelConfig.parse(modes["opentelemetry"])
    try:
        for name, value in settings.items():
            if name in ("trace_mode", "opentelemetry") or (name == "trace_rate" and value == "0" and mode != "triton"):
                continue  # rate=0: trace only the requests that carry a traceparent (Triton's OpenTelemetry mode)
            _check(name, value)
    except PierError as exc:
        raise ValueError(f"--trace-config: {exc.message}") from None
    return settings
