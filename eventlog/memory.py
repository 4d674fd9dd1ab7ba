"""An :class:`eventlog.log.EventLog` held in one process: the JetStream semantics the runtime
relies on (exactly-once appends by message id, per-stream sequences, replay then follow, purge
and :class:`StartPurged`, bounds, headers, the last message per subject), without a server.

It is what lets a test build a `Replica` or the HTTP app in milliseconds; the contract suite in
tests/contracts/ holds it to the same behaviour as a real nats-server. What it does
not model: clustering, leader elections, reconnects and their retries (one process cannot lose
its log), and per-subject purges.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import NoReturn, Self

from errors.root import JetrouterError
from eventlog.appender import MSG_ID_HEADER, AppendFailed, encode_append
from eventlog.binding import foreign_party
from eventlog.events import Decode, Event, MalformedMessage, decode_batch
from eventlog.log import StoredMessage
from eventlog.names import STREAM_KINDS, Names
from eventlog.reader import StartPurged
from eventlog.wire import NewerFormat, UnknownFormat, check_message

log = logging.getLogger(__name__)

# A replaying reader hands the loop back this often, as a JetStream reader does between pulls,
# so a long replay does not hold every other task up.
_YIELD_EVERY = 256


class NoSuchStream(JetrouterError, LookupError):
    """A stream name the log does not hold (``ensure_streams`` creates them)."""


class NoStreamForSubject(JetrouterError, LookupError):
    """An append to a subject no stream captures (JetStream answers "no responders")."""


class StreamFull(JetrouterError, RuntimeError):
    """An append over the stream's ``max_bytes``: refused, as JetStream's "discard new" does."""


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: ``*`` is one token, a final ``>`` one or more."""
    want, have = pattern.split("."), subject.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return len(have) > i
        if i >= len(have) or (token != "*" and token != have[i]):
            return False
    return len(want) == len(have)


class _Stream:
    def __init__(self, name: str, subjects: list[str], duplicate_window: float,
                 max_bytes: int | None) -> None:
        self.name = name
        self.subjects = subjects
        self.duplicate_window = duplicate_window
        self.max_bytes = max_bytes
        self.messages: list[StoredMessage] = []  # messages[i].seq == first_seq + i
        self.first_seq = 0  # JetStream's bounds of a stream that never held a message: (0, 0)
        self.last_seq = 0
        self.bytes = 0
        self.msg_ids: OrderedDict[str, tuple[int, float]] = OrderedDict()  # id -> (seq, when)
        self.waiters: set[asyncio.Future[None]] = set()

    def get(self, seq: int) -> StoredMessage | None:
        if seq < self.first_seq or seq > self.last_seq or not self.messages:
            return None
        return self.messages[seq - self.first_seq]

    def wake(self) -> None:
        for fut in self.waiters:
            if not fut.done():
                fut.set_result(None)
        self.waiters.clear()


class MemoryLog:
    """Streams in memory. ``clock`` (seconds, monotonic) ages the duplicate window."""

    def __init__(self, *, duplicate_window: float = 120.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.duplicate_window = duplicate_window
        self._clock = clock
        self._streams: dict[str, _Stream] = {}
        self.duplicates = 0  # appends answered with an earlier message's sequence

    # --- streams -------------------------------------------------------------------------------

    async def ensure_streams(self, names: Names, *, max_bytes: int | None = None,
                             kinds: tuple[str, ...] = STREAM_KINDS) -> None:
        for kind in kinds:
            name = names.stream(kind)
            stream = self._streams.get(name)
            if stream is None:
                self._streams[name] = _Stream(name, [names.subjects(kind)],
                                              self.duplicate_window, max_bytes)
            elif max_bytes is not None:  # as on JetStream: a given limit wins, none keeps it
                stream.max_bytes = max_bytes

    def _stream(self, name: str) -> _Stream:
        try:
            return self._streams[name]
        except KeyError:
            raise NoSuchStream(f"no stream named {name}") from None

    def _stream_for(self, subject: str) -> _Stream | None:
        for stream in self._streams.values():
            if any(subject_matches(p, subject) for p in stream.subjects):
                return stream
        return None

    # --- appending ------------------------------------------------------------------------------

    async def append(self, subject: str, events: Sequence[Event], msg_id: str,
                     headers: dict[str, str] | None = None) -> int:
        payload, headers = encode_append(events, msg_id, headers)
        return await self.append_raw(subject, payload, msg_id, headers)

    async def append_raw(self, subject: str, payload: bytes, msg_id: str,
                         extra_headers: dict[str, str] | None = None) -> int:
        stream = self._stream_for(subject)
        if stream is None:
            raise AppendFailed(subject, msg_id, NoStreamForSubject(subject))
        now = self._clock()
        while stream.msg_ids:  # forget ids older than the window (oldest first)
            _, (_, when) = next(iter(stream.msg_ids.items()))
            if now - when < stream.duplicate_window:
                break
            stream.msg_ids.popitem(last=False)
        known = stream.msg_ids.get(msg_id)
        if known is not None:
            self.duplicates += 1
            return known[0]
        if stream.max_bytes is not None and stream.max_bytes >= 0 and (
                stream.bytes + len(payload) > stream.max_bytes):
            raise AppendFailed(subject, msg_id, StreamFull(
                f"stream {stream.name} holds {stream.bytes} of {stream.max_bytes} bytes"))
        seq = stream.last_seq + 1
        if not stream.messages:
            stream.first_seq = seq
        # JetStream keeps the message id among the headers; so does this log.
        headers = {**(extra_headers or {}), MSG_ID_HEADER: msg_id}
        stream.messages.append(StoredMessage(seq, subject, payload, headers))
        stream.last_seq = seq
        stream.bytes += len(payload)
        stream.msg_ids[msg_id] = (seq, now)
        stream.wake()
        return seq

    # --- reading --------------------------------------------------------------------------------

    def reader(self, stream: str, *, start_seq: int = 1, time_decode: bool = True,
               decode: Decode = decode_batch) -> MemoryReader:
        return MemoryReader(self._stream(stream), start_seq=start_seq, decode=decode)

    async def bounds(self, stream: str) -> tuple[int, int]:
        s = self._stream(stream)
        return s.first_seq, s.last_seq

    async def purge(self, stream: str, *, keep_from: int | None = None) -> None:
        s = self._stream(stream)
        cut = s.last_seq + 1 if keep_from is None else min(keep_from, s.last_seq + 1)
        if cut <= s.first_seq:
            return
        dropped = s.messages[: cut - s.first_seq]
        s.messages = s.messages[cut - s.first_seq:]
        s.bytes -= sum(len(m.data) for m in dropped)
        s.first_seq = cut
        s.wake()  # a reader waiting at a purged sequence must learn it

    async def last_message(self, stream: str, subject: str) -> StoredMessage | None:
        for msg in reversed(self._stream(stream).messages):
            if msg.subject == subject:
                return msg
        return None


class MemoryReader:
    """Replays a :class:`MemoryLog` stream from ``start_seq`` and follows it, as
    :class:`eventlog.reader.StreamReader` does a JetStream one."""

    def __init__(self, stream: _Stream, *, start_seq: int = 1, decode: Decode = decode_batch
                 ) -> None:
        if start_seq < 1:
            raise ValueError(f"start_seq must be >= 1, got {start_seq}")
        self._s = stream
        self.decode = decode
        self.stream = stream.name
        self.start_seq = start_seq
        self.last_seq = start_seq - 1
        self.pending = 0
        self.malformed = 0
        self.forged = 0
        self.last_subject = ""  # the subject of the last yielded message
        self.last_decode_s = 0.0  # nothing to decode off a wire: events are decoded in memory
        self._started = False
        self._closed = False
        self._failure: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._since_yield = 0

    async def start(self) -> None:
        if self._started:
            return
        self._started = True
        if self._s.first_seq > self.start_seq:
            self._fail(StartPurged(self.stream, self.start_seq, self._s.first_seq))
        self.pending = max(0, self._s.last_seq - self.last_seq)

    def __aiter__(self) -> Self:
        return self

    def take_received(self, limit: int) -> list[tuple[int, list[Event]]]:
        """Nothing: every message is at hand here, and ``__anext__`` yields to the loop now and
        then on purpose (``_YIELD_EVERY``), which taking many at once would defeat."""
        return []

    async def __anext__(self) -> tuple[int, list[Event]]:
        if self._failure is not None:
            raise self._failure
        if not self._started:
            await self.start()
        while not self._closed:
            wanted = self.last_seq + 1
            s = self._s
            if wanted <= s.last_seq:
                if wanted < s.first_seq:  # a later message exists, this one was purged
                    self._fail(StartPurged(self.stream, wanted, s.first_seq))
                msg = s.get(wanted)
                assert msg is not None
                self._since_yield += 1
                if self._since_yield >= _YIELD_EVERY:
                    self._since_yield = 0
                    await asyncio.sleep(0)
                return self._deliver(msg)
            self._waiter = asyncio.get_running_loop().create_future()
            s.waiters.add(self._waiter)
            await self._waiter
        raise StopAsyncIteration

    def _deliver(self, msg: StoredMessage) -> tuple[int, list[Event]]:
        try:
            check_message(msg.headers, self.stream, msg.seq)
            events = self.decode(msg.data)
        except NewerFormat as exc:
            self._fail(exc)  # stays before the message, as the JetStream reader does
        except (MalformedMessage, UnknownFormat) as exc:
            self.malformed += 1
            log.warning("stream %s seq %d: skipping malformed message (%s)", self.stream,
                        msg.seq, exc)
            events = []
        party = foreign_party(msg.subject, events) if events else None
        if party is not None:
            self.malformed += 1
            self.forged += 1
            log.warning("stream %s seq %d: skipping a message on %s that speaks for %r",
                        self.stream, msg.seq, msg.subject, party)
            events = []
        self.last_seq = msg.seq
        self.last_subject = msg.subject
        self.pending = max(0, self._s.last_seq - msg.seq)
        return msg.seq, events

    def _fail(self, exc: BaseException) -> NoReturn:
        self._failure = exc
        self._closed = True
        raise exc

    async def close(self) -> None:
        self._closed = True
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
