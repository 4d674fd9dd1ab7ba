"""Forwarding a routed request to its engine, migrating it when the engine fails (design.md §9,
issue 6 item 1).

A request is served by one or more *hops*. The first is the decision `api/app.py` made; when an
engine breaks (refused or reset connection, crash mid-stream, 5xx, no byte for the idle timeout)
the request is routed again under ``f"{base_id}~{n}"``, excluding every engine that failed it,
and continues there (see :mod:`api.migration`), up to ``migration_limit`` times. Each hop has its
own lifecycle on the router stream: `PrefillCompleted` at its first token and exactly one
`RequestFinished` — ``migrated`` for a hop that was moved away from, else ok / error / cancelled —
so the load it charged is freed whatever happens. Client cancellations and 4xx answers are never
migrated.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
from collections.abc import AsyncIterator, Callable

import msgspec
from fastapi.responses import Response
from starlette.types import Receive, Scope, Send

from api.errors import error_response
from api.hotpath import LeanStreamingResponse
from api.metrics import RouterMetrics
from api.migration import Continuation, Hop, HopPlan
from api.openai_schema import ParsedRequest
from api.proxy import Exchange, HopFailed, open_upstream, sse_error, upstream_events
from api.tokenizer import ByteTokenizer, Tokenizer
from api.upstream import UpstreamError, UpstreamPool, UpstreamResponse
from replicas.runtime.replica import Replica, Routed, RouteRequest, RoutingError

log = logging.getLogger("jetrouter.forward")

PREDICTED_HEADER = "x-jetrouter-predicted-cached-tokens"
DEFAULT_STREAM_IDLE_TIMEOUT = 30.0
DEFAULT_MIGRATION_LIMIT = 3
# (worker_id, reason) -> None or an awaitable (e.g. replicas.runtime.canary.report_passive(...)).
WorkerFailureHook = Callable[[str, str], object]


def replica_headers(replica_id: str, worker_id: str | None = None,
                    request_id: str | None = None) -> dict[str, str]:
    h = {"x-jetrouter-replica": replica_id}
    if worker_id:
        h["x-jetrouter-worker"] = worker_id
    if request_id:  # the id to look the decision up with: GET /admin/requests/{id}
        h["x-jetrouter-request-id"] = request_id
    return h


def _env_number(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        return float(raw)
    except ValueError:
        log.warning("ignoring %s=%r: not a number", name, raw)
        return default


class Forwarder:
    """Proxies routed requests; one instance per app.

    ``stream_idle_timeout`` / ``migration_limit`` default to the environment variables
    ``JETROUTER_STREAM_IDLE_TIMEOUT`` / ``JETROUTER_MIGRATION_LIMIT``, then to 30 s / 3.
    ``on_worker_failure(worker_id, reason)`` is called for every failed hop (the passive signal
    of the circuit breakers); if it returns an awaitable, that runs as a background task.

    The Forwarder owns its connections to the engines (``self.pool``, an
    :class:`api.upstream.UpstreamPool`); ``client`` is accepted for compatibility with callers
    that still pass an httpx client factory, and ignored. :meth:`aclose` closes idle connections.
    """

    def __init__(self, replica: Replica, metrics: RouterMetrics,
                 client: Callable[[], object] | None = None, *,
                 tokenizer: Tokenizer | None = None,
                 stream_idle_timeout: float | None = None,
                 migration_limit: int | None = None,
                 connect_timeout: float = 5.0,
                 chat_default_max_tokens: int = 256,
                 on_worker_failure: WorkerFailureHook | None = None) -> None:
        self.replica = replica
        self.metrics = metrics
        self.tokenizer: Tokenizer = tokenizer or ByteTokenizer()
        idle = stream_idle_timeout if stream_idle_timeout is not None else _env_number(
            "JETROUTER_STREAM_IDLE_TIMEOUT", DEFAULT_STREAM_IDLE_TIMEOUT)
        limit = migration_limit if migration_limit is not None else int(_env_number(
            "JETROUTER_MIGRATION_LIMIT", DEFAULT_MIGRATION_LIMIT))
        if idle <= 0:
            raise ValueError("stream_idle_timeout must be > 0")
        if limit < 0:
            raise ValueError("migration_limit must be >= 0")
        self.stream_idle_timeout = idle
        self.migration_limit = limit
        self.chat_default_max_tokens = chat_default_max_tokens
        self.on_worker_failure = on_worker_failure
        self._reports: set[asyncio.Future[object]] = set()
        # The pool's idle timeout fires when the engine sends nothing for that long.
        self.pool = UpstreamPool(connect_timeout=connect_timeout, idle_timeout=idle)

    async def aclose(self) -> None:
        """Close the idle upstream connections (call once at shutdown)."""
        await self.pool.aclose()

    def report_failure(self, worker_id: str, reason: str) -> None:
        """Tell the hook (if any) an engine failed a hop; an awaitable result runs in the
        background, so a health report never holds up the request."""
        if self.on_worker_failure is None:
            return
        try:
            result = self.on_worker_failure(worker_id, reason)
            if inspect.isawaitable(result):
                task = asyncio.ensure_future(result)
                self._reports.add(task)
                task.add_done_callback(self._reports.discard)
        except Exception:
            log.exception("on_worker_failure hook failed")

    async def forward(self, endpoint: str, parsed: ParsedRequest, raw: bytes,
                      routed: Routed) -> Response:
        run = _Run(self, endpoint, parsed, raw, routed)
        early = await run.open_first()
        headers = replica_headers(self.replica.replica_id, run.first_worker, routed.request_id)
        # The reuse this replica predicted on the engine it picked (compare with the usage's
        # prompt_tokens_details.cached_tokens, the engine's own count).
        headers[PREDICTED_HEADER] = str(run.hop.predicted_tokens)
        if early is not None:
            early.headers.update(headers)
            return early
        if parsed.stream:
            return _RunStream(run, headers)
        return await run.collect()


class _RunStream(LeanStreamingResponse):
    """The SSE response of one run. If the client vanishes before the body is ever iterated, or
    while it is parked between chunks, the run is closed here at once instead of whenever the
    abandoned generator is collected: the load its hop charged must not linger."""

    def __init__(self, run: _Run, headers: dict[str, str]) -> None:
        super().__init__(run.events(), media_type="text/event-stream", headers=headers)
        self.run = run

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.run.abandon()


class _Run:
    """One client request through all its hops."""

    def __init__(self, fw: Forwarder, endpoint: str, parsed: ParsedRequest, raw: bytes,
                 routed: Routed) -> None:
        self.fw = fw
        self.endpoint = endpoint
        self.parsed = parsed
        self.base = routed
        self.cont = Continuation(parsed, raw, fw.tokenizer.encode,
                                 chat_default_max_tokens=fw.chat_default_max_tokens)
        self.plan: HopPlan = self.cont.plan()
        self.hop: Hop = self.cont.start_hop(routed, self.plan)
        self.ex = Exchange()
        self.resp: UpstreamResponse | None = None
        self.failed: set[str] = set()
        self.migrations = 0
        self.give_up: str | None = None     # why we stopped trying (for the client)
        self.first_worker: str | None = None  # the engine whose answer started the response
        self.request_done = False

    # --- bookkeeping --------------------------------------------------------------------------

    def _end_hop(self, hop: Hop, outcome: str) -> None:
        if not hop.ended:
            hop.ended = True
            cached = hop.cached_tokens
            self.fw.replica.finished(hop.request_id, outcome, hop.count, cached)
            if cached >= 0:
                self.fw.metrics.kv_prediction_error.observe(hop.predicted_tokens - cached)

    def _end_request(self, outcome: str) -> None:
        if self.request_done:
            return
        self.request_done = True
        m = self.fw.metrics
        m.count_request(self.endpoint, outcome)
        if self.ex.ttft is not None:
            m.ttft.observe(self.ex.ttft)
        for gap in self.ex.itl:
            m.itl.observe(gap)
        if outcome == "ok":
            m.output_tokens.observe(sum(h.count for h in self.cont.hops))

    def _on_token(self) -> None:
        self.ex.token()
        if not self.hop.prefilled:
            self.hop.prefilled = True
            self.fw.replica.prefill_completed(self.hop.request_id)

    async def _close(self) -> None:
        resp, self.resp = self.resp, None
        if resp is not None:
            resp.close()

    # --- hops ---------------------------------------------------------------------------------

    async def _migrate(self, failure: HopFailed) -> bool:
        """Route the next hop after ``failure``; False (and ``give_up`` set) when we cannot."""
        failed = self.hop
        self.failed.add(failed.worker_id)
        log.warning("request %s: engine %s failed (%s); %s", self.base.request_id,
                    failed.worker_id, failure, "migrating" if self.migrations <
                    self.fw.migration_limit else "migration limit reached")
        self.fw.report_failure(failed.worker_id, failure.reason)
        if self.migrations >= self.fw.migration_limit:
            self.give_up = (f"the inference engine failed ({failure.reason}) and the migration "
                            f"limit ({self.fw.migration_limit}) is reached")
            self._end_hop(failed, "error")
            return False
        plan = self.cont.plan()
        hop_id = f"{self.base.request_id}~{self.migrations + 1}"
        try:
            routed = await self.fw.replica.route(RouteRequest(
                request_id=hop_id, model=self.parsed.model, token_ids=plan.token_ids,
                expected_osl=plan.expected_osl, priority=self.base.event.priority,
                overlap_weight=self.parsed.overlap_weight,
                latency_sensitivity=self.parsed.latency_sensitivity,
                exclude=frozenset(self.failed)))
        except Exception as exc:  # RoutingError, or the decision could not be appended
            if not isinstance(exc, RoutingError):
                log.exception("request %s: re-routing failed", self.base.request_id)
            self.give_up = (f"the inference engine failed ({failure.reason}) and no other "
                            f"engine can take the request: {exc}")
            self._end_hop(failed, "error")
            return False
        self._end_hop(failed, "migrated")
        self.migrations += 1
        self.fw.metrics.migrations.labels(reason=failure.reason).inc()
        self.plan = plan
        self.hop = self.cont.start_hop(routed, plan)
        return True

    async def _open(self) -> tuple[int, bytes, str] | None:
        """Open hops until one answers 200 (None, ``self.resp`` set), or return the answer the
        client gets instead: (status, body, content type) — an engine's 4xx, or our 502."""
        while True:
            url = self.hop.routed.worker_url.rstrip("/") + self.plan.path
            try:
                resp = await open_upstream(self.fw.pool, url, self.plan.body,
                                           self.hop.request_id)
            except HopFailed as failure:
                if await self._migrate(failure):
                    continue
                body = msgspec.json.encode({"error": {
                    "message": self.give_up, "type": "upstream_error", "param": None,
                    "code": 502}})
                return 502, body, "application/json"
            if resp.status_code == 200:
                self.resp = resp
                return None
            # The engine judged the request itself (4xx): another engine would say the same.
            try:
                body = await resp.aread()
            except (UpstreamError, OSError) as exc:  # the 4xx body broke off: keep the status
                body = msgspec.json.encode({"error": {
                    "message": f"the inference engine answered HTTP {resp.status_code} "
                               f"and then failed ({type(exc).__name__})",
                    "type": "upstream_error", "param": None, "code": resp.status_code}})
            finally:
                resp.close()
            self._end_hop(self.hop, "error")
            return resp.status_code, body, resp.headers.get("content-type", "application/json")

    async def open_first(self) -> Response | None:
        """Open the first working hop; a Response when the request ends before streaming."""
        try:
            early = await self._open()
        except BaseException:
            self._end_hop(self.hop, "cancelled")
            self._end_request("cancelled")
            raise
        if early is None:
            self.first_worker = self.hop.worker_id
            return None
        status, body, ctype = early
        self._end_request("error")
        return Response(body, status_code=status, media_type=ctype)

    async def events(self) -> AsyncIterator[bytes]:
        """The client's SSE stream, migrating across hops as engines fail."""
        outcome = "error"
        try:
            while True:
                assert self.resp is not None
                upstream = upstream_events(self.resp)
                try:
                    async for raw, payload in upstream:
                        out, token = self.cont.on_event(self.hop, raw, payload)
                        if token:
                            self._on_token()
                        if out is not None:
                            yield out
                    if not self.cont.complete:
                        raise HopFailed("stream_error",
                                        "the engine closed the stream before finishing")
                except HopFailed as exc:
                    failure: HopFailed | None = exc
                else:
                    failure = None
                finally:
                    await upstream.aclose()
                await self._close()
                if failure is None or self.cont.complete:
                    # Every token is in (a break after the last one is not worth a new hop).
                    outcome = "ok"
                    yield self.cont.tail()
                    return
                if await self._migrate(failure):
                    early = await self._open()
                else:
                    early = 502, b"", ""
                if early is not None:
                    self.give_up = self.give_up or _describe(early)
                    yield sse_error(self.give_up)
                    yield b"data: [DONE]\n\n"
                    return
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "cancelled"
            raise
        finally:
            self._end_hop(self.hop, outcome)
            self._end_request(outcome)
            await self._close()

    async def abandon(self) -> None:
        """End whatever is still open as cancelled (no-op after a normal end)."""
        self._end_hop(self.hop, "cancelled")  # bookkeeping first: it must not wait on I/O
        self._end_request("cancelled")
        await self._close()

    async def collect(self) -> Response:
        """A non-streaming client: run the same hops, answer with one JSON body."""
        stream = self.events()
        try:
            async for _ in stream:
                pass
        finally:
            await stream.aclose()
        # The engine that finished the answer; the migration count says whether it had help.
        headers = replica_headers(self.fw.replica.replica_id, self.hop.worker_id,
                                  self.base.request_id)
        headers[PREDICTED_HEADER] = str(self.cont.hops[0].predicted_tokens)
        if self.migrations:
            headers["x-jetrouter-migrations"] = str(self.migrations)
        if self.request_done and self.give_up is None and self.cont.complete:
            return Response(msgspec.json.encode(self.cont.response_body()),
                            media_type="application/json", headers=headers)
        return error_response(502, self.give_up or "the inference engine failed",
                              type="upstream_error", headers=headers)


def _describe(early: tuple[int, bytes, str]) -> str:
    status, body, _ = early
    try:
        err = msgspec.json.decode(body)["error"]
        detail = err["message"] if isinstance(err, dict) else str(err)
    except Exception:  # any shape: fall back to the raw text
        detail = body[:200].decode("utf-8", "replace")
    return f"the inference engine rejected the continued request (HTTP {status}): {detail}"
