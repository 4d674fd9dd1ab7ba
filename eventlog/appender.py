"""Append event batches to JetStream exactly once (design.md §2).

Each append carries a caller-chosen ``Nats-Msg-Id``; the stream's duplicate window turns a retried
publish into a duplicate ack that points at the original message. That is what makes retrying
safe: a publish whose ack was lost (timeout, reconnect, leader change) is simply sent again, and
the caller gets the same stream sequence either way.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import nats.errors
from nats.js import JetStreamContext
from nats.js.errors import APIError, NoStreamResponseError, ServiceUnavailableError
from tenacity import (
    AsyncRetrying,
    RetryError,
    retry_if_exception,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential,
)

from errors.root import JetrouterError
from eventlog.events import Event, encode_batch
from eventlog.wire import format_headers

log = logging.getLogger(__name__)

MSG_ID_HEADER = "Nats-Msg-Id"


def encode_append(events: Sequence[Event], msg_id: str,
                  headers: dict[str, str] | None) -> tuple[bytes, dict[str, str] | None]:
    """What an ``append`` of ``events`` hands its ``append_raw`` (every log adapter's): the
    encoded batch and ``headers`` with the batch's format header added. Refuses an empty
    ``msg_id``."""
    if not msg_id:
        raise ValueError("msg_id must be non-empty: it is what makes a retried append safe")
    marked = format_headers(events)  # None for format 1: no header (eventlog/wire.py)
    if marked is not None:
        headers = {**marked, **(headers or {})}
    return encode_batch(list(events)), headers


class AppendFailed(JetrouterError, RuntimeError):
    """An append that did not reach the stream after every retry (or failed for good)."""

    def __init__(self, subject: str, msg_id: str, cause: BaseException) -> None:
        super().__init__(f"append to {subject} (msg id {msg_id}) failed: {cause!r}")
        self.subject = subject
        self.msg_id = msg_id
        self.cause = cause


# JetStream answers 503 for these too, but they are limits, not a passing state: the stream or
# account is full (max bytes / messages, storage quota) or the message is over the maximum size.
# Retrying cannot cure them within an append's lifetime, so the writer hears "no" at once.
_LIMIT_ERR_CODES = {
    10023,  # insufficient resources
    10028,  # insufficient memory resources available
    10047,  # insufficient storage resources available
    10054,  # message size exceeds maximum allowed
    10077,  # store failed: maximum bytes / messages (per subject) exceeded
}


# A retry under the same msg id while the stream is still proposing the first attempt (an ack
# that timed out during a leader election or without quorum): the outcome is not known yet, so
# asking again later is the only way to learn it.
_IN_PROCESS_ERR_CODE = 10158  # duplicate message id is in process


def is_transient(exc: BaseException) -> bool:
    """Failures that a retry can cure: no ack in time, no stream leader (election or restart),
    JetStream temporarily unavailable, an earlier attempt still in process, or the connection
    being re-established."""
    if isinstance(exc, ServiceUnavailableError) and exc.err_code in _LIMIT_ERR_CODES:
        return False
    if isinstance(exc, APIError) and exc.err_code == _IN_PROCESS_ERR_CODE:
        return True
    return isinstance(
        exc,
        nats.errors.TimeoutError
        | asyncio.TimeoutError
        | nats.errors.NoRespondersError
        | NoStreamResponseError
        | ServiceUnavailableError
        | nats.errors.ConnectionReconnectingError
        | nats.errors.StaleConnectionError
        | nats.errors.OutboundBufferLimitError,
    )


class Appender:
    """Publishes batches with a message id, retrying transient failures with exponential backoff.

    ``timeout`` bounds each attempt's wait for the ack; ``attempts`` counts every try (so the
    default retries five times, spanning roughly 1.5 s of backoff plus the attempts' own waits).
    ``retry_window``, when set, also stops retrying that many seconds after the first failure,
    so a caller can use a short backoff cap (retry soon after a stream leader election ends)
    with many attempts and still bound the total wait.
    """

    def __init__(
        self,
        js: JetStreamContext,
        *,
        timeout: float = 5.0,
        attempts: int = 6,
        backoff_initial: float = 0.05,
        backoff_max: float = 2.0,
        retry_window: float | None = None,
    ) -> None:
        if attempts < 1:
            raise ValueError("attempts must be at least 1")
        self._js = js
        self.timeout = timeout
        self.attempts = attempts
        self._backoff = wait_exponential(multiplier=backoff_initial, max=backoff_max)
        self.retry_window = retry_window
        self.duplicates = 0
        self.retries = 0

    async def append(self, subject: str, events: Sequence[Event], msg_id: str,
                     headers: dict[str, str] | None = None) -> int:
        """Append ``events`` as one message; return its stream sequence (the original one when
        the stream already holds ``msg_id`` within its duplicate window). ``headers`` are stored
        with the message (a bridge keeps its resume point there)."""
        payload, headers = encode_append(events, msg_id, headers)
        return await self.append_raw(subject, payload, msg_id, headers)

    async def append_raw(self, subject: str, payload: bytes, msg_id: str,
                         extra_headers: dict[str, str] | None = None) -> int:
        """Append pre-encoded bytes (used to inject malformed messages in tests, and by bridges
        that already hold an encoded batch)."""
        headers = {**(extra_headers or {}), MSG_ID_HEADER: msg_id}
        try:  # the common case, without building a retry controller per append (hot path)
            ack = await self._js.publish(subject, payload, timeout=self.timeout, headers=headers)
        except Exception as exc:
            if not is_transient(exc):
                raise AppendFailed(subject, msg_id, exc) from exc
            self.retries += 1
            ack = await self._append_retrying(subject, payload, headers)
        if ack.duplicate:
            self.duplicates += 1
        return int(ack.seq)

    async def _append_retrying(self, subject: str, payload: bytes, headers: dict[str, str]) -> Any:
        """The same publish with exponential backoff (same msg id: applied once)."""
        retrying = AsyncRetrying(
            stop=(stop_after_attempt(max(self.attempts - 1, 1))  # the first try was the fast path
                  | stop_after_delay(self.retry_window if self.retry_window is not None
                                     else float("inf"))),
            wait=self._backoff,
            retry=retry_if_exception(is_transient),
            before_sleep=self._note_retry,
            reraise=False,
        )
        try:
            async for attempt in retrying:
                with attempt:
                    ack = await self._js.publish(subject, payload, timeout=self.timeout,
                                                 headers=headers)
        except RetryError as exc:
            cause = exc.last_attempt.exception() or exc
            raise AppendFailed(subject, headers[MSG_ID_HEADER], cause) from cause
        except Exception as exc:  # not transient: a bad subject, payload too large, closed conn
            raise AppendFailed(subject, headers[MSG_ID_HEADER], exc) from exc
        return ack

    def _note_retry(self, state: object) -> None:
        self.retries += 1
        outcome = getattr(state, "outcome", None)
        exc = outcome.exception() if outcome is not None else None
        log.debug("append retry %d after %r", getattr(state, "attempt_number", 0), exc)
