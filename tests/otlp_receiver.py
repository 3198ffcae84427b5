"""A small OTLP trace receiver for the tests: it decodes what an exporter sends with the
OpenTelemetry protocol's own protobuf messages (opentelemetry-proto's ExportTraceServiceRequest),
over OTLP/HTTP (`POST /v1/traces`, application/x-protobuf, as Triton's exporter and the SDK's
send it) and over OTLP/gRPC (TraceService/Export). Spans come back as plain dicts shaped like the
JSON an OpenTelemetry collector's file exporter writes (what Triton's QA reads)."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def _attributes(items: Any) -> dict[str, Any]:
    return {a.key: _value(a.value) for a in items}


class OtlpReceiver:
    """Collects the spans of every export; `url` (HTTP) and `grpc_url` are where to send them."""

    def __init__(self, keep: bool = True) -> None:
        self.spans: list[dict[str, Any]] = []
        self.keep = keep  # False: count the spans only (a long benchmark)
        self.count = 0
        self.requests = 0
        self._lock = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                ok = self.path == "/v1/traces" and self.headers.get("Content-Type") == "application/x-protobuf"
                if ok:
                    receiver.take(trace_service_pb2.ExportTraceServiceRequest.FromString(body))
                self.send_response(200 if ok else 404)
                out = trace_service_pb2.ExportTraceServiceResponse().SerializeToString() if ok else b""
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args: Any) -> None:
                pass

        self._http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._http.server_address[1]}/v1/traces"
        threading.Thread(target=self._http.serve_forever, daemon=True).start()

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:  # noqa: N802 - the service's name
                receiver.take(request)
                return trace_service_pb2.ExportTraceServiceResponse()

        self._grpc = grpc.server(futures.ThreadPoolExecutor(2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self._grpc)
        port = self._grpc.add_insecure_port("127.0.0.1:0")
        self._grpc.start()
        self.grpc_url = f"http://127.0.0.1:{port}"

    def take(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        if not self.keep:
            with self._lock:
                self.count += sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
                self.requests += 1
            return
        spans = []
        for rs in request.resource_spans:
            resource = _attributes(rs.resource.attributes)
            for ss in rs.scope_spans:
                for s in ss.spans:
                    spans.append({
                        "name": s.name, "traceId": s.trace_id.hex(), "spanId": s.span_id.hex(),
                        "parentSpanId": s.parent_span_id.hex(), "kind": s.kind, "scope": ss.scope.name,
                        "start": s.start_time_unix_nano, "end": s.end_time_unix_nano,
                        "attributes": _attributes(s.attributes), "resource": resource,
                        "events": [{"name": e.name, "time": e.time_unix_nano} for e in s.events]})
        with self._lock:
            self.spans.extend(spans)
            self.count += len(spans)
            self.requests += 1
            self._lock.notify_all()

    def wait(self, count: int, timeout: float = 20.0) -> list[dict[str, Any]]:
        """At least `count` spans (all received so far), or an AssertionError after `timeout`."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while len(self.spans) < count:
                left = deadline - time.monotonic()
                assert left > 0, f"expected {count} spans, got {len(self.spans)}: {[s['name'] for s in self.spans]}"
                self._lock.wait(left)
            return list(self.spans)

    def trace(self, trace_id: str, count: int, timeout: float = 20.0) -> list[dict[str, Any]]:
        """The `count` spans of one trace (waits for them)."""
        deadline = time.monotonic() + timeout
        while True:
            spans = [s for s in self.spans if s["traceId"] == trace_id]
            if len(spans) >= count or time.monotonic() > deadline:
                assert len(spans) == count, f"trace {trace_id}: {[s['name'] for s in spans]}"
                return spans
            time.sleep(0.05)

    def clear(self) -> None:
        with self._lock:
            self.spans.clear()

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()
        self._grpc.stop(0)


def tree(spans: list[dict[str, Any]]) -> dict[str, list[str]]:
    """Parent name -> sorted child names (Triton QA's _verify_nesting)."""
    names = {s["spanId"]: s["name"] for s in spans}
    out: dict[str, list[str]] = {}
    for s in spans:
        if s["parentSpanId"] in names:
            out.setdefault(names[s["parentSpanId"]], []).append(s["name"])
    return {k: sorted(v) for k, v in out.items()}


def main() -> None:
    """`python -m tests.otlp_receiver`: serve until killed (bench/otel.py's collector), printing the
    OTLP/HTTP URL, then on SIGTERM how many spans came."""
    import signal
    import sys

    receiver = OtlpReceiver(keep=False)
    print(receiver.url, flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        while True:
            time.sleep(3600)
    finally:
        print(f"spans received: {receiver.count}", flush=True)
        receiver.close()


if __name__ == "__main__":
    main()
