"""Talking to one engine for one hop of a request: open the upstream stream, read it as SSE events,
and turn every way it can break into a :class:`HopFailed` with a :class:`HopFailure` reason.

Failures worth moving the request to another engine (design.md §9) are transport errors
(connection refused or reset, the engine dying mid-stream), a 5xx, and silence longer than the
idle timeout (no byte from the engine for that long; see :mod:`api.upstream`). A 4xx is the
engine judging the request itself, so it is handed back, not retried. A connect that timed out
is told apart from a refused one (``connect_timeout``): the engine may only be busy, and the hop
runners may try it again (:mod:`api.forward.connect_retry`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from enum import StrEnum

import msgspec

from api import tracing
from api.upstream import (
    ConnectFailed,
    ConnectTimedOut,
    IdleTimeout,
    Patience,
    UpstreamError,
    UpstreamPool,
    UpstreamResponse,
)
from errors.root import JetrouterError


class HopFailure(StrEnum):
    """Why an engine failed a hop: the ``reason`` label of the migrations metric and of the
    passive health report."""

    CONNECT_ERROR = "connect_error"
    CONNECT_TIMEOUT = "connect_timeout"  # no refusal: the engine may be alive and busy
    STREAM_ERROR = "stream_error"
    IDLE_TIMEOUT = "idle_timeout"
    UPSTREAM_5XX = "upstream_5xx"


DONE_EVENT = b"data: [DONE]\n\n"


class HopFailed(JetrouterError):
    """One engine failed this hop, for ``reason``."""

    def __init__(self, reason: HopFailure, detail: str, *, engine_answered: bool = False) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
        # The engine itself reported the failure (a 5xx, an error event), so it is alive.
        self.engine_answered = engine_answered


def classify(exc: BaseException) -> HopFailure:
    """The migration reason for a failure of the upstream client (:mod:`api.upstream`); any
    other transport error (an ``OSError`` that slipped through) counts as a broken stream."""
    if isinstance(exc, ConnectTimedOut):
        return HopFailure.CONNECT_TIMEOUT
    if isinstance(exc, ConnectFailed):
        return HopFailure.CONNECT_ERROR
    if isinstance(exc, IdleTimeout):
        return HopFailure.IDLE_TIMEOUT
    return HopFailure.STREAM_ERROR


class SseSplitter:
    """Incremental SSE parser: feed raw bytes, get back complete events.

    Only complete events come out, so when a stream breaks half-way through an event the client
    never sees a torn chunk and the torn token is not counted as delivered.
    """

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, chunk: bytes) -> list[tuple[bytes, bytes | None]]:
        """(raw event bytes with their blank-line terminator, data payload or None) per event."""
        buf = self._buf + chunk if self._buf else chunk
        if b"\r" in buf:  # some servers end lines with CRLF; the spec allows all three
            buf = buf.replace(b"\r\n", b"\n")
        out: list[tuple[bytes, bytes | None]] = []
        # Events are cut from the buffer by position, and the rest kept once at the end: this
        # runs once per token, and re-slicing the remainder after each event copied it again.
        start = 0
        while (i := buf.find(b"\n\n", start)) >= 0:
            event = buf[start:i]
            if b"\n" not in event:  # one line, the usual `data: {...}`
                data = event[5:].strip() if event.startswith(b"data:") else None
            else:
                lines = [line[5:].strip() for line in event.split(b"\n")
                         if line.startswith(b"data:")]
                data = b"\n".join(lines) if lines else None
            out.append((buf[start:i + 2], data))
            start = i + 2
        self._buf = buf[start:] if start else buf
        return out


async def open_upstream(pool: UpstreamPool, url: str, body: bytes, request_id: str,
                        idle_timeout: float | None = None,
                        connect_timeout: float | None = None,
                        patience: Patience | None = None) -> UpstreamResponse:
    """POST one hop and return the streaming response once its head is in (``None`` timeouts:
    the pool's own; ``patience``: see :class:`api.upstream.Patience`).

    Raises :class:`HopFailed` for transport errors and 5xx (the response is closed); any other
    status is returned for the caller to pass on (it must be read and closed)."""
    headers = {"content-type": "application/json", "accept": "text/event-stream",
               "x-request-id": request_id}
    tracing.start_hop(request_id, url, headers)  # adds the hop's traceparent when tracing
    try:
        resp = await pool.post(url, body, headers, idle_timeout=idle_timeout,
                               connect_timeout=connect_timeout, patience=patience)
    except (UpstreamError, OSError) as exc:
        tracing.hop_answered(request_id, failure=classify(exc))
        raise HopFailed(classify(exc), f"{type(exc).__name__}: {exc}") from None
    tracing.hop_answered(request_id, resp.status_code)
    if resp.status_code >= 500:
        detail = b""
        try:
            detail = await resp.aread()
        except (UpstreamError, OSError):
            pass
        finally:
            resp.close()
        raise HopFailed(HopFailure.UPSTREAM_5XX, f"HTTP {resp.status_code} {detail[:200]!r}",
                        engine_answered=True)
    return resp


async def upstream_event_batches(resp: UpstreamResponse
                                 ) -> AsyncIterator[list[tuple[bytes, bytes | None]]]:
    """The engine's SSE events, as :meth:`SseSplitter.feed` gives them, one non-empty list per
    read from the engine (so what one read brought can go to the client in one write); a broken
    or silent stream raises :class:`HopFailed`. A clean end of stream simply stops."""
    splitter = SseSplitter()
    try:
        while chunk := await resp.next_chunk():
            events = splitter.feed(chunk)
            if events:
                yield events
    except (UpstreamError, OSError) as exc:
        raise HopFailed(classify(exc), f"{type(exc).__name__}: {exc}") from None


async def upstream_events(resp: UpstreamResponse
                          ) -> AsyncIterator[tuple[bytes, bytes | None]]:
    """:func:`upstream_event_batches`, one event at a time."""
    batches = upstream_event_batches(resp)
    try:
        async for events in batches:
            for event in events:
                yield event
    finally:
        await batches.aclose()


def sse_data(obj: object) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"
