"""OpenTelemetry tracing of the request path, off unless `serve --otlp-traces-endpoint URL`.

With the flag, every inference request (``POST /v1/...``) is one server span that continues the
client's W3C ``traceparent`` when it sent one, with children for each routing decision (its cost
terms as attributes, and a ``jetrouter.queue`` child when it waited in the router queue), each
hop to an engine (the prefill hop, the decode or aggregated hop, passthrough hops; the hop's
``traceparent`` goes to the engine, so an engine that traces, such as vLLM with its own
``--otlp-traces-endpoint``, adds its spans to the same trace) and each migration. Spans are
batched and exported over OTLP; ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` (else
``OTEL_EXPORTER_OTLP_PROTOCOL``) picks ``http/protobuf`` (the OpenTelemetry default) or ``grpc``.

The OpenTelemetry SDK and exporters are the optional ``tracing`` extra, imported only when
:class:`Tracing` is built. Without the flag nothing here runs on the request path but a
``ContextVar.get`` per hop (:func:`start_hop`) and ``Replica.tracer is None`` per decision:
this router is measured in CPU per request.
"""

from __future__ import annotations

import contextvars
import os
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from errors.root import JetrouterError
from eventlog.events import Outcome
from eventlog.names import split_hop
from replicas.runtime.replica import Routed, RouteRequest

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer

PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
GENERAL_PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_PROTOCOL"
PROTOCOLS = ("http/protobuf", "grpc")  # the first is the OpenTelemetry specification's default
TRACES_PATH = "/v1/traces"  # OTLP/HTTP's path for spans
EXTRA_HINT = "pip install 'jetrouter[tracing]'"

# Outcomes of a hop that mean it failed (a span with an error status).
_FAILED = frozenset({Outcome.ERROR, Outcome.NOT_ROUTED, Outcome.MIGRATED})


class TracingUnavailable(JetrouterError):
    """--otlp-traces-endpoint was given but cannot be honoured (one line for the CLI)."""


def export_protocol(environ: dict[str, str] | os._Environ[str] = os.environ) -> str:
    """The OTLP protocol the standard variables ask for; :class:`TracingUnavailable` if unknown."""
    value = environ.get(PROTOCOL_ENV) or environ.get(GENERAL_PROTOCOL_ENV) or PROTOCOLS[0]
    value = value.strip().lower()
    if value not in PROTOCOLS:
        raise TracingUnavailable(f"{PROTOCOL_ENV}={value!r}: jetrouter exports traces over "
                                 f"{' or '.join(PROTOCOLS)}")
    return value


def http_traces_url(endpoint: str) -> str:
    """An OTLP/HTTP endpoint given as a collector's base URL (``http://host:4318``) gets
    ``/v1/traces``; one with a path is used as it is, as the traces endpoint variable is."""
    parts = urlsplit(endpoint)
    if parts.path in ("", "/"):
        return urlunsplit(parts._replace(path=TRACES_PATH))
    return endpoint


def check_available(endpoint: str) -> str:
    """The protocol to export with, or :class:`TracingUnavailable` saying what to install."""
    protocol = export_protocol()
    module = ("opentelemetry.exporter.otlp.proto.grpc.trace_exporter" if protocol == "grpc"
              else "opentelemetry.exporter.otlp.proto.http.trace_exporter")
    try:
        __import__("opentelemetry.sdk.trace")
        __import__(module)
    except ImportError as exc:
        raise TracingUnavailable(
            f"--otlp-traces-endpoint {endpoint} needs the OpenTelemetry SDK and OTLP exporters, "
            f"which are not installed ({exc.name or exc}): {EXTRA_HINT}") from None
    if not urlsplit(endpoint).scheme or not urlsplit(endpoint).netloc:
        raise TracingUnavailable(f"--otlp-traces-endpoint {endpoint!r}: expected a URL such "
                                 "as http://127.0.0.1:4318")
    return protocol


@dataclass(slots=True)
class _Request:
    """One traced request: its span, and what its decisions said about each of its hops."""

    tracing: Tracing
    span: Span
    named: bool = False  # request id and model set on the span (by its first decision)
    hops: dict[str, tuple[str, str]] = field(default_factory=dict)  # hop id -> (worker, phase)


# The traced request the running task serves (set by TracedApp for the request's own task; the
# streamed body runs in that task too). None: tracing off, or not inside a request.
_current: contextvars.ContextVar[_Request | None] = contextvars.ContextVar(
    "jetrouter_trace", default=None)


class Tracing:
    """One replica's tracer: the SDK provider, its batch exporter and the hop spans in flight."""

    def __init__(self, endpoint: str, replica_id: str, protocol: str | None = None) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        protocol = protocol or check_available(endpoint)
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                OTLPSpanExporter as GrpcExporter,
            )

            # An http:// endpoint is a plaintext channel, https:// a TLS one (the exporter's
            # own reading of the scheme).
            exporter: Any = GrpcExporter(endpoint=endpoint)
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                OTLPSpanExporter as HttpExporter,
            )

            exporter = HttpExporter(endpoint=http_traces_url(endpoint))
        self.endpoint = endpoint
        self.protocol = protocol
        self.replica_id = replica_id
        self.provider: TracerProvider = TracerProvider(resource=Resource.create({
            "service.name": "jetrouter", "service.instance.id": replica_id}))
        # Batched, exported from the processor's own thread: a request never waits on export.
        self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer: Tracer = self.provider.get_tracer("jetrouter")
        self.hops: dict[str, Span] = {}  # hop request id -> its span, until the hop ends

    def shutdown(self) -> None:
        """Export what is left and stop (blocking: call it off the event loop)."""
        self.provider.shutdown()

    def wrap(self, app: ASGIApp) -> ASGIApp:
        return TracedApp(app, self)

    # --- Replica.tracer (replicas/runtime/replica.py RouteTracer) --------------------------------

    async def route(self, req: RouteRequest,
                    route: Callable[[RouteRequest], Awaitable[Routed]]) -> Routed:
        """A ``jetrouter.route`` span around one routing decision (a child of the current span:
        the request's, or a migration's)."""
        from opentelemetry import trace

        current = _current.get()
        if current is None:  # a decision outside any traced request
            return await route(req)
        if not current.named:
            current.named = True
            current.span.set_attributes({"jetrouter.request_id": split_hop(req.request_id)[0],
                                         "gen_ai.request.model": req.model})
        started = time.time_ns()
        # Few attributes: the SDK checks each one, on the event loop, per request. The model
        # and the replica are on the request span and the resource.
        attributes: dict[str, Any] = {"jetrouter.request_id": req.request_id,
                                      "jetrouter.phase": req.phase or "aggregated"}
        if req.exclude:
            attributes["jetrouter.excluded"] = sorted(req.exclude)
        # Not made current: nothing inside the decision opens a span (the queue span's parent is
        # given), and attaching a context per decision is not free.
        span = self.tracer.start_span("jetrouter.route", attributes=attributes)
        try:
            routed = await route(req)
            if routed.queued_s > 0:
                self.tracer.start_span(
                    "jetrouter.queue", context=trace.set_span_in_context(span),
                    start_time=started, attributes={"jetrouter.request_id": req.request_id},
                ).end(started + int(routed.queued_s * 1e9))
            if span.is_recording():  # not sampled (OTEL_TRACES_SAMPLER): skip the terms
                span.set_attributes(decision_attributes(routed))
        except Exception as exc:  # a routing error: the request's answer says the rest
            span.set_status(trace.StatusCode.ERROR, f"{type(exc).__name__}: {exc}")
            raise
        finally:
            span.end()
        current.hops[req.request_id] = (routed.worker_id, req.phase or "aggregated")
        return routed

    def finished(self, request_id: str, outcome: str) -> None:
        span = self.hops.pop(request_id, None)
        if span is None:
            return
        span.set_attribute("jetrouter.outcome", outcome)
        if outcome in _FAILED:
            from opentelemetry.trace import StatusCode

            span.set_status(StatusCode.ERROR, outcome)
        span.end()


def decision_attributes(routed: Routed) -> dict[str, Any]:
    """The chosen engine and the recorded candidates' cost terms, as the decision ledger has
    them (``RequestRouted.candidates``: the chosen one's and the cheapest others', cheapest
    first), one array attribute per term in that order, and how many candidates were weighed."""
    rows = routed.event.candidates
    attributes: dict[str, Any] = {
        "jetrouter.worker_id": routed.worker_id, "jetrouter.dp_rank": routed.dp_rank,
        "jetrouter.overlap_blocks": routed.overlap_blocks,
        "jetrouter.total_blocks": routed.total_blocks, "jetrouter.isl_tokens": routed.isl_tokens,
        "jetrouter.candidates.considered": len(routed.decision.costs),
        "jetrouter.candidates.worker_id": [r[0] for r in rows],
        "jetrouter.candidates.dp_rank": [r[1] for r in rows],
        "jetrouter.candidates.overlap_blocks": [r[2] for r in rows],
        "jetrouter.candidates.prefill_blocks": [float(r[3]) for r in rows],
        "jetrouter.candidates.decode_blocks": [float(r[4]) for r in rows],
        "jetrouter.candidates.cost": [float(r[5]) for r in rows],
        "jetrouter.candidates.busy": [bool(r[6]) for r in rows],
    }
    if routed.sticky is not None:  # how a session's pin decided it
        attributes["jetrouter.sticky"] = routed.sticky
    return attributes


# --- hops: called by the code that talks to engines (api/forward/) -------------------------------


def start_hop(request_id: str, url: str, headers: dict[str, str]) -> None:
    """A ``jetrouter.hop`` span for the engine request about to be sent; its ``traceparent``
    is added to ``headers``. It ends when the hop does (``Replica.finished``)."""
    current = _current.get()
    if current is None:
        return
    from opentelemetry import propagate, trace

    tracing = current.tracing
    worker, phase = current.hops.get(request_id, ("", ""))
    hop = split_hop(request_id)[1]
    span = tracing.tracer.start_span("jetrouter.hop", kind=trace.SpanKind.CLIENT, attributes={
        "jetrouter.request_id": request_id, "jetrouter.hop": hop, "jetrouter.worker_id": worker,
        "jetrouter.phase": phase, "url.full": url})
    old = tracing.hops.pop(request_id, None)
    if old is not None:  # the hop sent again after its connect timed out: one span per try
        old.end()
    tracing.hops[request_id] = span
    propagate.inject(headers, context=trace.set_span_in_context(span))


def hop_answered(request_id: str, status: int | None = None, failure: str | None = None
                 ) -> None:
    """The engine's status for the hop, or why the hop failed before one came."""
    current = _current.get()
    if current is None:
        return
    span = current.tracing.hops.get(request_id)
    if span is None:
        return
    if status is not None:
        span.set_attribute("http.response.status_code", status)
    if failure is not None:
        span.set_attribute("jetrouter.hop.failure", failure)


class _Migration:
    def __init__(self, span: Span | None = None) -> None:
        self.span = span

    def moved(self, ok: bool) -> None:
        if self.span is not None:
            self.span.set_attribute("jetrouter.migrated", ok)


@contextmanager
def migration(request_id: str, hop: int, from_worker: str, reason: str) -> Iterator[_Migration]:
    """A ``jetrouter.migrate`` span while a failed hop's request is routed again (the new
    decision is its child)."""
    current = _current.get()
    if current is None:
        yield _Migration()
        return
    with current.tracing.tracer.start_as_current_span("jetrouter.migrate", attributes={
            "jetrouter.request_id": request_id, "jetrouter.hop": hop,
            "jetrouter.from_worker_id": from_worker, "jetrouter.reason": reason}) as span:
        yield _Migration(span)


# --- the request span ---------------------------------------------------------------------------


class TracedApp:
    """ASGI wrapper: one server span per inference request, current while the request (its
    streamed body included) runs, ended when the response has been sent."""

    def __init__(self, app: ASGIApp, tracing: Tracing) -> None:
        self.app = app
        self.tracing = tracing

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" \
                or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        from opentelemetry import context, propagate, trace
        from opentelemetry.trace import StatusCode

        carrier = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        parent = propagate.extract(carrier)  # the client's traceparent, if any
        path = scope["path"]
        span = self.tracing.tracer.start_span(f"POST {path}", context=parent,
                                              kind=trace.SpanKind.SERVER, attributes={
            "http.route": path, "jetrouter.replica_id": self.tracing.replica_id})
        token = _current.set(_Request(self.tracing, span))
        attached = context.attach(trace.set_span_in_context(span, parent))
        status = [0]

        async def send_traced(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = int(message["status"])
                for k, v in message.get("headers", ()):
                    if k == b"x-jetrouter-worker":
                        span.set_attribute("jetrouter.worker_id", v.decode("latin-1"))
            await send(message)

        try:
            await self.app(scope, receive, send_traced)
        except BaseException as exc:
            span.record_exception(exc)
            span.set_status(StatusCode.ERROR, type(exc).__name__)
            raise
        finally:
            if status[0]:
                span.set_attribute("http.response.status_code", status[0])
                if status[0] >= 500:
                    span.set_status(StatusCode.ERROR)
            span.end()
            context.detach(attached)
            _current.reset(token)
