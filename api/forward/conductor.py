"""The conductor of every inference request: from a parsed request to the response, top-down.

One :class:`Conductor` per app (:func:`api.app.create_app`); the route modules in
:mod:`api.routes` parse their own bodies and hand the request here. For chat and completions
:meth:`Conductor.serve` reads in order:

1. readiness (:meth:`Conductor.admit`, called by the route before it parses): a replica still
   catching up holds the request up to ``--ready-wait``, then answers 503; with tenants
   configured, who the client is;
2. priority shedding (:meth:`Conductor.shed`, api/shed.py);
3. the session (``x-dynamo-session-id`` or ``nvext.session_control``) and an isolated tenant's
   ``cache_salt``;
4. the first hop (:meth:`Conductor.first_hop`): tenant admission, then
   :meth:`api.forward.hops.HopRouter.first_hop` (aggregated, or a prefill hop then the decode
   decision), its refusals as HTTP answers;
5. a newly pinned session opened on its engine (:mod:`api.forward.sessions`);
6. forwarding: one choice through :meth:`api.forward.forwarder.Forwarder.forward` (relayed token
   by token, migrating mid-stream), ``n > 1`` verbatim (:mod:`api.forward.passthrough`);
7. after the answer: a closing session closed, ``nvext`` fields (:mod:`api.forward.nvext`),
   the tenant's rate-limit headers.

The other routes (embeddings, Responses, Messages) go through :meth:`Conductor.relay`: shed,
first hop, forwarded verbatim; what an engine's tokenizer answers without a decision through
:meth:`Conductor.unrouted`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import msgspec
from fastapi import Request
from fastapi.responses import Response

from api.errors import ApiError, error_response, overloaded_response
from api.forward.context import replica_headers
from api.forward.continuation import with_transfer
from api.forward.forwarder import Forwarder
from api.forward.nvext import NvextFields, add_to_response
from api.forward.passthrough import Passthrough
from api.forward.sessions import EngineSessions
from api.forward.unrouted import forward_unrouted
from api.handoff_fields import refuse_handoff_fields
from api.metrics import Rejection, RouterMetrics
from api.openai_schema import MAX_SESSION_ID, MAX_TOKEN_COUNT, ParsedRequest, decode_json
from api.shed import Shedder
from api.tenancy import Identity, current_tenant, rate_limit_headers, rate_limited
from api.tokenizer import Tokenizer
from leanhttp.hotpath import read_body
from replicas.core.shedding import PriorityTier
from replicas.core.sticky import SessionRequest
from replicas.runtime.replica import (
    AllWorkersBusy,
    DecisionNotRecorded,
    NoWorkers,
    Replica,
    Routed,
    RouteRequest,
    UnknownModel,
)

SESSION_HEADER = "x-dynamo-session-id"
PRIORITY_LEVEL = {PriorityTier.PREMIUM: 2, PriorityTier.STANDARD: 1, PriorityTier.BEST_EFFORT: 0}


@dataclass(frozen=True, slots=True)
class ConductorConfig:
    """The part of :class:`api.app.AppConfig` the inference routes read."""

    max_prompt_tokens: int
    ready_wait: float
    session_ttl_secs: float
    response_ttl_secs: float
    has_model_path: bool  # the router tokenizes exactly as the engines (--model-path)


class Conductor:
    def __init__(self, replica: Replica, cfg: ConductorConfig, metrics: RouterMetrics,
                 forwarder: Forwarder, tokenizer: Tokenizer,
                 engine_sessions: EngineSessions, identity: Identity | None = None) -> None:
        self.replica = replica
        self.cfg = cfg
        self.metrics = metrics
        self.forwarder = forwarder
        self.tokenizer = tokenizer
        self.engine_sessions = engine_sessions
        self.shedder = Shedder(replica)
        self.identity = identity  # None: no tenants (api/tenancy.py)

    def headers(self, worker_id: str | None = None,
                request_id: str | None = None) -> dict[str, str]:
        return replica_headers(self.replica.replica_id, worker_id, request_id)

    def new_request_id(self) -> str:
        return f"{self.replica.replica_id}-{uuid.uuid4().hex[:20]}"

    # --- the door: readiness, and the JSON body of the routes that read one ------------------

    async def admit(self, request: Request | None = None) -> Response | None:
        """None when this replica takes requests, else the 503 the client gets. With tenants
        configured, also who the client is (ApiError 401 for an unknown API key)."""
        if self.identity is not None and request is not None:
            current_tenant.set(self.identity.tenant_of(request))
        replica = self.replica
        if not replica.ready and not replica.draining and self.cfg.ready_wait > 0:
            with contextlib.suppress(asyncio.TimeoutError):
                await replica.wait_ready(self.cfg.ready_wait)
        if replica.draining or not replica.ready:
            why = "shutting down" if replica.draining else "still catching up with the streams"
            return error_response(503, f"this router replica is {why}; retry on another",
                                  type="service_unavailable",
                                  headers={**self.headers(), "retry-after": "1"})
        return None

    async def opened(self, request: Request) -> tuple[bytes, dict[str, Any]] | Response:
        """The raw body and its JSON object of a request this replica takes (ApiError 400 for
        a body that is no JSON object), else the answer the client gets (:meth:`admit`)."""
        raw = await read_body(request)
        refused = await self.admit(request)
        if refused is not None:
            return refused
        return raw, request_object(raw)

    async def opened_for_model(self, request: Request
                               ) -> tuple[bytes, dict[str, Any], str] | Response:
        """:meth:`opened` for a route the body must name a model to (ApiError 400 without):
        the raw body, its JSON object and the model."""
        opened = await self.opened(request)
        if isinstance(opened, Response):
            return opened
        raw, body = opened
        model = model_of(body)
        assert model is not None
        return raw, body, model

    # --- one request, top-down -------------------------------------------------------------

    async def serve(self, endpoint: str, parsed: ParsedRequest, raw: bytes,
                    request: Request, received: float, started: float) -> Response:
        """One validated chat or completions request: shed, route, forward."""
        request_id = self.new_request_id()
        shed = self.shed(endpoint, parsed.model, parsed.priority)
        if shed is not None:
            return shed
        salt = self.cache_salt()
        if salt:
            # An isolated tenant's prompt is cached under its own salt; a cache_salt the
            # client sent is replaced, so no client can name another tenant's.
            parsed.body["cache_salt"] = salt
            raw = msgspec.json.encode(parsed.body)
        route_req = RouteRequest(
            request_id=request_id, model=parsed.model, token_ids=parsed.prompt_ids,
            # n choices of one prompt: one prefill, n times the output.
            expected_osl=min(parsed.expected_osl * parsed.n, MAX_TOKEN_COUNT),
            osl_hint=parsed.osl_hint, priority=PRIORITY_LEVEL[parsed.priority],
            overlap_weight=parsed.overlap_weight,
            latency_sensitivity=parsed.latency_sensitivity,
            session=self.session_of(parsed, request), cache_salt=salt)
        routing_started = time.perf_counter()
        decided = await self.first_hop(endpoint, route_req, disaggregated=True,
                                       body=parsed.body)
        if isinstance(decided, Response):
            return decided
        routed, transfer = decided
        self.observe(routed)
        routing_s = time.perf_counter() - routing_started
        session = route_req.session
        if routed.sticky is not None:
            self.metrics.session_routes.labels(how=routed.sticky).inc()
        closing = session is not None and session.action == "close"
        if session is not None and not closing and routed.sticky in ("open", "repin"):
            await self.engine_sessions.open(routed.worker_url, session.session_id)
        try:
            if parsed.n > 1:  # several choices interleave in one stream: relayed verbatim
                resp = await self._choices(endpoint, parsed, raw, route_req, routed, transfer)
            else:
                # Starts the engine request at once; answers once the decision is recorded.
                resp = await self.forwarder.forward(endpoint, parsed, raw, route_req, routed,
                                                    transfer)
        except DecisionNotRecorded as exc:
            return self.not_recorded(endpoint, exc, request_id)
        self.metrics.observe_overhead(routed.timings)
        if closing and routed.sticky == "pinned" and session is not None:
            self.engine_sessions.close_after(resp, routed.worker_url, session.session_id)
        if parsed.extra_fields:
            resp = await add_to_response(resp, NvextFields(
                parsed.extra_fields, routed, self.replica.replica_id,
                self.replica.config.state.block_size, received, started, routing_s))
        if (limits := rate_limit_headers.get()) is not None:
            resp.headers.update(limits)
        return resp

    async def relay(self, endpoint: str, req: RouteRequest, path: str, raw: bytes, *,
                    stream: bool, tier: str = PriorityTier.STANDARD,
                    watch: Callable[[Passthrough], None] | None = None,
                    **hooks: Any) -> Response:
        """A request forwarded verbatim to ``path`` on its engine: shed, first hop, answer.
        ``watch`` sees the :class:`Passthrough` before it runs; ``hooks`` go to it."""
        shed = self.shed(endpoint, req.model, tier)
        if shed is not None:
            return shed
        decided = await self.first_hop(endpoint, req)
        if isinstance(decided, Response):
            return decided
        routed, _ = decided
        self.observe(routed)
        forward = self.forwarder.passthrough(endpoint, req, routed, path, raw, stream=stream,
                                             **hooks)
        if watch is not None:
            watch(forward)
        try:
            return await forward.respond()
        except DecisionNotRecorded as exc:
            return self.not_recorded(endpoint, exc, req.request_id)

    async def unrouted(self, path: str, raw: bytes, model: str | None) -> Response:
        """A request an engine's tokenizer answers, without a routing decision
        (:mod:`api.forward.unrouted`)."""
        return await forward_unrouted(self.replica, self.forwarder.pool, path, raw, model,
                                      self.headers())

    # --- the steps -------------------------------------------------------------------------

    async def _choices(self, endpoint: str, parsed: ParsedRequest, raw: bytes,
                       route_req: RouteRequest, routed: Routed,
                       transfer: dict[str, Any] | None) -> Response:
        """``n > 1``: the engine's stream relayed as it sends it (:mod:`.passthrough`)."""
        path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
        body, on_event = raw, None
        if parsed.stream and not parsed.include_usage:
            # Usage is asked for all the same (the engine's output and cached token counts go
            # into the decision's RequestFinished) and not passed on.
            options = parsed.body.get("stream_options")
            options = {**options} if isinstance(options, dict) else {}
            body = msgspec.json.encode({**parsed.body, "stream_options": {
                **options, "include_usage": True}})
            on_event = _without_usage_chunk
        if transfer is not None:
            body = with_transfer(body, transfer)
        return await self.forwarder.passthrough(endpoint, route_req, routed, path, body,
                                                stream=parsed.stream,
                                                on_event=on_event).respond()

    def shed(self, endpoint: str, model: str, priority: str) -> Response | None:
        retry = self.shedder.check(model, priority)
        if retry is None:
            return None
        self.metrics.rejections.labels(reason=Rejection.SHED).inc()
        self.metrics.count_request(endpoint, "rejected")
        resp = overloaded_response(retry_after=retry)
        resp.headers.update(self.headers())
        return resp

    def session_of(self, parsed: ParsedRequest, request: Request) -> SessionRequest | None:
        if parsed.session_control is not None:
            sid, action, timeout = parsed.session_control
            return SessionRequest(sid, action, timeout if timeout is not None
                                  else self.cfg.session_ttl_secs)
        header = request.headers.get(SESSION_HEADER)
        if header is None:
            return None
        header = header.strip()
        if not header or len(header) > MAX_SESSION_ID:
            raise ApiError(400, f"Invalid '{SESSION_HEADER}' header: expected 1 to "
                           f"{MAX_SESSION_ID} characters.", param=SESSION_HEADER)
        return SessionRequest(header, "bind", self.cfg.session_ttl_secs)

    async def first_hop(self, endpoint: str, req: RouteRequest, *, disaggregated: bool = False,
                        body: dict[str, Any] | None = None
                        ) -> tuple[Routed, dict[str, Any] | None] | Response:
        """The decision (and a disaggregated request's KV hand-off fields), or the answer the
        client gets when there is none. ``disaggregated``: the route can run a prefill hop
        first (chat and completions, whose client ``body`` a vLLM prefill engine is sent);
        other routes go to an engine that does both."""
        metrics = self.metrics
        tenant = current_tenant.get()
        if tenant and not req.tenant:
            if self.cache_salt() and not req.cache_salt:
                # Only chat and completions bodies are salted for the engine: anything else
                # would reach the engine's shared prefix cache unsalted.
                raise ApiError(400, "this tenant's cache is isolated, which only "
                               "/v1/chat/completions and /v1/completions (one prompt) support")
            refused = self.admit_tenant(endpoint, tenant, req)
            if refused is not None:
                return refused
            req = replace(req, tenant=tenant, tenant_tokens=min(
                len(req.token_ids) + req.expected_osl, MAX_TOKEN_COUNT))
        routed = False
        try:
            waited = time.perf_counter()
            decided = await self.forwarder.hops.first_hop(req, endpoint=endpoint, body=body,
                                                          disaggregated=disaggregated)
            routed = True
            if req.tenant:  # the router queue's wait (routing itself is microseconds)
                self.metrics.tenant_queue_wait.labels(tenant=self.tenant_label(req.tenant)
                                                      ).observe(time.perf_counter() - waited)
            return decided
        except UnknownModel as exc:
            raise ApiError(404, str(exc), param="model", code="model_not_found") from None
        except NoWorkers as exc:
            metrics.rejections.labels(reason=Rejection.NO_WORKERS).inc()
            return error_response(503, str(exc), type="service_unavailable",
                                  headers=self.headers())
        except DecisionNotRecorded as exc:
            return self.not_recorded(endpoint, exc, req.request_id)
        except AllWorkersBusy:
            metrics.rejections.labels(reason=Rejection.BUSY).inc()
            metrics.count_request(endpoint, "rejected")
            resp = overloaded_response()
            resp.headers.update(self.headers())
            return resp
        finally:
            if req.tenant and not routed:
                self.replica.tenant_not_routed(req.request_id)

    def admit_tenant(self, endpoint: str, tenant: str, req: RouteRequest) -> Response | None:
        """None when ``tenant`` may start ``req`` (it then counts as this replica's pending
        admission); else the 429 the client gets. The rate-limit headers for the answer are
        left in ``rate_limit_headers`` when the tenant has limits."""
        tokens = min(len(req.token_ids) + req.expected_osl, MAX_TOKEN_COUNT)
        verdict = self.replica.admit_tenant(req.request_id, tenant, tokens)
        label = self.tenant_label(tenant)
        if verdict.admitted:
            self.metrics.tenant_requests.labels(tenant=label, outcome="admitted").inc()
            self.metrics.tenant_tokens.labels(tenant=label).inc(tokens)
            if verdict.limits.limited:
                rate_limit_headers.set(verdict.headers())
            return None
        self.metrics.tenant_requests.labels(tenant=label, outcome=f"limited_{verdict.reason}"
                                            ).inc()
        self.metrics.count_request(endpoint, "rejected")
        return rate_limited(verdict, tenant, self.headers(None, req.request_id))

    def cache_salt(self) -> str:
        """The cache_salt of this request's tenant when it is isolated, else ""."""
        tenant = current_tenant.get()
        limits = self.replica.state.tenants.limits.get(tenant) if tenant else None
        return limits.cache_salt if limits is not None and limits.isolated else ""

    def tenant_label(self, tenant: str) -> str:
        """The metric label: configured tenants by name, every other one as "other"."""
        return tenant if tenant in self.replica.state.tenants.limits else "other"

    def observe(self, routed: Routed) -> None:
        self.metrics.input_tokens.observe(routed.isl_tokens)
        if routed.total_blocks:
            self.metrics.kv_hit_rate.observe(routed.overlap_blocks / routed.total_blocks)

    def not_recorded(self, endpoint: str, exc: DecisionNotRecorded, request_id: str) -> Response:
        self.metrics.rejections.labels(reason=Rejection.DECISION_NOT_RECORDED).inc()
        self.metrics.count_request(endpoint, "rejected")
        return error_response(
            503, f"{exc}; this request was not served, retry it (on another replica if "
            "one is available)", type="service_unavailable",
            headers={**self.headers(None, request_id), "retry-after": "1"})


async def _without_usage_chunk(raw: bytes, payload: bytes | None) -> bytes:
    """Drops the usage-only chunk (no choices) of a stream whose client did not ask for it."""
    if payload is None or b'"usage"' not in payload:
        return raw
    try:
        obj = msgspec.json.decode(payload)
    except msgspec.DecodeError:
        return raw
    if isinstance(obj, dict) and not obj.get("choices") and isinstance(obj.get("usage"), dict):
        return b""
    return raw


def request_object(raw: bytes, *,
                   not_an_object: str = "Invalid request body: expected a JSON object.",
                   ) -> dict[str, Any]:
    """The JSON object of a request body, or ApiError 400 (``not_an_object`` for valid JSON
    that is not an object)."""
    body = decode_json(raw)
    if not isinstance(body, dict):
        raise ApiError(400, not_an_object)
    refuse_handoff_fields(body)  # only the router speaks the KV hand-off
    return body


def model_of(body: dict[str, Any], *, required: bool = True) -> str | None:
    model = body.get("model")
    if model is None and not required:
        return None
    if model is None:
        raise ApiError(400, "You must provide a model parameter.", param="model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "Invalid 'model': expected a non-empty string.", param="model")
    return model
