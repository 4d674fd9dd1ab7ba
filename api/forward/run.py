"""One client request through all its hops: the hop lifecycle and the migration policy.

Everything a hop does on the router stream happens here, in three methods: :meth:`Run._start_hop`
(the routing decision is already submitted), :meth:`Run._first_token` (``PrefillCompleted``,
once) and :meth:`Run._end_hop` (exactly one ``RequestFinished``, so the load the hop charged is
freed whatever happens). A hop's engine request starts while its decision's append is still on
its way to JetStream; :meth:`Run._open` waits for the decision only once the engine answered, so
nothing reaches the client before the decision is recorded (or served through an election), and
a refused decision cancels the engine request (``not_routed``). When an engine fails a hop,
:meth:`Run._next_hop` is the whole migration policy: the limit, the engines excluded, the hop id,
and how the failed hop ends — or, when the connect to a live engine timed out and no other
engine can take the request, the same hop connecting again (:mod:`api.forward.connect_retry`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

import msgspec
from fastapi.responses import Response

from api import tracing
from api.errors import error_response, sse_error, sse_internal_error, upstream_error_body
from api.forward.connect_retry import ConnectTries, TimeoutAction
from api.forward.context import PREDICTED_HEADER, RunContext, replica_headers
from api.forward.continuation import Continuation, Hop, HopPlan, with_transfer
from api.forward.engine import (
    DONE_EVENT,
    HopFailed,
    HopFailure,
    open_upstream,
    upstream_event_batches,
)
from api.forward.sglang_handoff import ConcurrentPrefill
from api.openai_schema import ParsedRequest
from api.upstream import UpstreamError, UpstreamResponse
from eventlog.events import Outcome
from leanhttp.hotpath import LastChunk
from replicas.core.load import output_blocks
from replicas.runtime.replica import DecisionNotRecorded, Routed, RouteRequest, RoutingError

log = logging.getLogger("jetrouter.forward")

# The outcome of jetrouter_disaggregated_requests_total for a hand-off the decode engine could
# not use (api.forward.prefill.DisaggOutcome.PULL_FAILED; run does not import prefill).
PULL_FAILED = "pull_failed"


@dataclass(slots=True)
class Exchange:
    """Client-visible timing of one request across all its hops."""

    started: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    last_token_at: float | None = None
    itl: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.started

    def token(self) -> None:
        now = time.perf_counter()
        if self.first_token_at is None:
            self.first_token_at = now
        elif self.last_token_at is not None:
            self.itl.append(now - self.last_token_at)
        self.last_token_at = now


# What the client gets when no hop answered 200: (status, body, content type).
EarlyAnswer = tuple[int, bytes, str]


class Run:
    """One client request through all its hops."""

    def __init__(self, ctx: RunContext, endpoint: str, parsed: ParsedRequest, raw: bytes,
                 request: RouteRequest, routed: Routed,
                 transfer: dict[str, Any] | None = None,
                 beside: ConcurrentPrefill | None = None) -> None:
        self.ctx = ctx
        self.endpoint = endpoint
        self.parsed = parsed
        self.request = request  # as the first hop was routed
        self.base = routed
        self.cont = Continuation(parsed, raw, ctx.tokenizer.encode,
                                 chat_default_max_tokens=ctx.chat_default_max_tokens)
        plan = self.cont.plan()
        if transfer is not None:  # only the first hop: a migration prefills on its engine
            plan = replace(plan, body=with_transfer(plan.body, transfer))
        self.plan: HopPlan = plan
        self.connect_tries: ConnectTries | None = None  # the current hop's connects, if retried
        self.hop: Hop = self._start_hop(routed, plan)
        self.beside = beside  # an SGLang prefill request the first hop's engine waits on
        self.handoff = transfer is not None  # the first hop pulls its prompt's KV blocks
        self.ex = Exchange()
        self.resp: UpstreamResponse | None = None
        self.failed: set[str] = set()
        self.migrations = 0
        self.give_up: str | None = None     # why we stopped trying (for the client)
        self.first_worker: str | None = None  # the engine whose answer started the response
        self.request_done = False
        self.router_fault = False  # the router itself failed (not an engine): a 500, not a 502

    # --- a hop's lifecycle on the router stream -------------------------------------------------

    def _start_hop(self, routed: Routed, plan: HopPlan) -> Hop:
        """The hop's decision is on its way to the stream (``Replica.route`` submitted it)."""
        self.plan = plan
        self.connect_tries = None
        return self.cont.start_hop(routed, plan)

    def _first_token(self) -> None:
        self.ex.token()
        if not self.hop.prefilled:
            self.hop.prefilled = True
            self.ctx.replica.prefill_completed(self.hop.request_id)

    def _output_progress(self) -> None:
        """With output-block tracking, report each block boundary generation crosses."""
        hop = self.hop
        e = hop.routed.event
        if not e.track_output_blocks or e.block_size < 1:
            return
        crossed = output_blocks(e.isl_tokens, hop.tokens, e.block_size)
        if crossed > hop.output_blocks:
            hop.output_blocks = crossed
            self.ctx.replica.output_progress(hop.request_id, hop.tokens)

    def _end_hop(self, hop: Hop, outcome: Outcome) -> None:
        if not hop.ended:
            hop.ended = True
            if self.beside is not None and hop is self.cont.hops[0]:
                self.beside.decode_ended()  # however it ended: a prefill for nobody stops
            cached = hop.cached_tokens
            self.ctx.replica.finished(hop.request_id, outcome, hop.count, cached)
            if cached >= 0:
                self.ctx.metrics.kv_prediction_error.observe(hop.predicted_tokens - cached)

    def _end_request(self, outcome: Outcome) -> None:
        if self.request_done:
            return
        self.request_done = True
        m = self.ctx.metrics
        m.count_request(self.endpoint, outcome)
        if self.ex.ttft is not None:
            m.ttft.observe(self.ex.ttft)
            if self.handoff and not self.migrations:  # the first token came after the pull
                m.kv_handoff_seconds.observe(self.ex.ttft)
        for gap in self.ex.itl:
            m.itl.observe(gap)
        if outcome == Outcome.OK:
            m.output_tokens.observe(sum(h.count for h in self.cont.hops))

    async def _close(self) -> None:
        resp, self.resp = self.resp, None
        if resp is not None:
            resp.close()

    # --- the migration policy -------------------------------------------------------------------

    async def _next_hop(self, failure: HopFailed) -> bool:
        with tracing.migration(self.base.request_id, self.migrations + 1, self.hop.worker_id,
                               failure.reason) as span:
            before = self.hop
            again = await self._migrate(failure)
            span.moved(again and self.hop is not before)
            return again

    async def _migrate(self, failure: HopFailed) -> bool:
        """After ``failure``: route the next hop, excluding every engine that failed this request,
        under ``<request_id>~<n>``, at most ``migration_limit`` times. The failed hop ends
        ``migrated`` when the next one is routed, else ``error`` (and ``give_up`` says why).
        True: open ``self.hop`` — the next one, or the same one again when its connect timed out
        to an engine still alive and no other engine takes the request."""
        failed = self.hop
        # A decode engine that could not pull the prompt's blocks (the prefill engine restarted,
        # its lease on them ran out) fails the request itself before any token. It is alive, so
        # it stays a candidate and is not reported; the next hop carries no hand-off and
        # computes the prompt.
        pull_failed = (self.handoff and failed is self.cont.hops[0] and failed.tokens == 0
                       and failure.engine_answered)
        if pull_failed and self.beside is None:  # served aggregated after all
            # (An SGLang hand-off that failed was counted prefill_failed when its prefill
            # request ended: PrefillHop.start_beside.)
            self.ctx.metrics.disaggregated.labels(outcome=PULL_FAILED).inc()
        if not pull_failed:
            self.failed.add(failed.worker_id)
        limit = self.ctx.migration_limit
        log.warning("request %s: engine %s failed (%s); %s", self.base.request_id,
                    failed.worker_id, failure, "migrating" if self.migrations < limit
                    else "migration limit reached")
        if not pull_failed:
            self.ctx.report_failure(failed.worker_id, failure.reason)
        timed_out = failure.reason == HopFailure.CONNECT_TIMEOUT
        plan = self.cont.plan()
        routed: Routed | None = None
        if self.migrations >= limit:
            why = f"the migration limit ({limit}) is reached"
        else:
            try:
                routed = await self.ctx.hops.next_hop(
                    self.request, self.migrations + 1, exclude=frozenset(self.failed),
                    session=self.base.session, tenant=self.base.event.tenant,
                    token_ids=plan.token_ids, expected_osl=plan.expected_osl,
                    osl_hint=plan.expected_osl if self.parsed.osl_hint else 0)
            except Exception as exc:  # RoutingError, or the decision could not be appended
                if not isinstance(exc, RoutingError):
                    log.exception("request %s: re-routing failed", self.base.request_id)
                why = f"no other engine can take the request: {exc}"
        if routed is None:
            # An SGLang decode hop's prefill request runs beside it: no second connect there.
            beside = self.beside is not None and failed is self.cont.hops[0]
            if timed_out and not beside and await self._connect_again(failed):
                return True
            if timed_out:
                self.ctx.connects.record(TimeoutAction.FAILED)
            self.give_up = f"the inference engine failed ({failure.reason}) and {why}"
            self._end_hop(failed, Outcome.ERROR)
            return False
        if timed_out:
            self.ctx.connects.record(TimeoutAction.MIGRATED)
        self._end_hop(failed, Outcome.MIGRATED)
        self.migrations += 1
        self.ctx.metrics.migrations.labels(reason=failure.reason).inc()
        self.hop = self._start_hop(routed, plan)
        return True

    async def _connect_again(self, hop: Hop) -> bool:
        """The connect to ``hop``'s engine timed out and nothing else takes the request: if the
        engine is alive and the hop has time left, wait the backoff and keep the hop (True)."""
        tries = await self.ctx.connects.again_if_alive(self.connect_tries, hop.worker_id,
                                                       hop.request_id)
        if tries is None:
            return False
        self.connect_tries = tries
        return True

    # --- hops -----------------------------------------------------------------------------------

    async def _open(self) -> EarlyAnswer | None:
        """Open hops until one answers 200 and its decision is recorded (None, ``self.resp``
        set), or return the answer the client gets instead: an engine's 4xx, or our 502.
        Raises :class:`DecisionNotRecorded` when JetStream refused the hop's decision: the
        engine request is closed (cancelled) and the hop ended ``not_routed``."""
        while True:
            hop = self.hop
            record = hop.routed.record
            if record is not None and record.refused:  # known before the engine is asked
                self._refused(hop)
                await self.ctx.replica.recorded(hop.routed)  # raises DecisionNotRecorded
            url = hop.routed.worker_url.rstrip("/") + self.plan.path
            try:
                tries = self.connect_tries
                opening = open_upstream(
                    self.ctx.pool, url, self.plan.body, hop.request_id,
                    connect_timeout=tries.timeout if tries else None,
                    patience=self.ctx.first_byte.patience(
                        hop.worker_id, hop.request_id,
                        handoff=self.handoff and hop is self.cont.hops[0]))
                beside = self.beside if hop is self.cont.hops[0] else None
                resp = await (beside.opened(opening) if beside is not None else opening)
            except HopFailed as failure:
                if await self._next_hop(failure):
                    continue
                return 502, upstream_error_body(self.give_up or ""), "application/json"
            try:
                # Usually acknowledged already: the append ran while the engine answered.
                await self.ctx.replica.recorded(hop.routed)
            except BaseException as exc:
                resp.close()  # the engine sees its client go and cancels the request
                if isinstance(exc, DecisionNotRecorded):
                    self._refused(hop)
                raise
            if resp.status_code == 200:
                self.resp = resp
                return None
            # The engine judged the request itself (4xx): another engine would say the same.
            try:
                body = await resp.aread()
            except (UpstreamError, OSError) as exc:  # the 4xx body broke off: keep the status
                body = upstream_error_body(
                    f"the inference engine answered HTTP {resp.status_code} and then failed "
                    f"({type(exc).__name__})", resp.status_code)
            finally:
                resp.close()
            self._end_hop(self.hop, Outcome.ERROR)
            return resp.status_code, body, resp.headers.get("content-type", "application/json")

    def _refused(self, hop: Hop) -> None:
        """JetStream refused ``hop``'s decision: the hop ends ``not_routed`` (its finish follows
        the decision on the subject, closing it wherever it did land)."""
        self._end_hop(hop, Outcome.NOT_ROUTED)

    async def _open_next(self) -> EarlyAnswer | None:
        """:meth:`_open` for a hop after the client has seen the response start: a refused
        decision ends the request with an error event instead of a 503."""
        try:
            return await self._open()
        except DecisionNotRecorded as exc:
            self.give_up = f"the request could not continue on another engine: {exc}"
            return 503, b"", ""

    async def open_first(self) -> Response | None:
        """Open the first working hop; a Response when the request ends before streaming."""
        try:
            early = await self._open()
        except DecisionNotRecorded:
            self.request_done = True  # counted by its caller, as a rejection (nothing was sent)
            raise
        except BaseException:
            self._end_hop(self.hop, Outcome.CANCELLED)
            self._end_request(Outcome.CANCELLED)
            raise
        if early is None:
            self.first_worker = self.hop.worker_id
            return None
        status, body, ctype = early
        self._end_request(Outcome.ERROR)
        return Response(body, status_code=status, media_type=ctype)

    async def events(self) -> AsyncIterator[bytes]:
        """The client's SSE stream, migrating across hops as engines fail. A fault of the
        router's own while streaming ends the stream with an error event and ``[DONE]``."""
        outcome = Outcome.ERROR
        ended = False  # the body's last chunk went out: nothing may follow it
        try:
            while True:
                assert self.resp is not None
                upstream = upstream_event_batches(self.resp)
                if self.beside is not None and self.hop is self.cont.hops[0]:
                    upstream = self.beside.events(upstream)
                try:
                    async for events in upstream:
                        # What one read from the engine brought goes out in one write (one
                        # chunk of the client's response, one send on its socket).
                        outs, failed = self._on_events(events)
                        if outs:
                            yield outs
                        if failed is not None:
                            raise failed
                    if not self.cont.complete:
                        raise HopFailed(HopFailure.STREAM_ERROR,
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
                    outcome = Outcome.OK
                    ended = True
                    yield LastChunk(self.cont.tail())
                    return
                early: EarlyAnswer | None
                if await self._next_hop(failure):
                    early = await self._open_next()
                else:
                    early = 502, b"", ""
                if early is not None:
                    self.give_up = self.give_up or _describe(early)
                    ended = True
                    yield LastChunk(sse_error(self.give_up) + DONE_EVENT)
                    return
        except (asyncio.CancelledError, GeneratorExit):
            outcome = Outcome.CANCELLED
            raise
        except Exception:
            # The response head (status 200) is out, so an answer of 500 is no longer
            # possible: the client gets the failure as an error event and a complete body,
            # which OpenAI's clients raise as an APIError, instead of a cut chunked body.
            log.exception("request %s: the router failed while streaming the response",
                          self.base.request_id)
            self.give_up = self.give_up or "the router failed while streaming the response"
            self.router_fault = True
            if not ended:
                yield LastChunk(sse_internal_error(self.give_up) + DONE_EVENT)
        finally:
            try:
                self._end_hop(self.hop, outcome)
                self._end_request(outcome)
            except Exception:
                # The body is complete by now; a fault in the bookkeeping after it must not
                # reach the server as an error of a response that already ended.
                log.exception("request %s: ending the request failed", self.base.request_id)
            await self._close()

    def _on_events(self, events: list[tuple[bytes, bytes | None]]
                   ) -> tuple[bytes, HopFailed | None]:
        """The client's bytes for a batch of the engine's events, and the failure an error
        event raised: the events before it still go out (their tokens count as delivered)."""
        outs: list[bytes] = []
        try:
            for raw, payload in events:
                out, token = self.cont.on_event(self.hop, raw, payload)
                if token:
                    self._first_token()
                    self._output_progress()
                if out is not None:
                    outs.append(out)
        except HopFailed as exc:
            return b"".join(outs), exc
        return (outs[0] if len(outs) == 1 else b"".join(outs)), None

    async def abandon(self) -> None:
        """End whatever is still open as cancelled (no-op after a normal end)."""
        self._end_hop(self.hop, Outcome.CANCELLED)  # bookkeeping first: it must not wait on I/O
        self._end_request(Outcome.CANCELLED)
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
        headers = replica_headers(self.ctx.replica.replica_id, self.hop.worker_id,
                                  self.base.request_id)
        headers[PREDICTED_HEADER] = str(self.cont.hops[0].predicted_tokens)
        if self.migrations:
            headers["x-jetrouter-migrations"] = str(self.migrations)
        if self.request_done and self.give_up is None and self.cont.complete:
            return Response(msgspec.json.encode(self.cont.response_body()),
                            media_type="application/json", headers=headers)
        if self.router_fault:
            return error_response(500, self.give_up or "the router failed", type="server_error",
                                  headers=headers)
        return error_response(502, self.give_up or "the inference engine failed",
                              type="upstream_error", headers=headers)


def _describe(early: EarlyAnswer) -> str:
    status, body, _ = early
    try:
        err = msgspec.json.decode(body)["error"]
        detail = err["message"] if isinstance(err, dict) else str(err)
    except Exception:  # any shape: fall back to the raw text
        detail = body[:200].decode("utf-8", "replace")
    return f"the inference engine rejected the continued request (HTTP {status}): {detail}"
