"""Forwarding a routed request: one :class:`Forwarder` per app, one hop runner per request — a
:class:`api.forward.run.Run` (relayed token by token, continued on another engine mid-stream) or
a :class:`api.forward.passthrough.Passthrough` (relayed verbatim) — and the streaming response
that closes a run its client abandoned."""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any

from fastapi.responses import Response
from starlette.types import Receive, Scope, Send

from api.config import option
from api.forward.connect_retry import ConnectRetries, ConnectRetryPolicy, HeardAgo
from api.forward.context import PREDICTED_HEADER, RunContext, replica_headers
from api.forward.engine import HopFailure
from api.forward.first_byte import FirstBytePolicy, FirstByteWaits
from api.forward.hops import HopRouter
from api.forward.passthrough import Passthrough
from api.forward.prefill import PrefillHop
from api.forward.run import Run
from api.metrics import RouterMetrics
from api.openai_schema import ParsedRequest
from api.tokenizer import ByteTokenizer, Tokenizer
from api.upstream import UpstreamPool
from leanhttp.hotpath import LeanStreamingResponse
from replicas.runtime.replica import Replica, Routed, RouteRequest

log = logging.getLogger("jetrouter.forward")

# (worker_id, reason) -> None or an awaitable (e.g. replicas.runtime.canary.report_passive(...)).
WorkerFailureHook = Callable[[str, str], object]


class Forwarder:
    """Proxies routed requests; one instance per app.

    ``stream_idle_timeout`` / ``migration_limit`` default to `serve`'s options of those names
    (their ``JETROUTER_*`` variables, else their defaults; api/config.py).
    ``on_worker_failure(worker_id, reason)`` is called for every failed hop (the passive signal
    of the circuit breakers); if it returns an awaitable, that runs as a background task. A
    connect that timed out to an engine still alive is not such a signal: ``heard_ago(worker_id)``
    (seconds since the replica last heard the engine's load gauge) within ``alive_within`` says
    alive, and such a hop is retried or moved (:mod:`api.forward.connect_retry`); such an
    engine silent before its first byte is waited for up to ``first_byte_timeout`` while
    ``kv_heard_ago(worker_id)`` (seconds since a KV message of the engine was applied) says it
    works (:mod:`api.forward.first_byte`; default `serve`'s ``--first-byte-timeout``).

    The Forwarder owns its connections to the engines (``self.pool``, an
    :class:`api.upstream.UpstreamPool`); :meth:`aclose` closes the idle ones. ``self.hops``
    routes every hop (:class:`api.forward.hops.HopRouter`), running the prefill hop of
    requests for models served disaggregated (:mod:`api.forward.prefill`) on the same
    connections.
    """

    def __init__(self, replica: Replica, metrics: RouterMetrics, *,
                 tokenizer: Tokenizer | None = None,
                 stream_idle_timeout: float | None = None,
                 migration_limit: int | None = None,
                 connect_timeout: float = 5.0,
                 chat_default_max_tokens: int = 256,
                 on_worker_failure: WorkerFailureHook | None = None,
                 heard_ago: HeardAgo | None = None,
                 alive_within: float = 10.0,
                 first_byte_timeout: float | None = None,
                 kv_heard_ago: HeardAgo | None = None) -> None:
        self.replica = replica
        self.metrics = metrics
        self.tokenizer: Tokenizer = tokenizer or ByteTokenizer()
        idle = (stream_idle_timeout if stream_idle_timeout is not None
                else option("stream-idle-timeout").value())
        limit = (migration_limit if migration_limit is not None
                 else option("migration-limit").value())
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
        # A hop's connects to a live engine may go on as long as it may wait for a byte.
        self.connects = ConnectRetries(
            ConnectRetryPolicy(connect_timeout=connect_timeout, window=idle,
                               alive_within=alive_within),
            heard_ago, record=lambda action: metrics.connect_timeouts.labels(action=action).inc())
        # A live engine silent before its first byte is waited for (api/forward/first_byte.py).
        self.first_byte = FirstByteWaits(
            FirstBytePolicy(first_byte_timeout if first_byte_timeout is not None
                            else option("first-byte-timeout").value()),
            self.connects.alive, functools.partial(_working, kv_heard_ago, idle),
            record=lambda action: metrics.first_byte_waits.labels(action=action).inc())
        prefill = PrefillHop(replica, self.pool, on_worker_failure=self.report_failure,
                             on_transfer=metrics.kv_transfer_blocks.observe,
                             patience=self.first_byte.patience)
        self.hops = HopRouter(
            replica, prefill,
            on_disaggregated=lambda outcome: metrics.disaggregated.labels(outcome=outcome).inc())
        self.context = RunContext(replica, metrics, self.pool, self.tokenizer, self.hops, limit,
                                  chat_default_max_tokens, self.report_failure, self.connects,
                                  self.first_byte)

    async def aclose(self) -> None:
        """Close the idle upstream connections (call once at shutdown)."""
        await self.pool.aclose()

    def report_failure(self, worker_id: str, reason: str) -> None:
        """Tell the hook (if any) an engine failed a hop; an awaitable result runs in the
        background, so a health report never holds up the request."""
        if self.on_worker_failure is None:
            return
        if reason == HopFailure.CONNECT_TIMEOUT and self.connects.alive(worker_id):
            return  # busy, not dead: its canary judges it (api/forward/connect_retry.py)
        try:
            result = self.on_worker_failure(worker_id, reason)
            if inspect.isawaitable(result):
                task = asyncio.ensure_future(result)
                self._reports.add(task)
                task.add_done_callback(self._reports.discard)
        except Exception:
            log.exception("on_worker_failure hook failed")

    async def forward(self, endpoint: str, parsed: ParsedRequest, raw: bytes,
                      request: RouteRequest, routed: Routed,
                      transfer: dict[str, Any] | None = None) -> Response:
        """Chat or completions with one choice, first routed as ``request`` → ``routed``.
        ``transfer``: the KV hand-off fields of a disaggregated request's prefill hop, passed
        to the decode engine with the first hop. Starts the engine request at once; answers
        once the decision is recorded (raises :class:`DecisionNotRecorded` if it was not)."""
        run = Run(self.context, endpoint, parsed, raw, request, routed, transfer,
                  self.hops.prefill.concurrent.pop(routed.request_id, None))
        early = await run.open_first()
        headers = replica_headers(self.replica.replica_id, run.first_worker, routed.request_id)
        # The reuse this replica predicted on the engine it picked (compare with the usage's
        # prompt_tokens_details.cached_tokens, the engine's own count).
        headers[PREDICTED_HEADER] = str(run.hop.predicted_tokens)
        if early is not None:
            early.headers.update(headers)
            return early
        if parsed.stream:
            return RunStream(run, headers)
        return await run.collect()

    def passthrough(self, endpoint: str, request: RouteRequest, routed: Routed, path: str,
                    body: bytes, *, stream: bool, **hooks: Any) -> Passthrough:
        """A request forwarded verbatim (:mod:`api.forward.passthrough`); ``respond()`` runs
        it."""
        return Passthrough(self.context, endpoint, request, routed, path, body, stream=stream,
                           **hooks)


def _working(kv_heard_ago: HeardAgo | None, within: float, worker_id: str) -> bool:
    """Whether a KV message of the engine was applied within ``within`` seconds."""
    if kv_heard_ago is None:
        return False
    heard = kv_heard_ago(worker_id)
    return heard is not None and heard <= within


class RunStream(LeanStreamingResponse):
    """The SSE response of one run. If the client vanishes before the body is ever iterated, or
    while it is parked between chunks, the run is closed here at once instead of whenever the
    abandoned generator is collected: the load its hop charged must not linger."""

    def __init__(self, run: Run, headers: dict[str, str]) -> None:
        super().__init__(run.events(), media_type="text/event-stream", headers=headers)
        self.run = run

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.run.abandon()
