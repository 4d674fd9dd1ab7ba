"""A minimal OTLP trace receiver on a loopback port: what `bench overhead --otlp-traces-endpoint
local` exports to, and what the tracing tests read spans from.

:class:`HttpReceiver` answers OTLP/HTTP protobuf ``POST /v1/traces``; :class:`GrpcReceiver` is
the OTLP gRPC ``TraceService``. Both decode each export with opentelemetry-proto's
``ExportTraceServiceRequest`` and keep the spans (``keep=False``: they only count exports and
bytes, decoding nothing). They serve from threads of their own, never from the caller's event
loop: the SDK's final flush at a replica's shutdown blocks, and must not wait on a receiver that
the same loop would have to run.
Needs the `tracing` extra (the proto classes and, for gRPC, grpcio).
"""

from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass(frozen=True, slots=True)
class ReceivedSpan:
    name: str
    trace_id: str  # 32 hex digits
    span_id: str   # 16 hex digits
    parent_span_id: str  # "" for a root span
    kind: int  # opentelemetry.proto.trace.v1.Span.SpanKind
    attributes: dict[str, Any]
    status_code: int  # 0 unset, 1 ok, 2 error
    service: str  # the resource's service.name


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


class _Store:
    def __init__(self, keep: bool) -> None:
        self.keep = keep
        self.spans: list[ReceivedSpan] = []
        self.exports = 0
        self.bytes = 0
        self.count = 0  # spans decoded (keep=True)
        self._lock = threading.Lock()

    def take(self, payload: bytes) -> None:
        if not self.keep:  # counting only: a load generator's receiver must cost nothing
            with self._lock:
                self.exports += 1
                self.bytes += len(payload)
            return
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )

        request = ExportTraceServiceRequest()
        request.ParseFromString(payload)
        got: list[ReceivedSpan] = []
        n = 0
        for rs in request.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                n += len(ss.spans)
                got += [ReceivedSpan(
                    s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(), s.kind,
                    {a.key: _value(a.value) for a in s.attributes}, s.status.code,
                    str(resource.get("service.name", ""))) for s in ss.spans]
        with self._lock:
            self.exports += 1
            self.bytes += len(payload)
            self.count += n
            self.spans += got

    def named(self, name: str) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self.spans if s.name == name]

    def snapshot(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self.spans)


class HttpReceiver(_Store):
    """OTLP/HTTP (protobuf) on ``127.0.0.1``; :attr:`endpoint` is its traces URL."""

    def __init__(self, keep: bool = True) -> None:
        super().__init__(keep)
        store = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                payload = self.rfile.read(length)
                if self.path != "/v1/traces" or \
                        self.headers.get("content-type") != "application/x-protobuf":
                    self.send_response(404)
                    self.send_header("content-length", "0")
                    self.end_headers()
                    return
                store.take(payload)
                self.send_response(200)  # an empty ExportTraceServiceResponse
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-http",
                                        daemon=True)

    def __enter__(self) -> HttpReceiver:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)


class GrpcReceiver(_Store):
    """The OTLP gRPC trace service on ``127.0.0.1``; :attr:`endpoint` is ``http://host:port``
    (plaintext)."""

    def __init__(self, keep: bool = True) -> None:
        super().__init__(keep)
        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

        store = self

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:
                store.take(request.SerializeToString())
                return trace_service_pb2.ExportTraceServiceResponse()

        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self._server)
        port = self._server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{port}"

    def __enter__(self) -> GrpcReceiver:
        self._server.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._server.stop(grace=None).wait(10)
