"""The router replica's HTTP app, composed (design.md §9): the inference routes
(:mod:`api.routes`, through :class:`api.forward.conductor.Conductor`), /busy_threshold
(:mod:`api.thresholds`), health, readiness and metrics (:mod:`api.probes`), and the admin views.
Nothing here handles a request itself."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response
from starlette.types import ASGIApp

from api.admin import admin_router
from api.admin_tenants import tenants_router
from api.config import option
from api.errors import error_response, install_error_handlers
from api.forward.conductor import Conductor, ConductorConfig
from api.forward.forwarder import Forwarder
from api.forward.sessions import EngineSessions
from api.http_limits import BodySizeLimit
from api.metrics import RouterMetrics
from api.probes import probes_router
from api.replica_metrics import ReplicaCollector
from api.routes import API_ROUTES
from api.routes.completions import completions_handlers
from api.tenancy import Identity
from api.thresholds import thresholds_router
from api.tokenizer import Tokenizer, load_model_tokenizer
from api.tracing import Tracing
from eventlog.appender import AppendFailed
from leanhttp.hotpath import Guard, install_hot_routes
from replicas.runtime.canary import report_passive
from replicas.runtime.replica import Replica

log = logging.getLogger("jetrouter.api")


@dataclass(frozen=True, slots=True)
class AppConfig:
    """What the HTTP layer needs of `serve`'s options; the defaults are the options' own."""

    max_prompt_tokens: int = option("max-prompt-tokens").default
    admin_token: str | None = None
    tokenizer: str | None = None
    model_path: str | None = None  # a model folder; wins over `tokenizer`
    reset_on_start: bool = False
    stream_idle_timeout: float = option("stream-idle-timeout").default
    engine_connect_timeout: float = option("engine-connect-timeout").default
    first_byte_timeout: float = option("first-byte-timeout").default
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


# Builds more routes for the app from the replica and its config (see create_app).
RouterFactory = Callable[[Replica, AppConfig], APIRouter]


def create_app(replica: Replica, config: AppConfig | None = None,
               metrics: RouterMetrics | None = None,
               extra_routers: Sequence[RouterFactory] = ()) -> FastAPI:
    """The router replica's HTTP app, composed: the parts are built here and their routes
    included; what a request does is theirs. ``extra_routers`` are included after the admin
    API: the way a test adds a debug route without the product shipping it."""
    cfg = config or AppConfig()
    metrics = metrics or RouterMetrics()
    tokenizer: Tokenizer = load_model_tokenizer(cfg.model_path, cfg.tokenizer)
    tracing = (Tracing(cfg.otlp_traces_endpoint, replica.replica_id)
               if cfg.otlp_traces_endpoint else None)
    forwarder = Forwarder(replica, metrics, tokenizer=tokenizer,
                          stream_idle_timeout=cfg.stream_idle_timeout,
                          migration_limit=cfg.migration_limit,
                          connect_timeout=cfg.engine_connect_timeout,
                          on_worker_failure=functools.partial(_report_passive, replica),
                          heard_ago=functools.partial(_gauge_age, replica),
                          alive_within=replica.config.worker_timeout,
                          first_byte_timeout=cfg.first_byte_timeout,
                          kv_heard_ago=replica.kv_heard_ago)
    engine_sessions = EngineSessions(forwarder.pool)
    conductor = Conductor(replica, ConductorConfig(
        max_prompt_tokens=cfg.max_prompt_tokens, ready_wait=cfg.ready_wait,
        session_ttl_secs=cfg.session_ttl_secs, response_ttl_secs=cfg.response_ttl_secs,
        has_model_path=bool(cfg.model_path or cfg.tokenizer)),
        metrics, forwarder, tokenizer, engine_sessions,
        Identity.configure(cfg.api_keys_file, cfg.tenant_header,
                           lambda: replica.state.tenants.keys))
    metrics.attach(ReplicaCollector(replica, lambda: conductor.shedder.level))
    _hook_metrics(replica, metrics)

    app = FastAPI(title="jetrouter", docs_url=None, redoc_url=None,
                  lifespan=_lifespan(replica, forwarder, tracing, cfg.reset_on_start))
    install_error_handlers(app)
    app.add_exception_handler(AppendFailed, _append_failed)
    # Outside the routes: an oversized body is refused before anything reads or parses it.
    app.add_middleware(BodySizeLimit, max_bytes=cfg.max_body_bytes)
    app.state.replica = replica
    app.state.metrics = metrics
    app.state.engine_sessions = engine_sessions

    # The hot path: in front of the middleware stack, a short way to plain Starlette handlers
    # behind the body size limit (leanhttp/hotpath.py).
    guard: Guard = functools.partial(BodySizeLimit, max_bytes=cfg.max_body_bytes)
    if tracing is not None:
        guard = _install_tracing(app, replica, tracing, guard)
    install_hot_routes(app, completions_handlers(conductor), guard=guard)
    for make_routes in API_ROUTES:
        app.include_router(make_routes(conductor))
    app.include_router(thresholds_router(replica, cfg))
    app.include_router(probes_router(replica, metrics))
    app.include_router(admin_router(replica, cfg))
    app.include_router(tenants_router(replica, cfg))
    for make_router in extra_routers:
        app.include_router(make_router(replica, cfg))
    return app


def _hook_metrics(replica: Replica, metrics: RouterMetrics) -> None:
    """The replica's events that count in the metrics as they happen."""
    replica.on_divergence = lambda d: metrics.divergence.inc()
    replica.on_decision_refused = lambda reason: metrics.decisions_not_recorded.labels(
        reason=reason).inc()
    replica.on_health_check = lambda w, secs, outcome: metrics.health_check_duration.labels(
        worker=w, outcome=outcome).observe(secs)


def _report_passive(replica: Replica, worker_id: str, reason: str) -> object:
    return report_passive(replica.nc, replica.names, worker_id, reason)


def _gauge_age(replica: Replica, worker_id: str) -> float | None:
    """Seconds since the replica last heard the engine's load gauge; None without liveness
    (no JetStream) or before the first one."""
    liveness = replica.liveness
    return liveness.gauge_age(worker_id) if liveness is not None else None


def _lifespan(replica: Replica, forwarder: Forwarder, tracing: Tracing | None,
              reset_on_start: bool) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    background: set[asyncio.Task[None]] = set()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if replica.nc is None:
            await replica.start()
        if reset_on_start:
            background.add(asyncio.create_task(_reset_when_ready(replica)))
        try:
            yield
        finally:
            await forwarder.aclose()
            await replica.stop()
            if tracing is not None:  # the last spans are exported (a blocking call)
                await asyncio.to_thread(tracing.shutdown)

    return lifespan


async def _append_failed(_request: Request, exc: Exception) -> Response:
    # A config change (busy thresholds, snapshot threshold) JetStream did not take.
    return error_response(503, f"the change could not be recorded: {exc}; retry",
                          type="service_unavailable", headers={"retry-after": "1"})


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
