"""Forwarding a routed request to its engine as it is, and the engine's answer back as it is.

The routes whose answers the router does not rewrite token by token go this way: ``n > 1`` on
chat and completions (several choices interleave in one stream), embeddings, the Responses API
and Anthropic's Messages. The hop's lifecycle on the router stream is the same as a
:class:`api.forward.run.Run` hop's (the decision is recorded before the client sees a byte,
``PrefillCompleted`` at the first streamed event, exactly one ``RequestFinished``), and an engine
that fails *before answering* (refused connection, 5xx) is replaced by another one, as there,
and a connect that timed out to a live engine is made again when no other engine takes the
request (:mod:`api.forward.connect_retry`), a pinned request's included.

What it does not do is continue a stream on another engine once the client has seen part of it:
the continuation re-prompts one completion (:mod:`api.forward.continuation`), which is not what
these answers are. A stream that breaks mid-way ends with an error event instead. A request
pinned to one engine (a stored response's follow-up) is never moved either: no other engine
could answer it.

A unary answer is forwarded unary: the engine sends its head only once the answer is whole, so
the wait for it is bounded by :data:`UNARY_TIMEOUT`, not by the stream idle timeout.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
from fastapi.responses import Response
from starlette.types import Receive, Scope, Send

from api import tracing
from api.errors import encoded_error_body, upstream_error_body
from api.forward.connect_retry import ConnectTries, TimeoutAction
from api.forward.context import PREDICTED_HEADER, RunContext, replica_headers
from api.forward.engine import HopFailed, HopFailure, open_upstream, upstream_event_batches
from api.upstream import UpstreamError, UpstreamResponse
from eventlog.events import Outcome
from leanhttp.hotpath import LeanStreamingResponse
from replicas.runtime.replica import DecisionNotRecorded, Routed, RouteRequest, RoutingError

log = logging.getLogger("jetrouter.forward")

UNARY_TIMEOUT = 600.0  # seconds an engine may take to answer a non-streamed request

# (raw SSE event, its data payload or None) -> the bytes for the client (b"" drops it).
EventHook = Callable[[bytes, bytes | None], Awaitable[bytes]]
# The engine's 200 body -> the client's body.
BodyHook = Callable[[bytes], Awaitable[bytes]]
# (status, message) -> (body, content type) of an error the router itself answers.
ErrorShape = Callable[[int, str], tuple[bytes, str]]

_decode = msgspec.json.Decoder()


def openai_error(status: int, message: str) -> tuple[bytes, str]:
    if status == 500:  # the router's own fault, not the engine's
        return encoded_error_body(500, message, type="server_error", code=500), \
            "application/json"
    return upstream_error_body(message, status), "application/json"


def usage_counts(obj: Any) -> tuple[int, int] | None:
    """(output tokens, cached prompt tokens or -1) from a usage object of any of the shapes the
    engines answer with: OpenAI's (``completion_tokens``), the Responses API's and Anthropic's
    (``output_tokens``); None when ``obj`` holds none."""
    if not isinstance(obj, dict):
        return None
    out = obj.get("completion_tokens", obj.get("output_tokens"))
    if not isinstance(out, int) or isinstance(out, bool) or out < 0:
        return None
    cached: object = -1
    for key in ("prompt_tokens_details", "input_tokens_details"):
        details = obj.get(key)
        if isinstance(details, dict) and "cached_tokens" in details:
            cached = details["cached_tokens"]
    if "cache_read_input_tokens" in obj:
        cached = obj["cache_read_input_tokens"]
    ok = isinstance(cached, int) and not isinstance(cached, bool) and cached >= 0
    return out, cached if ok else -1  # type: ignore[return-value]


def find_usage(obj: Any) -> tuple[int, int] | None:
    """:func:`usage_counts` of ``obj["usage"]``, or of a usage one level down (the Responses
    API's ``response.usage``, Anthropic's ``message.usage`` in ``message_start``)."""
    if not isinstance(obj, dict):
        return None
    found = usage_counts(obj.get("usage"))
    if found is not None:
        return found
    for inner in obj.values():
        if isinstance(inner, dict):
            found = usage_counts(inner.get("usage"))
            if found is not None:
                return found
    return None


class Passthrough:
    """One request forwarded verbatim, through as many hops as it takes to get an answer."""

    def __init__(self, ctx: RunContext, endpoint: str, request: RouteRequest, routed: Routed,
                 path: str, body: bytes, *, stream: bool, movable: bool = True,
                 on_event: EventHook | None = None, on_body: BodyHook | None = None,
                 error_shape: ErrorShape = openai_error) -> None:
        self.ctx = ctx
        self.endpoint = endpoint
        self.request = request
        self.routed = routed
        self.path = path
        self.body = body
        self.stream = stream
        self.movable = movable and request.pinned is None
        self.on_event = on_event
        self.on_body = on_body
        self.error_shape = error_shape
        self.failed: set[str] = set()
        self.migrations = 0
        self.connect_tries: ConnectTries | None = None  # the current hop's, once retried
        self.output_tokens = 0
        self.cached_tokens = -1
        self.events_seen = 0
        self.prefilled = False
        self.ended = False
        self.resp: UpstreamResponse | None = None

    # --- the hop's lifecycle ------------------------------------------------------------------

    def _end(self, outcome: Outcome) -> None:
        if self.ended:
            return
        self.ended = True
        replica = self.ctx.replica
        replica.finished(self.routed.request_id, outcome, self.output_tokens, self.cached_tokens)
        if self.cached_tokens >= 0:  # the engine's own count beside our prediction
            predicted = self.routed.overlap_blocks * self.routed.event.block_size
            self.ctx.metrics.kv_prediction_error.observe(predicted - self.cached_tokens)
        if outcome != Outcome.NOT_ROUTED:  # that one is counted as a rejection by the caller
            self.ctx.metrics.count_request(self.endpoint, outcome)

    def _note_usage(self, obj: Any) -> None:
        found = find_usage(obj)
        if found is not None:
            self.output_tokens, cached = found
            if cached >= 0:
                self.cached_tokens = cached

    async def _reroute(self, failure: HopFailed) -> bool:
        with tracing.migration(self.request.request_id, self.migrations + 1,
                               self.routed.worker_id, failure.reason) as span:
            before = self.routed
            again = await self._move(failure)
            span.moved(again and self.routed is not before)
            return again

    async def _move(self, failure: HopFailed) -> bool:
        """True: open ``self.routed`` — another engine's hop, or the same hop again when its
        connect timed out to an engine still alive and no other engine takes the request."""
        failed = self.routed
        self.failed.add(failed.worker_id)
        self.ctx.report_failure(failed.worker_id, failure.reason)
        timed_out = failure.reason == HopFailure.CONNECT_TIMEOUT
        routed: Routed | None = None
        if self.movable and self.migrations < self.ctx.migration_limit:
            try:
                routed = await self.ctx.hops.next_hop(
                    self.request, self.migrations + 1, exclude=frozenset(self.failed),
                    session=self.request.session, tenant=failed.event.tenant)
            except RoutingError:
                pass
            except Exception:  # the decision could not be appended
                log.exception("request %s: re-routing failed", self.request.request_id)
        if routed is None:
            if timed_out and await self._connect_again(failed):
                return True
            if timed_out:
                self.ctx.connects.record(TimeoutAction.FAILED)
            return False
        if timed_out:
            self.ctx.connects.record(TimeoutAction.MIGRATED)
        self.connect_tries = None
        self.ctx.replica.finished(failed.request_id, Outcome.MIGRATED, 0, -1)
        self.ctx.metrics.migrations.labels(reason=failure.reason).inc()
        self.migrations += 1
        self.routed = routed
        return True

    async def _connect_again(self, hop: Routed) -> bool:
        """The same hop again after a backoff, if its engine is alive and time is left."""
        tries = await self.ctx.connects.again_if_alive(self.connect_tries, hop.worker_id,
                                                       hop.request_id)
        if tries is None:
            return False
        self.connect_tries = tries
        return True

    def headers(self) -> dict[str, str]:
        h = replica_headers(self.ctx.replica.replica_id, self.routed.worker_id,
                            self.request.request_id)
        h[PREDICTED_HEADER] = str(self.routed.overlap_blocks * self.routed.event.block_size)
        if self.migrations:
            h["x-jetrouter-migrations"] = str(self.migrations)
        return h

    def _error(self, status: int, message: str) -> Response:
        body, ctype = self.error_shape(status, message)
        return Response(body, status_code=status, media_type=ctype, headers=self.headers())

    # --- answering ----------------------------------------------------------------------------

    async def _open(self) -> UpstreamResponse | Response:
        """The engine's 200 response, or what the client gets instead. Raises
        :class:`DecisionNotRecorded` when JetStream refused the decision."""
        while True:
            hop = self.routed
            if hop.record is not None and hop.record.refused:
                self._end(Outcome.NOT_ROUTED)
                await self.ctx.replica.recorded(hop)  # raises DecisionNotRecorded
            url = hop.worker_url.rstrip("/") + self.path
            tries = self.connect_tries
            try:
                resp = await open_upstream(self.ctx.pool, url, self.body, hop.request_id,
                                           idle_timeout=None if self.stream else UNARY_TIMEOUT,
                                           connect_timeout=tries.timeout if tries else None,
                                           patience=self.ctx.first_byte.patience(
                                               hop.worker_id, hop.request_id))
            except HopFailed as failure:
                log.warning("request %s: engine %s failed (%s)", self.request.request_id,
                            hop.worker_id, failure)
                if await self._reroute(failure):
                    continue
                self._end(Outcome.ERROR)
                return self._error(502, f"the inference engine failed ({failure.reason})"
                                   + ("" if self.movable else " and no other engine can "
                                      "answer this request"))
            try:
                await self.ctx.replica.recorded(hop)
            except BaseException as exc:
                resp.close()
                if isinstance(exc, DecisionNotRecorded):
                    self._end(Outcome.NOT_ROUTED)
                raise
            return resp

    async def respond(self) -> Response:
        try:
            opened = await self._open()
        except DecisionNotRecorded:
            raise
        except BaseException:
            self._end(Outcome.CANCELLED)
            raise
        if isinstance(opened, Response):
            return opened
        resp = opened
        if resp.status_code != 200:
            return await self._engine_refused(resp)
        if self.stream:
            self.resp = resp
            return PassthroughStream(self, self.headers())
        try:
            data = await resp.aread()
        except (UpstreamError, OSError) as exc:
            self._end(Outcome.ERROR)
            return self._error(502, f"the inference engine failed mid-answer "
                               f"({type(exc).__name__})")
        except BaseException:
            self._end(Outcome.CANCELLED)
            raise
        finally:
            resp.close()
        try:
            self._note_usage(_decode.decode(data))
        except msgspec.DecodeError:
            pass
        if self.on_body is not None:
            data = await self.on_body(data)
        self._end(Outcome.OK)
        return Response(data, media_type=resp.headers.get("content-type", "application/json"),
                        headers=self.headers())

    async def _engine_refused(self, resp: UpstreamResponse) -> Response:
        """The engine judged the request itself (4xx): its answer goes to the client."""
        status = resp.status_code
        try:
            body = await resp.aread()
        except (UpstreamError, OSError):
            body = b""
        finally:
            resp.close()
        self._end(Outcome.ERROR)
        if not body:
            return self._error(status, f"the inference engine answered HTTP {status}")
        return Response(body, status_code=status, headers=self.headers(),
                        media_type=resp.headers.get("content-type", "application/json"))

    async def events(self) -> AsyncIterator[bytes]:
        """The engine's SSE events as they come, through ``on_event``."""
        assert self.resp is not None
        outcome = Outcome.ERROR
        batches = upstream_event_batches(self.resp)
        try:
            async for batch in batches:
                outs: list[bytes] = []
                for raw, payload in batch:
                    if payload is not None:
                        self._on_payload(payload)
                    out = raw if self.on_event is None else await self.on_event(raw, payload)
                    if out:
                        outs.append(out)
                if outs:
                    yield b"".join(outs)
            outcome = Outcome.OK
        except HopFailed as failure:
            self.ctx.report_failure(self.routed.worker_id, failure.reason)
            body, _ = self.error_shape(502, "the inference engine failed mid-stream "
                                       f"({failure.reason}); the answer is incomplete")
            yield b"event: error\ndata: " + body + b"\n\n"
        except (asyncio.CancelledError, GeneratorExit):
            outcome = Outcome.CANCELLED
            raise
        except Exception:
            # A fault of the router's own once the head is out: the client reads an error
            # event and a complete body, not a cut one (as api.forward.run does).
            log.exception("request %s: the router failed while streaming the response",
                          self.routed.request_id)
            body, _ = self.error_shape(500, "the router failed while streaming the response")
            yield b"event: error\ndata: " + body + b"\n\n"
        finally:
            await batches.aclose()
            try:
                self._end(outcome)
            except Exception:  # the body is complete: a bookkeeping fault must not cut it
                log.exception("request %s: ending the request failed", self.routed.request_id)
            self.close()

    def _on_payload(self, payload: bytes) -> None:
        if not self.prefilled and payload != b"[DONE]":
            self.prefilled = True
            self.ctx.replica.prefill_completed(self.routed.request_id)
        self.events_seen += 1
        if b'"usage"' in payload:
            try:
                self._note_usage(_decode.decode(payload))
            except msgspec.DecodeError:
                pass

    def close(self) -> None:
        resp, self.resp = self.resp, None
        if resp is not None:
            resp.close()

    async def abandon(self) -> None:
        """End the hop as cancelled (no-op after a normal end)."""
        self._end(Outcome.CANCELLED)
        self.close()


class PassthroughStream(LeanStreamingResponse):
    """The SSE response of one passthrough; a client that vanishes ends its hop at once."""

    def __init__(self, forward: Passthrough, headers: dict[str, str]) -> None:
        super().__init__(forward.events(), media_type="text/event-stream", headers=headers)
        self.forward = forward

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.forward.abandon()
