"""Replay a stream from a sequence, then follow it live, in order, without gaps (design.md §7).

:class:`StreamReader` drives an ephemeral *pull* consumer itself (rather than through the
client's ``fetch``) so that it alone decides what counts as progress:

* one pull request of ``batch`` messages at a time, with an idle heartbeat, on an inbox that
  belongs to one consumer *generation*; while the server says more than ``batch`` messages wait
  (a replica catching up after a restart), of up to ``catch_up_batch``, and
  :meth:`StreamReader.take_received` hands over what such a pull brought without an ``await``
  per message;
* every delivered message carries its stream and consumer sequences in its reply subject. A
  consumer-sequence gap means a delivery was lost (slow inbox, reconnect): the consumer is
  recreated from ``last_seq + 1``. A stream-sequence gap with no delivery lost means the stream
  no longer holds those messages (purged under us): :class:`StartPurged`.
* silence longer than a few heartbeats, a reconnect of the connection, or an error status from
  the server also recreate the consumer from ``last_seq + 1`` (with backoff while the server is
  away), so a server restart or a dead cluster node costs neither duplicates nor gaps.

A reader that may trail the stream a little (``linger`` > 0: the projector, which commits in
windows anyway) is not woken once per message at low load: caught up, it asks for *one* message;
once that one came it waits ``linger`` seconds, then takes everything the stream gathered
meanwhile in one ``no_wait`` pull (which the server ends with a 404 when it runs dry), and asks
for one message again. The first message of a quiet spell is yielded at once.

A message that does not decode is yielded as ``(seq, [])``: the sequence still advances. So is a
message whose events speak for another worker or replica than its subject names
(:mod:`eventlog.binding`), counted in ``forged``. A message marked with a format newer than this
release reads (:mod:`eventlog.wire`) is different: the reader raises
:class:`eventlog.wire.NewerFormat` and stays before it, for good.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from typing import NoReturn, Self

from nats.errors import ConnectionClosedError
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from errors.root import JetrouterError
from eventlog.binding import foreign_party
from eventlog.events import Decode, Event, MalformedMessage, decode_batch
from eventlog.raw_inbox import DESCRIPTION, STATUS, RawSubscription, parse_headers, subscribe_raw
from eventlog.wire import FORMAT_HEADER, NewerFormat, UnknownFormat, check_message

log = logging.getLogger(__name__)

_ACK_PREFIX = b"$JS.ACK."
# A message's header block is parsed only when it may mark a format (most carry just the
# Nats-Msg-Id of their append, which the reader does not read).
_FORMAT_MARK = FORMAT_HEADER.encode()
# Reply subject token positions ($JS.ACK.<...>): v1 has 9 tokens, v2 adds domain + account hash.
_V1_TOKENS = 9
_V1 = (5, 6, 8)  # stream seq, consumer seq, pending
_V2 = (7, 8, 10)
_STATUS_HEARTBEAT = "100"
# Subjects seen, bytes -> str: one per worker or replica, decoded once rather than per message.
_SUBJECT_CACHE = 4096
_STATUS_REQUEST_DONE = ("404", "408")


_Raw = tuple[bytes, bytes, bytes, bytes | None]


class StartPurged(JetrouterError):
    """The stream no longer holds ``wanted``: it starts at ``first_seq`` (purged or deleted).

    The caller must restore from a snapshot at or beyond ``first_seq - 1`` and read again.
    """

    def __init__(self, stream: str, wanted: int, first_seq: int) -> None:
        super().__init__(
            f"stream {stream}: sequence {wanted} was purged (stream now starts at {first_seq})"
        )
        self.stream = stream
        self.wanted = wanted
        self.first_seq = first_seq


class StreamReader:
    """``async for seq, events in StreamReader(js, "JR_KV", start_seq=n):`` replay then follow.

    ``last_seq`` is the last yielded sequence (``start_seq - 1`` before any), ``pending`` how many
    messages the server says remain after it, ``malformed`` how many messages failed to decode,
    ``resets`` how many times the consumer was recreated.
    """

    def __init__(
        self,
        js: JetStreamContext,
        stream: str,
        *,
        start_seq: int = 1,
        batch: int = 256,
        catch_up_batch: int = 2048,
        time_decode: bool = True,
        idle_heartbeat: float = 1.0,
        expires: float = 30.0,
        create_timeout: float = 2.0,
        linger: float = 0.0,
        decode: Decode = decode_batch,
    ) -> None:
        if start_seq < 1:
            raise ValueError(f"start_seq must be >= 1, got {start_seq}")
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        self._js = js
        self._nc = js._nc
        self._api_prefix: str = getattr(js, "_prefix", "$JS.API")
        self.stream = stream
        self.start_seq = start_seq
        self.batch = batch
        # While the server says more than ``batch`` messages wait, a pull asks for up to this
        # many: a replica replaying a tail waits one round trip per pull, not per 256 messages.
        self.catch_up_batch = max(batch, catch_up_batch)
        # Thread CPU time is a system call (~1 us), twice a message: only readers whose caller
        # reads ``last_decode_s`` (the router stream's, for the replication cost) pay it.
        self.time_decode = time_decode
        self.idle_heartbeat = idle_heartbeat
        self.expires = max(expires, 2 * idle_heartbeat)
        self.create_timeout = create_timeout
        self.liveness = 3 * idle_heartbeat
        self.linger = max(0.0, linger)
        # decode_batch, or a decoder that gives what it gives (eventlog/kv_decode.py)
        self.decode = decode

        self.last_seq = start_seq - 1
        self.pending = 0
        self.malformed = 0
        self.forged = 0
        self.resets = 0
        # The subject of the last yielded message and the CPU seconds decoding it took: the
        # replica counts the decode of its peers' router messages as replication cost.
        self.last_subject = ""
        self.last_decode_s = 0.0

        self._started = False
        self._start_lock = asyncio.Lock()
        self._closed = False
        self._failure: BaseException | None = None
        # Messages as the inbox received them: (subject, reply, payload, header block or None).
        self._buf: deque[_Raw] = deque()
        self._subjects: dict[bytes, str] = {}
        self._wake = asyncio.Event()
        self._closed_evt = asyncio.Event()
        self._background: set[asyncio.Task[None]] = set()
        self._gen = 0
        self._sub: RawSubscription | None = None
        self._consumer: str | None = None
        self._request_left = 0
        # With `linger`: whether the next pull takes everything there is (no_wait) rather than
        # waiting for one message, and whether a linger is due before it.
        self._draining = True
        self._linger_due = False
        self._expect_cseq = 1
        self._last_activity = time.monotonic()
        self._need_reset: str | None = None
        self._reconnects_seen = self._reconnects()

    # --- public API ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Check ``start_seq`` is still in the stream and create the consumer (done lazily by the
        first iteration when not called)."""
        async with self._start_lock:
            if self._started:
                return
            first, last = await self._bounds()
            if first > self.start_seq:
                self._fail(StartPurged(self.stream, self.start_seq, first))
            self.pending = max(0, last - self.last_seq)
            await self._reset("start")
            self._started = True

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> tuple[int, list[Event]]:
        if self._failure is not None:
            if self._sub is not None or self._consumer is not None:  # failed in take_received
                await self._drop_consumer()
            raise self._failure
        if not self._started:
            await self.start()
        while not self._closed:
            if self._reconnects() != self._reconnects_seen:
                self._reconnects_seen = self._reconnects()
                self._need_reset = self._need_reset or "connection re-established"
            if self._need_reset is not None:
                if self._nc.is_closed:
                    self._fail(ConnectionClosedError())
                await self._reset(self._need_reset)
                continue
            if not self._buf:
                await self._wait_for_messages()
                continue
            try:
                item = self._process(self._buf.popleft())
            except (StartPurged, NewerFormat):
                await self._drop_consumer()
                raise
            if item is not None:
                return item
        raise StopAsyncIteration

    @property
    def caught_up(self) -> bool:
        """Whether the reader took everything the stream held when it last looked and has a
        pull open for the next message (with ``linger``: that one comes at once, the ones
        after it wait the linger)."""
        return not self._draining and self._request_left > 0

    def take_received(self, limit: int) -> list[tuple[int, list[Event]]]:
        """Up to ``limit`` more messages that have already arrived, each exactly as
        ``__anext__`` would yield it, without awaiting: a replica catching up applies the
        thousands a pull brings in one go. Empty when none has arrived, or when the reader must
        first reset or fail; then ``__anext__`` does that (a purge or a newer format met here
        is raised by the next ``__anext__``, after every message before it was taken)."""
        out: list[tuple[int, list[Event]]] = []
        # Nothing here awaits, so a reconnect or a reset cannot happen during the loop: the
        # conditions are checked once, and the loop stops at a failure or a reset it meets.
        if self._failure is not None or self._reconnects() != self._reconnects_seen:
            return out
        buf, process, append = self._buf, self._process, out.append
        while buf and len(out) < limit and self._need_reset is None:
            try:
                item = process(buf.popleft())
            except (StartPurged, NewerFormat):
                break  # _fail recorded it: the next __anext__ drops the consumer and raises
            if item is not None:
                append(item)
        return out

    async def close(self) -> None:
        """Stop iterating (a pending ``__anext__`` ends with ``StopAsyncIteration``) and delete
        the consumer (best effort: an unreachable server drops it after its inactivity limit)."""
        if self._closed and self._sub is None:
            return
        self._closed = True
        self._closed_evt.set()
        self._wake.set()
        await self._drop_consumer()
        if self._background:  # deletions started by resets; do not leave them to die pending
            _, late = await asyncio.wait(self._background, timeout=1.0)
            for task in late:
                task.cancel()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- message handling ----------------------------------------------------------------------

    def _process(self, raw: _Raw) -> tuple[int, list[Event]] | None:
        """One inbox message: a status, a stale duplicate, a gap, or the next event batch."""
        subject_b, reply, data, header_block = raw
        if not reply.startswith(_ACK_PREFIX):
            self._on_status(header_block)
            return None
        tokens = reply.split(b".")
        i_sseq, i_cseq, i_pending = _V1 if len(tokens) == _V1_TOKENS else _V2
        sseq, cseq = int(tokens[i_sseq]), int(tokens[i_cseq])
        if cseq != self._expect_cseq:
            self._need_reset = f"lost delivery (consumer seq {cseq}, expected {self._expect_cseq})"
            return None
        self._expect_cseq += 1
        self._request_left -= 1
        if self._request_left == 0 and self.linger > 0 and not self._draining:
            self._draining = self._linger_due = True  # the one message of a quiet spell came
        if sseq <= self.last_seq:
            return None
        if sseq != self.last_seq + 1:
            self._fail(StartPurged(self.stream, self.last_seq + 1, sseq))
        subject = self._subjects.get(subject_b)
        if subject is None:
            if len(self._subjects) >= _SUBJECT_CACHE:
                self._subjects.clear()
            subject = self._subjects[subject_b] = subject_b.decode("utf-8", "replace")
        t0 = time.thread_time() if self.time_decode else 0.0
        try:
            # A newer format raises NewerFormat out of the reader before last_seq moves: the
            # message is neither applied nor skipped (eventlog/wire.py).
            if header_block is not None and _FORMAT_MARK in header_block:
                check_message(parse_headers(header_block), self.stream, sseq)
            events = self.decode(data)
        except NewerFormat as exc:
            self._fail(exc)
        except (MalformedMessage, UnknownFormat) as exc:
            self.malformed += 1
            log.warning("stream %s seq %d: skipping malformed message (%s)", self.stream, sseq, exc)
            events = []
        party = foreign_party(subject, events) if events else None
        if party is not None:
            self.malformed += 1  # counted with the malformed ones: skipped, never applied
            self.forged += 1
            log.warning("stream %s seq %d: skipping a message on %s that speaks for %r",
                        self.stream, sseq, subject, party)
            events = []
        self.last_seq = sseq
        self.pending = int(tokens[i_pending])
        self.last_subject = subject
        if self.time_decode:
            self.last_decode_s = time.thread_time() - t0
        return sseq, events

    def _on_status(self, header_block: bytes | None) -> None:
        headers = parse_headers(header_block) if header_block else {}
        status = headers.get(STATUS, "")
        if status == _STATUS_HEARTBEAT:
            return
        if status in _STATUS_REQUEST_DONE:  # the pull request expired or ran dry
            self._request_left = 0
            self._draining = False  # caught up (with `linger`: wait for one message next)
            return
        # 409 consumer deleted / leadership change / server shutdown, 503 no responders, ...
        self._need_reset = f"status {status} {headers.get(DESCRIPTION, '')}".strip()

    def _fail(self, exc: BaseException) -> NoReturn:
        self._failure = exc
        self._closed = True
        self._closed_evt.set()
        raise exc

    async def _wait_for_messages(self) -> None:
        """Keep one pull request open and wait for the inbox; declare the consumer dead after
        ``liveness`` seconds without a message or heartbeat."""
        if self._request_left <= 0:
            if self._linger_due:
                self._linger_due = False
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.linger):  # let the stream gather more
                        await self._closed_evt.wait()
                if self._closed:
                    return
            await self._pull()
            if self._need_reset is not None:
                return
        self._wake.clear()
        if self._buf or self._closed:
            return
        # Wait at least one heartbeat interval even when the deadline looks past: a caller that
        # held the loop for a while has not let the heartbeats in the socket reach us yet.
        remaining = self._last_activity + self.liveness - time.monotonic()
        try:
            # A timeout scope rather than wait_for: no task per wait (one per message at low
            # load, when each message arrives on its own).
            async with asyncio.timeout(max(remaining, self.idle_heartbeat)):
                await self._wake.wait()
        except TimeoutError:
            if time.monotonic() - self._last_activity >= self.liveness:
                self._need_reset = f"no heartbeat for {self.liveness:.1f}s"

    async def _pull(self) -> None:
        batch = self.batch if self.pending <= self.batch else min(self.pending,
                                                                   self.catch_up_batch)
        request: dict[str, object]
        if self.linger > 0 and self._draining:
            request = {"batch": batch, "no_wait": True}
        else:
            if self.linger > 0:
                batch = 1
            request = {
                "batch": batch,
                "expires": int(self.expires * 1e9),
                "idle_heartbeat": int(self.idle_heartbeat * 1e9),
            }
        subject = f"{self._api_prefix}.CONSUMER.MSG.NEXT.{self.stream}.{self._consumer}"
        assert self._sub is not None
        try:
            await self._nc.publish(subject, json.dumps(request).encode(), reply=self._sub.subject)
        except Exception as exc:  # reconnecting with a full buffer, closed connection, ...
            self._need_reset = f"pull request failed: {exc!r}"
            return
        self._request_left = batch
        self._last_activity = time.monotonic()

    # --- consumer lifecycle --------------------------------------------------------------------

    async def _reset(self, reason: str) -> None:
        """Recreate the consumer at ``last_seq + 1`` on a fresh inbox, retrying with backoff
        while JetStream is unreachable; messages buffered from the old one are dropped."""
        if reason != "start":
            self.resets += 1
            log.info("stream %s: resuming after seq %d (%s)", self.stream, self.last_seq, reason)
        await self._drop_consumer(wait=False)
        delay = 0.05
        failures = 0
        while not self._closed and not self._nc.is_closed:
            try:
                await self._create_consumer()
                self._need_reset = None
                if failures > 1:
                    log.warning("stream %s: consumer created after %d failed attempts",
                                self.stream, failures)
                return
            except Exception as exc:
                await self._drop_consumer(wait=False)
                failures += 1
                # One warning per spell, not four a second for as long as NATS is away (a
                # whole-NATS outage lasts as long as it lasts); the retries go to debug.
                log.log(
                    logging.WARNING if failures == 1 else logging.DEBUG,
                    "stream %s: cannot create consumer yet (%r); retry in %.2fs",
                    self.stream,
                    exc,
                    delay,
                )
                try:
                    await asyncio.wait_for(self._closed_evt.wait(), delay)
                except TimeoutError:
                    pass
                # Capped low: creation fails at once while the stream elects a leader
                # (4-9 s after its node dies) and should succeed right after it.
                delay = min(delay * 2, 0.25)

    async def _create_consumer(self) -> None:
        self._gen += 1
        gen = self._gen

        buf, wake, monotonic = self._buf, self._wake, time.monotonic

        # Called by the connection's protocol parser with the bytes as received (no Msg, no
        # header parsing, no queue and task per message: eventlog/raw_inbox.py).
        def on_msg(subject: bytes, reply: bytes, data: bytes, headers: bytes | None) -> None:
            if gen == self._gen:
                buf.append((subject, reply, data, headers))
                self._last_activity = monotonic()
                wake.set()

        self._sub = await subscribe_raw(self._nc, on_msg)
        config = ConsumerConfig(
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=self.last_seq + 1,
            ack_policy=AckPolicy.NONE,
            mem_storage=True,
            num_replicas=1,
            inactive_threshold=max(30.0, 10 * self.idle_heartbeat),
        )
        info = await self._js.add_consumer(self.stream, config, timeout=self.create_timeout)
        self._consumer = info.name
        self._reconnects_seen = self._reconnects()
        self._request_left = 0
        self._draining = True  # catch up first
        self._linger_due = False
        self._expect_cseq = 1
        self._last_activity = time.monotonic()

    async def _drop_consumer(self, *, wait: bool = True) -> None:
        """Forget the current consumer and its inbox; delete it on the server, in the background
        unless ``wait`` (a server that is away would hold a reset up for the API timeout)."""
        self._gen += 1
        self._buf.clear()
        self._request_left = 0
        sub, self._sub = self._sub, None
        consumer, self._consumer = self._consumer, None
        if sub is not None:
            try:
                await sub.unsubscribe()
            except Exception:  # connection closed or reconnecting: nothing left to undo
                pass
        if consumer is None:
            return
        if wait:
            await self._delete_consumer(consumer)
        else:
            task = asyncio.create_task(self._delete_consumer(consumer))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _delete_consumer(self, consumer: str) -> None:
        try:
            await self._js.delete_consumer(self.stream, consumer)
        except Exception:  # gone already, or server away: its inactivity limit reaps it
            pass

    async def _bounds(self) -> tuple[int, int]:
        state = (await self._js.stream_info(self.stream)).state
        return state.first_seq, state.last_seq

    def _reconnects(self) -> int:
        return int(self._nc.stats.get("reconnects", 0))
