"""Talking to one engine for one hop of a request: open the upstream stream, read it as SSE events,
and turn every way it can break into a :class:`HopFailed` with a migration reason.

Failures worth moving the request elsewhere (issue 6 item 1) are transport errors (connection
refused or reset, the engine dying mid-stream), a 5xx, and silence longer than the idle timeout
(no byte from the engine for that long; see :mod:`api.upstream`). A 4xx is the engine judging
the request itself, so it is handed back, not retried. The client-facing timing of the whole request
(first token, gaps between tokens) lives in :class:`Exchange`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec

from api.upstream import (
    ConnectFailed,
    IdleTimeout,
    UpstreamError,
    UpstreamPool,
    UpstreamResponse,
)

CONNECT_ERROR = "connect_error"
STREAM_ERROR = "stream_error"
IDLE_TIMEOUT = "idle_timeout"
UPSTREAM_5XX = "upstream_5xx"
REASONS = (CONNECT_ERROR, STREAM_ERROR, IDLE_TIMEOUT, UPSTREAM_5XX)

DONE_EVENT = b"data: [DONE]\n\n"


class HopFailed(Exception):
    """One engine failed this hop; ``reason`` is one of :data:`REASONS` (the metric label)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def classify(exc: BaseException) -> str:
    """The migration reason for a failure of the upstream client (:mod:`api.upstream`); any
    other transport error (an ``OSError`` that slipped through) counts as a broken stream."""
    if isinstance(exc, ConnectFailed):
        return CONNECT_ERROR
    if isinstance(exc, IdleTimeout):
        return IDLE_TIMEOUT
    return STREAM_ERROR


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


class SseSplitter:
    """Incremental SSE parser: feed raw bytes, get back complete events.

    Only complete events come out, so when a stream breaks half-way through an event the client
    never sees a torn chunk and the torn token is not counted as delivered.
    """

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, chunk: bytes) -> list[tuple[bytes, bytes | None]]:
        """(raw event bytes with their blank-line terminator, data payload or None) per event."""
        self._buf += chunk
        if b"\r" in self._buf:  # some servers end lines with CRLF; the spec allows all three
            self._buf = self._buf.replace(b"\r\n", b"\n")
        out: list[tuple[bytes, bytes | None]] = []
        while True:
            i = self._buf.find(b"\n\n")
            if i < 0:
                return out
            event, self._buf = self._buf[:i], self._buf[i + 2:]
            data = [line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:")]
            out.append((event + b"\n\n", b"\n".join(data) if data else None))


async def open_upstream(pool: UpstreamPool, url: str, body: bytes, request_id: str,
                        idle_timeout: float | None = None) -> UpstreamResponse:
    """POST one hop and return the streaming response once its head is in.

    Raises :class:`HopFailed` for transport errors and 5xx (the response is closed); any other
    status is returned for the caller to pass on (it must be read and closed)."""
    headers = {"content-type": "application/json", "accept": "text/event-stream",
               "x-request-id": request_id}
    try:
        resp = await pool.post(url, body, headers, idle_timeout=idle_timeout)
    except (UpstreamError, OSError) as exc:
        raise HopFailed(classify(exc), f"{type(exc).__name__}: {exc}") from None
    if resp.status_code >= 500:
        detail = b""
        try:
            detail = await resp.aread()
        except (UpstreamError, OSError):
            pass
        finally:
            resp.close()
        raise HopFailed(UPSTREAM_5XX, f"HTTP {resp.status_code} {detail[:200]!r}")
    return resp


async def upstream_events(resp: UpstreamResponse
                          ) -> AsyncIterator[tuple[bytes, bytes | None]]:
    """The engine's SSE events, as :meth:`SseSplitter.feed` gives them; a broken or silent
    stream raises :class:`HopFailed`. A clean end of stream simply stops the iteration."""
    splitter = SseSplitter()
    try:
        while chunk := await resp.next_chunk():
            for event in splitter.feed(chunk):
                yield event
    except (UpstreamError, OSError) as exc:
        raise HopFailed(classify(exc), f"{type(exc).__name__}: {exc}") from None


def sse_error(message: str, *, type_: str = "upstream_error", code: int = 502) -> bytes:
    body = msgspec.json.encode({"error": {"message": message, "type": type_, "param": None,
                                          "code": code}})
    return b"data: " + body + b"\n\n"


def sse_data(obj: object) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"
