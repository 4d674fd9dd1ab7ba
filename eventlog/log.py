"""The event log as the runtime sees it: append exactly once, replay then follow, bounds, purge.

Two implementations satisfy :class:`EventLog`: :class:`eventlog.jetstream_log.JetStreamLog`
(the real one, over JetStream: design.md §2 and §7) and :class:`eventlog.memory.MemoryLog` (in
one process, for tests and simulations that need no server). One contract test suite runs against
both, so what the runtime relies on is written down once:

* an append carries a message id; appending the same id again within the duplicate window
  returns the original sequence and stores nothing (exactly once under retries);
* sequences per stream start at 1 and grow by one per stored message;
* a reader replays from ``start_seq`` in order, then follows new messages live, without gaps;
  a message that does not decode (or speaks for another party than its subject) is yielded as
  ``(seq, [])`` and counted in ``malformed``;
* ``purge(stream, keep_from=n)`` removes every message below ``n``; a reader asked for a purged
  sequence raises :class:`eventlog.reader.StartPurged` (at start or when it meets the hole);
* ``bounds`` is ``(first_seq, last_seq)``: ``(0, 0)`` for a stream that never held a message,
  ``first_seq == last_seq + 1`` once everything was purged.

This module is pure (types only); it names no server and does no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, Self

from eventlog.events import Decode, Event, decode_batch
from eventlog.names import STREAM_KINDS, Names


@dataclass(frozen=True, slots=True)
class StoredMessage:
    """One message as the log holds it (what a bridge reads back to find its resume point)."""

    seq: int
    subject: str
    data: bytes
    headers: dict[str, str] | None


class LogReader(Protocol):
    """``async for seq, events in reader:`` replay from ``start_seq``, then follow live."""

    stream: str
    last_seq: int  # the last yielded sequence (start_seq - 1 before any)
    pending: int  # messages the log holds after last_seq, as last seen
    malformed: int  # messages skipped because they did not decode or were forged
    forged: int  # of those, messages speaking for another party than their subject names
    last_subject: str  # the subject of the last yielded message (whose decisions they are)
    last_decode_s: float  # thread CPU seconds spent decoding the last yielded message

    async def start(self) -> None: ...

    def __aiter__(self) -> Self: ...

    async def __anext__(self) -> tuple[int, list[Event]]: ...

    def take_received(self, limit: int) -> list[tuple[int, list[Event]]]:
        """Up to ``limit`` further messages already at hand, as ``__anext__`` yields them,
        without awaiting (possibly none: ``__anext__`` then waits for the next one)."""
        ...

    async def close(self) -> None: ...


class EventLog(Protocol):
    """Append / replay-then-follow / bounds / purge over the jetrouter streams."""

    async def ensure_streams(self, names: Names, *, max_bytes: int | None = None,
                             kinds: tuple[str, ...] = STREAM_KINDS) -> None:
        """Create the streams of ``kinds`` (idempotent: every process calls it at start-up)."""
        ...

    async def append(self, subject: str, events: Sequence[Event], msg_id: str,
                     headers: dict[str, str] | None = None) -> int:
        """Store ``events`` as one message; its sequence (the original one for a duplicate)."""
        ...

    async def append_raw(self, subject: str, payload: bytes, msg_id: str,
                         extra_headers: dict[str, str] | None = None) -> int:
        """Store already-encoded bytes, as :meth:`append` does."""
        ...

    def reader(self, stream: str, *, start_seq: int = 1, time_decode: bool = True,
               decode: Decode = decode_batch) -> LogReader:
        """A reader of ``stream`` from ``start_seq`` (nothing is read before its first use);
        ``time_decode``: whether it measures ``last_decode_s`` (else it stays 0); ``decode``:
        ``decode_batch`` or one that gives what it gives (``kv_decode.decode_kv_batch``)."""
        ...

    async def bounds(self, stream: str) -> tuple[int, int]:
        """``(first_seq, last_seq)`` of ``stream``."""
        ...

    async def purge(self, stream: str, *, keep_from: int | None = None) -> None:
        """Remove the messages below ``keep_from`` (all of them when None)."""
        ...

    async def last_message(self, stream: str, subject: str) -> StoredMessage | None:
        """The newest message on ``subject`` still in ``stream``, or None."""
        ...
