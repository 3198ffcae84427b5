"""Triton's OpenTelemetry trace mode (`--trace-config mode=opentelemetry`): a sampled request
becomes spans, exported with the OpenTelemetry SDK over OTLP (HTTP/protobuf, as Triton; gRPC too).

The span tree is Triton's (core's tracer.cc): a root `InferRequest` span (the frontend's
timestamps as events: HTTP_RECV_START/END or GRPC_WAITREAD_START/END, INFER_RESPONSE_COMPLETE,
HTTP/GRPC_SEND_START/END), under it a span named after the model (REQUEST_START, QUEUE_START,
REQUEST_END; attributes triton.model_name, triton.model_version (an integer), triton.trace_id,
triton.trace_parent_id, triton.request_id when the request has an id) and under that a `compute`
span (COMPUTE_START, COMPUTE_INPUT_END, COMPUTE_OUTPUT_START, COMPUTE_END). An ensemble step or a
BLS call is a child trace: its model span hangs under its caller's model span, with no root of its
own. All spans are SERVER spans of the tracer `triton-server`; timestamps are the monotonic clock
moved to the wall clock once per trace. The caller's W3C `traceparent` is the root's parent.

Spans leave through the SDK's BatchSpanProcessor (`bsp_*` settings): ending a span only puts it in
a bounded queue that a thread of the SDK exports from, so a slow or absent collector never holds
a request. A full queue drops the span; spans whose export failed are lost too. Both are counted
(`pier_trace_spans_dropped_total`, by reason) and an unreachable collector is one warning (and an
info line when it answers again), not a log line per batch.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("pier.trace")

DEFAULT_URL = "http://localhost:4318/v1/traces"  # Triton's default (OTLP/HTTP)
DEFAULT_GRPC_URL = "http://localhost:4317"
BSP_DEFAULTS = {"bsp_max_queue_size": 2048, "bsp_schedule_delay": 5000, "bsp_max_export_batch_size": 512}
PROTOCOLS = ("http/protobuf", "grpc")
KEYS = ("url", "resource", *BSP_DEFAULTS, "protocol")  # `protocol` is Pier's (Triton exports OTLP/HTTP only)
TRACER_NAME = "triton-server"  # Triton's tracer name (kTritonTracer)
SERVICE_NAME = "pier"  # the default service.name (Triton's: triton-inference-server)

# Timestamps that belong to the root span (the frontend's and the responses'); the others to the
# model span, whose REQUEST_END ends it.
ROOT_EVENTS = frozenset({"HTTP_RECV_START", "HTTP_RECV_END", "HTTP_SEND_START", "HTTP_SEND_END",
                         "GRPC_WAITREAD_START", "GRPC_WAITREAD_END", "GRPC_SEND_START", "GRPC_SEND_END",
                         "INFER_RESPONSE_COMPLETE"})
COMPUTE_EVENTS = ("COMPUTE_START", "COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START", "COMPUTE_END")


@dataclass(frozen=True)
class OtelConfig:
    """The `opentelemetry,key=value` items of `--trace-config`, in the order given (the trace
    settings API lists them so, as Triton), checked."""

    items: tuple[tuple[str, str], ...] = ()

    @classmethod
    def parse(cls, items: Sequence[tuple[str, str]]) -> OtelConfig:
        for key, value in items:
            if key not in KEYS:
                raise ValueError(f"--trace-config: unknown setting 'opentelemetry,{key}' (expected "
                                 f"{', '.join(KEYS)})")
            if key in BSP_DEFAULTS and not (value.isdigit() and int(value) <= 0xFFFFFFFF):
                raise ValueError(f"--trace-config: opentelemetry,{key} must be an unsigned integer, got '{value}'")
            if key == "resource" and "=" not in value:
                raise ValueError(f"--trace-config: opentelemetry,resource must be key=value, got '{value}'")
            if key == "protocol" and value not in PROTOCOLS:
                raise ValueError(f"--trace-config: opentelemetry,protocol must be one of {', '.join(PROTOCOLS)}, "
                                 f"got '{value}'")
        config = cls(tuple(items))
        bsp = config.bsp()
        if bsp["bsp_max_export_batch_size"] > bsp["bsp_max_queue_size"]:
            raise ValueError(f"--trace-config: opentelemetry,bsp_max_export_batch_size "
                             f"({bsp['bsp_max_export_batch_size']}) must not exceed bsp_max_queue_size "
                             f"({bsp['bsp_max_queue_size']})")
        return config

    def _last(self, key: str) -> str | None:
        values = [v for k, v in self.items if k == key]
        return values[-1] if values else None

    def protocol(self) -> str:
        return (self._last("protocol") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf")

    def url(self) -> str:
        """`url`, else the SDK's environment variables, else Triton's default; a bare host:port/path
        (Triton's QA writes `localhost:10000/v1/traces`) is http://."""
        url = self._last("url") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        if url is None:
            base = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
            grpc = self.protocol() == "grpc"
            if base:
                url = base if grpc else base.rstrip("/") + "/v1/traces"
            else:
                url = DEFAULT_GRPC_URL if grpc else DEFAULT_URL
        return url if "://" in url else "http://" + url

    def bsp(self) -> dict[str, int]:
        """The batch span processor's settings: flags, else OTEL_BSP_* (as Triton), else defaults."""
        out: dict[str, int] = {}
        for key, default in BSP_DEFAULTS.items():
            value = self._last(key) or os.environ.get("OTEL_" + key.upper())
            out[key] = int(value) if value and value.isdigit() else default
        return out

    def resource(self) -> dict[str, str]:
        return dict(v.split("=", 1) for k, v in self.items if k == "resource")  # type: ignore[misc]

    def settings(self) -> dict[str, str]:
        """What the trace settings API shows (Triton: the mode's items as given, then the bsp_*
        defaults it filled in). Several `resource` items show joined by commas."""
        out: dict[str, str] = {}
        for key, value in self.items:
            out[key] = f"{out[key]},{value}" if key == "resource" and key in out else value
        for key, number in self.bsp().items():
            out.setdefault(key, str(number))
        return out


class SpanCounts:
    """What became of the spans that ended (read by the metrics endpoint)."""

    def __init__(self) -> None:
        self.exported = 0
        self.queue_full = 0  # dropped: the processor's queue was full
        self.export_failed = 0  # lost: the collector refused them or could not be reached

    def prometheus(self) -> str:
        name = "pier_trace_spans_dropped_total"
        return (
            "# HELP pier_trace_spans_exported_total Spans the OpenTelemetry collector accepted.\n"
            "# TYPE pier_trace_spans_exported_total counter\n"
            f"pier_trace_spans_exported_total {self.exported}\n"
            f"# HELP {name} Spans lost on the way to the OpenTelemetry collector, by reason.\n"
            f"# TYPE {name} counter\n"
            f'{name}{{reason="queue_full"}} {self.queue_full}\n'
            f'{name}{{reason="export_failed"}} {self.export_failed}\n')


class _LastMessage(logging.Handler):
    """Keeps the SDK's exporter log lines out of the server's log (one per failed batch, each with
    a retry schedule) and remembers the last one, for the one warning Pier writes."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.text = ""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.text = record.getMessage()
        except Exception:  # noqa: BLE001 - a log line must not fail an export
            self.text = str(record.msg)


class OtelExporter:
    """The SDK pipeline: TracerProvider -> BatchSpanProcessor (counting drops) -> OTLP exporter
    (counting what it sent and lost). Built once at start; `shutdown` at exit waits a bounded time."""

    def __init__(self, config: OtelConfig) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
        from opentelemetry.sdk.trace.sampling import ALWAYS_ON

        self.config = config
        self.ids = itertools.count(1)  # Triton's trace ids (triton.trace_id), one sequence for every trace
        self.counts = counts = SpanCounts()
        self.url = url = config.url()
        protocol = config.protocol()
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc

            inner: Any = Grpc(endpoint=url, insecure=not url.startswith("https://"))
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http

            inner = Http(endpoint=url)
        last = _LastMessage()
        for name in ("opentelemetry.exporter", "opentelemetry.sdk._shared_internal"):
            sdk_log = logging.getLogger(name)
            sdk_log.addHandler(last)
            sdk_log.propagate = False
            # ERROR: the batch processor warns once per span it drops ("Queue full"), a log record
            # per span on the request's thread while the collector is down; Processor counts them.
            sdk_log.setLevel(logging.ERROR)

        class Counting(SpanExporter):
            failing = False

            def export(self, spans: Sequence[Any]) -> Any:
                result = inner.export(spans)
                if result is SpanExportResult.SUCCESS:
                    counts.exported += len(spans)
                    if self.failing:
                        self.failing = False
                        log.info("OpenTelemetry: the collector at %s accepts spans again", url)
                else:
                    counts.export_failed += len(spans)
                    if not self.failing:
                        self.failing = True
                        log.warning("OpenTelemetry: cannot export spans to %s (%s); requests are served as "
                                    "usual, lost spans are counted in pier_trace_spans_dropped_total",
                                    url, last.text or "export failed")
                return result

            def shutdown(self) -> None:
                inner.shutdown()

            def force_flush(self, timeout_millis: int = 30000) -> bool:
                return bool(inner.force_flush(timeout_millis))

        class Processor(BatchSpanProcessor):
            def on_end(self, span: Any) -> None:
                queue = self._batch_processor._queue  # a deque(maxlen=bsp_max_queue_size): full drops one
                if len(queue) == queue.maxlen:
                    counts.queue_full += 1
                super().on_end(span)

        bsp = config.bsp()
        self._processor = Processor(Counting(), max_queue_size=bsp["bsp_max_queue_size"],
                                    schedule_delay_millis=bsp["bsp_schedule_delay"],
                                    max_export_batch_size=bsp["bsp_max_export_batch_size"])
        base = Resource.create({})  # OTEL_RESOURCE_ATTRIBUTES, OTEL_SERVICE_NAME
        named = str(base.attributes.get("service.name", "")).startswith("unknown_service")
        attributes = {**({"service.name": SERVICE_NAME} if named else {}), **config.resource()}
        self._provider = TracerProvider(sampler=ALWAYS_ON, resource=base.merge(Resource(attributes)))
        self._provider.add_span_processor(self._processor)
        self.tracer = self._provider.get_tracer(TRACER_NAME)
        log.info("OpenTelemetry trace mode: spans go to %s (%s)", url, protocol)

    def force_flush(self, timeout_s: float = 10.0) -> bool:
        return bool(self._processor.force_flush(int(timeout_s * 1000)))

    def shutdown(self, timeout_s: float = 2.0) -> None:
        """Export what is queued, waiting at most `timeout_s` (a collector that is down must not
        hold the server's exit)."""
        done = threading.Thread(target=self._provider.shutdown, name="otel-shutdown", daemon=True)
        done.start()
        done.join(timeout_s)


def traceparent(span: Any) -> str:
    """The W3C traceparent of a span (what a child in another process, or a BLS call, is given)."""
    sc = span.get_span_context()
    return f"00-{sc.trace_id:032x}-{sc.span_id:016x}-{int(sc.trace_flags):02x}"


def parent_context(value: str) -> Any:
    """An OpenTelemetry Context from a W3C traceparent (None when there is none or it is invalid:
    the trace then starts here)."""
    if not value:
        return None
    from opentelemetry import trace as api
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    ctx = TraceContextTextMapPropagator().extract({"traceparent": value})
    return ctx if api.get_current_span(ctx).get_span_context().is_valid else None


class OtelTrace:
    """One traced request in OpenTelemetry mode, with the Trace interface the data plane and the
    schedulers stamp (tracing.Trace). `root`: the root span's name (InferRequest; a frontend's own,
    such as the OpenAI API's llm_request), None for a child trace, whose spans hang under `parent`."""

    __slots__ = ("_otel", "_offset", "_parent", "id", "parent_id", "model_name", "request_id", "root", "model",
                 "context")
    timestamps = True
    tensors = False  # Triton's OpenTelemetry mode records no tensors

    def __init__(self, otel: OtelExporter, trace_id: int, model_name: str, request_id: str, parent: Any,
                 root: str | None, start_ns: int | None = None, parent_id: int = 0) -> None:
        from opentelemetry.trace import SpanKind, set_span_in_context

        self._otel = otel
        self._offset = time.time_ns() - time.perf_counter_ns()  # monotonic -> wall clock, as Triton's time_offset_
        self.id, self.parent_id, self.model_name, self.request_id = trace_id, parent_id, model_name, request_id
        self.root: Any = None
        if root is not None:
            start = time.perf_counter_ns() if start_ns is None else start_ns
            self.root = otel.tracer.start_span(root, context=parent, kind=SpanKind.SERVER,
                                               start_time=start + self._offset)
            parent = set_span_in_context(self.root)
        self._parent = parent
        self.model: Any = None
        self.context = ""  # the model span's traceparent, once it started

    def __bool__(self) -> bool:
        return True

    def _span(self, name: str, start_ns: int, attributes: Mapping[str, Any] | None = None) -> Any:
        from opentelemetry.trace import SpanKind, set_span_in_context

        parent = set_span_in_context(self.model) if self.model is not None and name == "compute" else self._parent
        return self._otel.tracer.start_span(name, context=parent, kind=SpanKind.SERVER,
                                            start_time=start_ns + self._offset, attributes=attributes)

    def stamp(self, name: str, ns: int | None = None) -> None:
        ns = time.perf_counter_ns() if ns is None else ns
        span = self.root if name in ROOT_EVENTS else self.model
        if span is None:  # a child trace has no root: its frontend's stamps are its caller's
            return
        span.add_event(name, timestamp=ns + self._offset)
        if name == "REQUEST_END" and span is self.model:
            span.end(end_time=ns + self._offset)

    def start(self, model_version: int) -> None:
        """The server took the request: the model span opens (REQUEST_START)."""
        now = time.perf_counter_ns()
        attributes: dict[str, Any] = {"triton.model_name": self.model_name, "triton.model_version": model_version,
                                      "triton.trace_id": self.id, "triton.trace_parent_id": self.parent_id}
        if self.request_id:
            attributes["triton.request_id"] = self.request_id
        self.model = self._span(self.model_name, now, attributes)
        self.model.add_event("REQUEST_START", timestamp=now + self._offset)
        self.context = traceparent(self.model)

    def compute(self, picked_ns: int, start_ns: int, end_ns: int, done_ns: int) -> None:
        span = self._span("compute", picked_ns)
        for name, ns in zip(COMPUTE_EVENTS, (picked_ns, start_ns, end_ns, done_ns), strict=True):
            span.add_event(name, timestamp=ns + self._offset)
        span.end(end_time=done_ns + self._offset)

    def tensor(self, activity: str, name: str, datatype: str, shape: list[int], data: Any) -> None:
        pass

    def child(self, model_name: str, request_id: str) -> OtelTrace:
        """The trace of a request this one makes (an ensemble step): under its model span."""
        from opentelemetry.trace import set_span_in_context

        parent = set_span_in_context(self.model) if self.model is not None else self._parent
        return OtelTrace(self._otel, next(self._otel.ids), model_name, request_id, parent, None, parent_id=self.id)

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        """Attributes of the root span (a frontend's: the OpenAI API's GenAI attributes)."""
        if self.root is not None:
            self.root.set_attributes(attributes)

    def end(self, ns: int | None = None) -> None:
        """The request is answered: the root span ends (a child trace's spans ended with REQUEST_END)."""
        if self.root is not None:
            self.root.end(end_time=(time.perf_counter_ns() if ns is None else ns) + self._offset)
