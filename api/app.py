"""The router replica's HTTP face: OpenAI-compatible endpoints, /busy_threshold, health, metrics,
and the admin views (design.md §9). Everything routing-related is delegated to `Replica`."""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

import msgspec
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response
from starlette.types import ASGIApp

from api.admin import admin_router, require_admin
from api.admin_tenants import tenants_router
from api.config import option
from api.errors import ApiError, error_response, install_error_handlers
from api.forward import Forwarder, replica_headers
from api.http_limits import BodySizeLimit
from api.metrics import RouterMetrics
from api.openai_schema import decode_json, parse_request
from api.routes import API_ROUTES
from api.routes.batch import serve_batch
from api.routes.gateway import Gateway, GatewayConfig
from api.session_control import EngineSessions
from api.tenancy import Identity
from api.tokenizer import Tokenizer, load_model_tokenizer
from api.tracing import Tracing
from eventlog.appender import AppendFailed
from eventlog.events import MAX_COUNT, MAX_RATIO
from leanhttp.hotpath import Guard, install_hot_routes, read_body
from replicas.core.health import STATUS_GAUGE
from replicas.runtime.canary import report_passive
from replicas.runtime.replica import (
    Replica,
)

log = logging.getLogger("jetrouter.api")

_json = msgspec.json.Encoder()


@dataclass(frozen=True, slots=True)
class AppConfig:
    """What the HTTP layer needs of `serve`'s options; the defaults are the options' own."""

    max_prompt_tokens: int = option("max-prompt-tokens").default
    admin_token: str | None = None
    tokenizer: str | None = None
    model_path: str | None = None  # a model folder; wins over `tokenizer`
    reset_on_start: bool = False
    stream_idle_timeout: float = option("stream-idle-timeout").default
    migration_limit: int = option("migration-limit").default
    max_body_bytes: int = option("max-body-bytes").default
    # Dynamo leaves POST /busy_threshold open; True requires the admin bearer token for it.
    busy_threshold_requires_admin: bool = False
    # A request that reaches a replica still catching up waits this long for readiness instead
    # of failing: a load balancer's health check lags the replica's start by up to one interval.
    ready_wait: float = option("ready-wait").default
    # TTL of sessions named only by the X-Dynamo-Session-ID header (nvext.session_control
    # carries its own timeout; this is also its default).
    session_ttl_secs: float = option("session-ttl-secs").default
    # How long (event time) the router remembers which engine stored a Responses API response.
    response_ttl_secs: float = option("response-ttl-secs").default
    # OTLP collector for the request path's spans (api/tracing.py); None: no tracing.
    otlp_traces_endpoint: str | None = None
    # Tenants (api/tenancy.py): API keys -> tenant, or a trusted gateway's header.
    api_keys_file: str | None = None
    tenant_header: str | None = None


def _json_response(obj: object, status: int = 200, headers: dict[str, str] | None = None
                   ) -> Response:
    return Response(_json.encode(obj), status_code=status, media_type="application/json",
                    headers=headers)


# Builds more routes for the app from the replica and its config (see create_app).
RouterFactory = Callable[[Replica, AppConfig], APIRouter]


def create_app(replica: Replica, config: AppConfig | None = None,
               metrics: RouterMetrics | None = None,
               extra_routers: Sequence[RouterFactory] = ()) -> FastAPI:
    """The router replica's HTTP app. ``extra_routers`` are included after the admin API: the
    way a test adds a debug route without the product shipping it."""
    cfg = config or AppConfig()
    metrics = metrics or RouterMetrics()
    tokenizer: Tokenizer = load_model_tokenizer(cfg.model_path, cfg.tokenizer)
    background: set[asyncio.Task[None]] = set()
    applied_seen: dict[tuple[str, str, str], int] = {}
    snapshots_seen = [0]
    replication_seen = [0.0]
    unrecorded_seen = {"served": 0, "recorded_late": 0, "lost": 0, "not_appended": 0}
    tracing = (Tracing(cfg.otlp_traces_endpoint, replica.replica_id)
               if cfg.otlp_traces_endpoint else None)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if replica.nc is None:
            await replica.start()
        if cfg.reset_on_start:
            background.add(asyncio.create_task(_reset_when_ready(replica)))
        try:
            yield
        finally:
            await forwarder.aclose()
            await replica.stop()
            if tracing is not None:  # the last spans are exported (a blocking call)
                await asyncio.to_thread(tracing.shutdown)

    app = FastAPI(title="jetrouter", lifespan=lifespan, docs_url=None, redoc_url=None)
    install_error_handlers(app)

    async def on_append_failed(_request: Request, exc: Exception) -> Response:
        # A config change (busy thresholds, snapshot threshold) JetStream did not take.
        return error_response(503, f"the change could not be recorded: {exc}; retry",
                              type="service_unavailable", headers={"retry-after": "1"})

    app.add_exception_handler(AppendFailed, on_append_failed)
    # Outside the routes: an oversized body is refused before anything reads or parses it.
    app.add_middleware(BodySizeLimit, max_bytes=cfg.max_body_bytes)
    app.state.replica = replica
    replica.on_divergence = lambda d: metrics.divergence.inc()
    replica.on_decision_refused = lambda reason: metrics.decisions_not_recorded.labels(
        reason=reason).inc()
    replica.on_health_check = lambda w, secs, outcome: metrics.health_check_duration.labels(
        worker=w, outcome=outcome).observe(secs)
    app.state.metrics = metrics

    def base_headers(worker_id: str | None = None) -> dict[str, str]:
        return replica_headers(replica.replica_id, worker_id)

    forwarder = Forwarder(replica, metrics, tokenizer=tokenizer,
                          stream_idle_timeout=cfg.stream_idle_timeout,
                          migration_limit=cfg.migration_limit,
                          on_worker_failure=lambda w, r: report_passive(replica.nc, replica.names,
                                                                        w, r))
    engine_sessions = EngineSessions(forwarder.pool)
    app.state.engine_sessions = engine_sessions
    gateway = Gateway(replica, GatewayConfig(
        max_prompt_tokens=cfg.max_prompt_tokens, ready_wait=cfg.ready_wait,
        session_ttl_secs=cfg.session_ttl_secs, response_ttl_secs=cfg.response_ttl_secs,
        has_model_path=bool(cfg.model_path or cfg.tokenizer)),
        metrics, forwarder, tokenizer, engine_sessions,
        Identity.configure(cfg.api_keys_file, cfg.tenant_header,
                           lambda: replica.state.tenants.keys))

    # --- OpenAI-compatible ---------------------------------------------------------------

    async def handle(endpoint: str, request: Request) -> Response:
        received, started = time.time(), time.perf_counter()
        raw = await read_body(request)
        refused = await gateway.admit(request)
        if refused is not None:
            return refused
        parsed = parse_request(endpoint, raw, tokenizer, max_prompt_tokens=cfg.max_prompt_tokens,
                               priority_header=request.headers.get("x-priority"),
                               allow_batch=True)
        if parsed.batch is not None:  # several prompts: one routed request each
            return await serve_batch(gateway, parsed, request, received, started)
        return await gateway.serve_parsed(endpoint, parsed, raw, request, received, started)

    async def completions(request: Request) -> Response:
        return await handle("completions", request)

    async def chat_completions(request: Request) -> Response:
        return await handle("chat", request)

    # Plain Starlette routes for the hot path (FastAPI's dependency solving costs more than
    # these handlers need: they read the raw body themselves), and in front of the middleware
    # stack a short way to them behind the body size limit (leanhttp/hotpath.py).
    guard: Guard = functools.partial(BodySizeLimit, max_bytes=cfg.max_body_bytes)
    if tracing is not None:
        guard = _install_tracing(app, replica, tracing, guard)
    install_hot_routes(
        app, {"/v1/completions": completions, "/v1/chat/completions": chat_completions},
        guard=guard)
    for make_routes in API_ROUTES:
        app.include_router(make_routes(gateway))

    @app.get("/v1/models")
    async def models() -> Response:
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "jetrouter"}
                for m in replica.models()]
        return _json_response({"object": "list", "data": data}, headers=base_headers())

    # --- busy thresholds (design.md §6, Dynamo's /busy_threshold API) -----------------------------

    def threshold_doc(model: str) -> dict[str, object]:
        t = replica.state.thresholds.get(model)
        doc: dict[str, object] = {
            "model": model,
            "active_decode_blocks_threshold": t.active_decode_blocks_threshold if t else None,
            "active_prefill_tokens_threshold": t.active_prefill_tokens_threshold if t else None,
        }
        if t and t.active_prefill_tokens_threshold_frac is not None:
            doc["active_prefill_tokens_threshold_frac"] = t.active_prefill_tokens_threshold_frac
        return doc

    @app.get("/busy_threshold")
    async def get_busy_thresholds() -> Response:
        return _json_response({"thresholds": [threshold_doc(m)
                                              for m in sorted(replica.state.thresholds)]})

    @app.post("/busy_threshold")
    async def post_busy_threshold(request: Request) -> Response:
        if cfg.busy_threshold_requires_admin:
            # One POST can mark every engine busy and so refuse all traffic.
            require_admin(request, cfg.admin_token)
        body = object_body(await request.body())
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise ApiError(400, "`model` is required and must be a string", param="model")
        decode = _optional_number(body, "active_decode_blocks_threshold", 0.0, 1.0)
        tokens = _optional_number(body, "active_prefill_tokens_threshold", 0, MAX_COUNT,
                                  integer=True)
        frac = _optional_number(body, "active_prefill_tokens_threshold_frac", 0.0, MAX_RATIO)
        keys = ("active_decode_blocks_threshold", "active_prefill_tokens_threshold",
                "active_prefill_tokens_threshold_frac")
        if any(k in body for k in keys):
            current = replica.state.thresholds.get(model)
            # Fields left out keep their value; an explicit null clears one.
            if current is not None:
                decode = decode if "active_decode_blocks_threshold" in body \
                    else current.active_decode_blocks_threshold
                tokens = tokens if "active_prefill_tokens_threshold" in body \
                    else current.active_prefill_tokens_threshold
                frac = frac if "active_prefill_tokens_threshold_frac" in body \
                    else current.active_prefill_tokens_threshold_frac
            await replica.set_busy_thresholds(model, decode,  # type: ignore[arg-type]
                                              tokens, frac)  # type: ignore[arg-type]
        return _json_response(threshold_doc(model))

    # --- health, readiness, metrics ------------------------------------------------------------

    @app.get("/health")
    async def health() -> Response:
        return _json_response({"status": "ok", "replica_id": replica.replica_id})

    def taking_requests(decisions: dict[str, object]) -> bool:
        # Not ready while routing decisions cannot be recorded (a load balancer then sends
        # traffic to replicas that can); it turns ready again after a quiet window or at the
        # first decision recorded, so that traffic finds out when JetStream takes appends again.
        return replica.ready and bool(decisions["ok"])

    @app.get("/ready")
    async def ready() -> Response:
        now = time.monotonic()
        decisions = replica.decision_log.view(now)
        if taking_requests(decisions):
            body: dict[str, object] = {"ready": True, "replica_id": replica.replica_id}
            if decisions["unrecorded_for_s"] is not None:  # serving through an election
                body["decision_log"] = decisions
            # Degraded (the event log is unavailable: replicas/runtime/log_outage.py) is still
            # 200. The replica serves every request on the state it has, and so does every
            # other replica cut off from the same NATS: a load balancer that took degraded
            # replicas out would take out the whole fleet and turn a logging outage into an
            # inference outage. The detail is for operators and monitors.
            if replica.outage.degraded(now):
                body["degraded"] = True
                body["event_log"] = replica.outage.view(now)
            return _json_response(body)
        body = {"ready": False, "replica_id": replica.replica_id, "lag": replica.lag(),
                "decision_log": decisions}
        if blocked := replica.blocked_streams():  # stopped at a newer format: upgrade it
            body["blocked_streams"] = blocked
        return _json_response(body, status=503)

    @app.get("/ready/balancer")
    async def ready_for_balancer() -> Response:
        # The same readiness in the status codes HAProxy's `http-check disable-on-404` reads:
        # 200 ready; 404 alive but not taking new requests (starting, draining, decisions
        # refused) - drained, its streams kept. Only a replica that does not answer at all
        # (dead, paused, stuck) is marked down, and then its sessions may be cut
        # (deploy/haproxy.cfg). A 503 here would count as down and cut healthy streams.
        if taking_requests(replica.decision_log.view(time.monotonic())):
            return _json_response({"ready": True, "replica_id": replica.replica_id})
        return _json_response({"ready": False, "alive": True, "draining": replica.draining,
                               "replica_id": replica.replica_id}, status=404)

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        refresh_metrics()
        payload, content_type = metrics.render()
        return Response(payload, media_type=content_type)

    def refresh_metrics() -> None:
        state = replica.state
        loads: dict[str, tuple[float, float]] = {}
        for w in state.workers.values():
            for rank in range(w.dp_size):
                key = (w.worker_id, rank)
                label = w.worker_id if w.dp_size == 1 else f"{w.worker_id}/{rank}"
                loads[label] = (state.load.active_decode_blocks(key),
                                state.load.active_prefill_tokens(key, state.now))
        metrics.set_worker_load(loads)
        for (stream, etype, status), n in state.stats.counts.items():
            seen = applied_seen.get((stream, etype, status), 0)
            if n > seen:
                metrics.events_applied.labels(stream=stream, event_type=etype,
                                              status=status).inc(n - seen)
                applied_seen[(stream, etype, status)] = n
        blocked = replica.blocked_streams()
        for stream, lag in replica.lag().items():
            metrics.stream_lag.labels(stream=stream).set(lag)
            metrics.stream_blocked.labels(stream=stream).set(1 if stream in blocked else 0)
        if replica.replication.seconds > replication_seen[0]:
            metrics.replication_seconds.inc(replica.replication.seconds - replication_seen[0])
            replication_seen[0] = replica.replication.seconds
        metrics.queue_depth.set(replica.queue_depth())
        durability = replica.leader
        metrics.is_leader.set(1 if durability is not None and durability.is_leader else 0)
        taken = durability.snapshots_taken if durability is not None else 0
        if taken > snapshots_seen[0]:
            metrics.snapshots.inc(taken - snapshots_seen[0])
            snapshots_seen[0] = taken
        metrics.restores.set(replica.restores)
        metrics.epoch.set(state.epoch)
        for w in state.workers:
            metrics.worker_status.labels(worker=w).set(
                STATUS_GAUGE.get(state.health.get(w, "healthy"), 0))
            if replica.health_board is not None and durability is not None \
                    and durability.is_leader:
                metrics.breaker_state.labels(worker=w).set(replica.health_board.breaker_gauge(w))
        metrics.inflight.set(len(state.load))
        metrics.sticky_sessions.set(len(state.sessions))
        decisions = replica.decision_log
        for label, n in (("served", decisions.served_unrecorded),
                         ("recorded_late", decisions.recorded_late), ("lost", decisions.lost)):
            if n > unrecorded_seen[label]:
                metrics.decisions_unrecorded.labels(state=label).inc(n - unrecorded_seen[label])
                unrecorded_seen[label] = n
        metrics.decision_log_ok.set(0 if replica.decision_log.failing(time.monotonic()) else 1)
        outage = replica.outage
        metrics.event_log_degraded.set(1 if outage.degraded(time.monotonic()) else 0)
        if outage.not_appended > unrecorded_seen["not_appended"]:
            metrics.decisions_not_appended.inc(outage.not_appended
                                               - unrecorded_seen["not_appended"])
            unrecorded_seen["not_appended"] = outage.not_appended

    app.include_router(admin_router(replica, cfg))
    app.include_router(tenants_router(replica, cfg))
    for make_router in extra_routers:
        app.include_router(make_router(replica, cfg))

    return app


def _install_tracing(app: FastAPI, replica: Replica, tracing: Tracing, guard: Guard) -> Guard:
    """Decisions and hop ends are traced through the replica; request spans by a wrapper around
    the middleware stack (set before the hot routes are installed in front of it) and one inside
    the hot routes' guard, so the inference routes keep their short way past the stack
    (leanhttp's FrontDoor only takes it to a bare HotRoutes). Returns the guard to install."""
    replica.tracer = tracing
    build_stack = app.build_middleware_stack

    def build_traced() -> ASGIApp:
        return tracing.wrap(build_stack())

    app.build_middleware_stack = build_traced  # type: ignore[method-assign]
    return lambda handlers: tracing.wrap(guard(handlers))


async def _reset_when_ready(replica: Replica) -> None:
    """--router-reset-states: once caught up, ask the leader (maybe us) for a reset."""
    await replica.wait_ready()
    for attempt in range(30):
        try:
            assert replica.leader is not None
            answer = await replica.leader.request("reset", {"reason": "--router-reset-states"})
            log.warning("state reset on start: new epoch %s", answer.get("epoch"))
            return
        except Exception as exc:  # no leader yet: the lease is taken within a few seconds
            log.info("reset on start: %s (attempt %d)", exc, attempt + 1)
            await asyncio.sleep(1.0)
    log.error("reset on start failed: no leader answered")


def object_body(raw: bytes) -> dict[str, object]:
    body = decode_json(raw)
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def _optional_number(body: dict[str, object], key: str, lo: float, hi: float, *,
                     integer: bool = False) -> float | int | None:
    if key not in body or body[key] is None:
        return None
    v = body[key]
    ok = isinstance(v, int) if integer else isinstance(v, int | float)
    # The value travels in a router-stream event, whose bounds (eventlog/events.py) every
    # replica checks when it reads it: past them the event could not be encoded (a 500, found
    # by the HTTP fuzz tests) or would be skipped as malformed everywhere.
    if (isinstance(v, bool) or not ok or not math.isfinite(v)  # type: ignore[arg-type]
            or v < lo or v > hi):  # type: ignore[operator]
        rng = f"between {lo} and {hi:g}"
        kind = "an integer" if integer else "a number"
        raise ApiError(400, f"`{key}` must be {kind} {rng}", param=key)
    return v if integer else float(v)  # type: ignore[arg-type]
