"""The router replica's HTTP face: OpenAI-compatible endpoints, /busy_threshold, health, metrics,
and the admin views (design.md §9). Everything routing-related is delegated to `Replica`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx
import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from api.errors import ApiError, error_response, install_error_handlers, overloaded_response
from api.metrics import RouterMetrics
from api.openai_schema import parse_request
from api.proxy import Exchange, SseWatcher, relay
from api.tokenizer import Tokenizer, load_tokenizer
from replicas.runtime import (
    AllWorkersBusy,
    NoWorkers,
    Replica,
    Routed,
    RouteRequest,
    UnknownModel,
)

log = logging.getLogger("jetrouter.api")

PRIORITY_LEVEL = {"premium": 2, "standard": 1, "best_effort": 0}
_json = msgspec.json.Encoder()


@dataclass(frozen=True, slots=True)
class AppConfig:
    max_prompt_tokens: int = 131072
    admin_token: str | None = None
    tokenizer: str | None = None
    upstream_timeout: float = 600.0


def _json_response(obj: object, status: int = 200, headers: dict[str, str] | None = None
                   ) -> Response:
    return Response(_json.encode(obj), status_code=status, media_type="application/json",
                    headers=headers)


def create_app(replica: Replica, config: AppConfig | None = None,
               metrics: RouterMetrics | None = None) -> FastAPI:
    cfg = config or AppConfig()
    metrics = metrics or RouterMetrics()
    tokenizer: Tokenizer = load_tokenizer(cfg.tokenizer)
    client_box: dict[str, httpx.AsyncClient] = {}
    applied_seen: dict[tuple[str, str, str], int] = {}

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        client_box["c"] = httpx.AsyncClient(
            timeout=httpx.Timeout(cfg.upstream_timeout, connect=5.0),
            limits=httpx.Limits(max_connections=2048, max_keepalive_connections=512))
        if replica.nc is None:
            await replica.start()
        try:
            yield
        finally:
            await client_box["c"].aclose()
            await replica.stop()

    app = FastAPI(title="jetrouter", lifespan=lifespan, docs_url=None, redoc_url=None)
    install_error_handlers(app)
    app.state.replica = replica
    app.state.metrics = metrics

    def base_headers(worker_id: str | None = None) -> dict[str, str]:
        h = {"x-jetrouter-replica": replica.replica_id}
        if worker_id:
            h["x-jetrouter-worker"] = worker_id
        return h

    # --- OpenAI-compatible ---------------------------------------------------------------

    async def handle(endpoint: str, request: Request) -> Response:
        raw = await request.body()
        parsed = parse_request(endpoint, raw, tokenizer, max_prompt_tokens=cfg.max_prompt_tokens,
                               priority_header=request.headers.get("x-priority"))
        request_id = f"{replica.replica_id}-{uuid.uuid4().hex[:20]}"
        route_req = RouteRequest(
            request_id=request_id, model=parsed.model, token_ids=parsed.prompt_ids,
            expected_osl=parsed.expected_osl, priority=PRIORITY_LEVEL[parsed.priority],
            overlap_weight=parsed.overlap_weight,
            latency_sensitivity=parsed.latency_sensitivity)
        try:
            routed = await replica.route(route_req)
        except UnknownModel as exc:
            raise ApiError(404, str(exc), param="model", code="model_not_found") from None
        except NoWorkers as exc:
            metrics.rejections.labels(reason="no_workers").inc()
            return error_response(503, str(exc), type="service_unavailable",
                                  headers=base_headers())
        except AllWorkersBusy:
            metrics.rejections.labels(reason="busy").inc()
            metrics.requests.labels(endpoint=endpoint, outcome="rejected").inc()
            resp = overloaded_response()
            resp.headers.update(base_headers())
            return resp
        for stage, seconds in routed.timings.items():
            metrics.overhead.labels(stage=stage).observe(seconds)
        metrics.input_tokens.observe(routed.isl_tokens)
        if routed.total_blocks:
            metrics.kv_hit_rate.observe(routed.overlap_blocks / routed.total_blocks)
        path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
        url = routed.worker_url.rstrip("/") + path
        if parsed.stream:
            return await stream_upstream(endpoint, url, raw, routed)
        return await unary_upstream(endpoint, url, raw, routed)

    def finish(endpoint: str, routed: Routed, ex: Exchange) -> None:
        replica.finished(routed.request_id, ex.outcome, ex.tokens)
        metrics.requests.labels(endpoint=endpoint, outcome=ex.outcome).inc()
        if ex.ttft is not None:
            metrics.ttft.observe(ex.ttft)
        for gap in ex.itl:
            metrics.itl.observe(gap)
        if ex.outcome == "ok":
            metrics.output_tokens.observe(ex.tokens)

    async def unary_upstream(endpoint: str, url: str, raw: bytes, routed: Routed) -> Response:
        ex = Exchange()
        client = client_box["c"]
        try:
            resp = await client.post(url, content=raw, headers={
                "content-type": "application/json", "x-request-id": routed.request_id})
        except httpx.HTTPError as exc:
            finish(endpoint, routed, ex)
            return error_response(502, f"the inference engine {routed.worker_id} failed: "
                                  f"{type(exc).__name__}", type="upstream_error",
                                  headers=base_headers(routed.worker_id))
        except BaseException:
            ex.outcome = "cancelled"
            finish(endpoint, routed, ex)
            raise
        ex.first_token_at = time.perf_counter()
        replica.prefill_completed(routed.request_id)
        if resp.status_code == 200:
            with contextlib.suppress(Exception):
                ex.take_usage(msgspec.json.decode(resp.content).get("usage"))
            ex.outcome = "ok"
        finish(endpoint, routed, ex)
        return Response(resp.content, status_code=resp.status_code,
                        media_type=resp.headers.get("content-type", "application/json"),
                        headers=base_headers(routed.worker_id))

    async def stream_upstream(endpoint: str, url: str, raw: bytes, routed: Routed) -> Response:
        ex = Exchange()
        client = client_box["c"]
        req = client.build_request("POST", url, content=raw, headers={
            "content-type": "application/json", "x-request-id": routed.request_id})
        try:
            resp = await client.send(req, stream=True)
        except httpx.HTTPError as exc:
            finish(endpoint, routed, ex)
            return error_response(502, f"the inference engine {routed.worker_id} failed: "
                                  f"{type(exc).__name__}", type="upstream_error",
                                  headers=base_headers(routed.worker_id))
        except BaseException:
            ex.outcome = "cancelled"
            finish(endpoint, routed, ex)
            raise
        if resp.status_code != 200:
            body = await resp.aread()
            await resp.aclose()
            finish(endpoint, routed, ex)
            return Response(body, status_code=resp.status_code,
                            media_type=resp.headers.get("content-type", "application/json"),
                            headers=base_headers(routed.worker_id))
        watcher = SseWatcher(ex, lambda: replica.prefill_completed(routed.request_id))

        async def body() -> AsyncIterator[bytes]:
            try:
                async for chunk in relay(resp, watcher):
                    yield chunk
            except (asyncio.CancelledError, GeneratorExit):
                ex.outcome = "cancelled"
                raise
            finally:
                if ex.outcome != "ok" and watcher.saw_done is False and ex.outcome != "cancelled":
                    ex.outcome = "error"
                finish(endpoint, routed, ex)

        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers=base_headers(routed.worker_id))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle("completions", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handle("chat", request)

    @app.get("/v1/models")
    async def models() -> Response:
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "jetrouter"}
                for m in replica.models()]
        return _json_response({"object": "list", "data": data}, headers=base_headers())

    # --- busy thresholds (seed 000/001) -------------------------------------------------------

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
        body = _object_body(await request.body())
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise ApiError(400, "`model` is required and must be a string", param="model")
        decode = _optional_number(body, "active_decode_blocks_threshold", 0.0, 1.0)
        tokens = _optional_number(body, "active_prefill_tokens_threshold", 0, None, integer=True)
        frac = _optional_number(body, "active_prefill_tokens_threshold_frac", 0.0, None)
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

    @app.get("/ready")
    async def ready() -> Response:
        if replica.ready:
            return _json_response({"ready": True, "replica_id": replica.replica_id})
        return _json_response({"ready": False, "replica_id": replica.replica_id,
                               "lag": replica.lag()}, status=503)

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        refresh_metrics()
        payload, content_type = metrics.render()
        return Response(payload, media_type=content_type)

    def refresh_metrics() -> None:
        state = replica.state
        loads: dict[str, tuple[int, int]] = {}
        for w in state.workers.values():
            for rank in range(w.dp_size):
                key = (w.worker_id, rank)
                label = w.worker_id if w.dp_size == 1 else f"{w.worker_id}/{rank}"
                loads[label] = (state.load.active_decode_blocks(key),
                                state.load.active_prefill_tokens(key))
        metrics.set_worker_load(loads)
        for (stream, etype, status), n in state.stats.counts.items():
            seen = applied_seen.get((stream, etype, status), 0)
            if n > seen:
                metrics.events_applied.labels(stream=stream, event_type=etype,
                                              status=status).inc(n - seen)
                applied_seen[(stream, etype, status)] = n
        for stream, lag in replica.lag().items():
            metrics.stream_lag.labels(stream=stream).set(lag)
        metrics.queue_depth.set(replica.queue_depth())
        metrics.inflight.set(len(state.load))

    # --- admin (bearer token) --------------------------------------------------------------------

    def check_admin(request: Request) -> None:
        if not cfg.admin_token:
            raise ApiError(403, "the admin API is disabled: start the replica with --admin-token "
                           "TOKEN (or JETROUTER_ADMIN_TOKEN) to enable it",
                           type="permission_error")
        auth = request.headers.get("authorization", "")
        if not auth:
            raise ApiError(401, "missing bearer token: send `Authorization: Bearer TOKEN`",
                           type="authentication_error",
                           headers={"www-authenticate": "Bearer"})
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or token.strip() != cfg.admin_token:
            raise ApiError(403, "invalid admin token", type="permission_error")

    @app.get("/admin/state")
    async def admin_state(request: Request) -> Response:
        check_admin(request)
        state = replica.state
        return _json_response({
            "replica_id": replica.replica_id,
            "ready": replica.ready,
            "leader": False,
            "epoch": state.epoch,
            "positions": state.positions,
            "digests": {k: f"{v:016x}" for k, v in state.digests().items()},
            "lag": replica.lag(),
            "snapshot_threshold": state.snapshot_threshold,
            "event_time": state.now,
            "workers": len(state.workers),
            "active_requests": len(state.load),
            "malformed_messages": replica.malformed,
        })

    @app.get("/admin/workers")
    async def admin_workers(request: Request) -> Response:
        check_admin(request)
        state = replica.state
        out = []
        for w in sorted(state.workers.values(), key=lambda w: w.worker_id):
            keys = [(w.worker_id, r) for r in range(w.dp_size)]
            out.append({
                "worker_id": w.worker_id, "url": w.url, "model": w.model,
                "block_size": w.block_size, "kv_total_blocks": w.kv_total_blocks,
                "dp_size": w.dp_size, "health": state.health.get(w.worker_id, "healthy"),
                "cached_blocks": sum(state.index.tree_size(k) for k in keys),
                "active_prefill_tokens": sum(state.load.active_prefill_tokens(k) for k in keys),
                "active_decode_blocks": sum(state.load.active_decode_blocks(k) for k in keys),
                "out_of_sync": w.worker_id in state.out_of_sync,
            })
        return _json_response({"workers": out})

    return app


def _object_body(raw: bytes) -> dict[str, object]:
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        raise ApiError(400, "the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def _optional_number(body: dict[str, object], key: str, lo: float, hi: float | None, *,
                     integer: bool = False) -> float | int | None:
    if key not in body or body[key] is None:
        return None
    v = body[key]
    ok = isinstance(v, int) if integer else isinstance(v, int | float)
    if isinstance(v, bool) or not ok or v < lo or (hi is not None and v > hi):  # type: ignore[operator]
        rng = f"between {lo} and {hi}" if hi is not None else f">= {lo}"
        kind = "an integer" if integer else "a number"
        raise ApiError(400, f"`{key}` must be {kind} {rng}", param=key)
    return v  # type: ignore[return-value]
