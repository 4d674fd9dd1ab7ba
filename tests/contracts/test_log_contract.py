"""One contract for every event log: written once, run against the in-memory log and against a
real nats-server (the JetStream adapter), so the memory log is held to what the runtime relies on.

Each ``Test*`` class below only says how to build its log; the cases live in
:class:`EventLogContract`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from eventlog.appender import Appender, AppendFailed
from eventlog.events import RequestFinished, decode_batch
from eventlog.jetstream_log import JetStreamLog
from eventlog.log import EventLog
from eventlog.memory import MemoryLog
from eventlog.names import CONTROL, KV, Names
from eventlog.reader import StartPurged
from natsops.server import NatsServer
from tests.log_items import Items, event_ids, stored, take

pytestmark = pytest.mark.timeout(60)

NAMES = Names("ct")
KV_STREAM = NAMES.stream(KV)
CONTROL_STREAM = NAMES.stream(CONTROL)
W1 = NAMES.kv_subject("w1")
W2 = NAMES.kv_subject("w2")


async def append_ids(log: EventLog, ids: range, subject: str = W1) -> list[int]:
    worker = subject.rsplit(".", 1)[1]
    return [await log.append(subject, [stored(i, worker)], f"{worker}-{i}") for i in ids]


class EventLogContract:
    """The cases; a subclass provides the ``log`` fixture (streams of ``NAMES`` ensured)."""

    async def test_appends_get_consecutive_sequences_and_read_back_in_order(
            self, log: EventLog) -> None:
        assert await append_ids(log, range(1, 6)) == [1, 2, 3, 4, 5]
        reader = log.reader(KV_STREAM, start_seq=1)
        try:
            items = await take(reader, 5)
        finally:
            await reader.close()
        assert [seq for seq, _ in items] == [1, 2, 3, 4, 5]
        assert event_ids(items) == [1, 2, 3, 4, 5]
        assert (reader.last_seq, reader.pending, reader.malformed) == (5, 0, 0)

    async def test_take_received_never_skips_or_reorders(self, log: EventLog) -> None:
        """Whatever ``take_received`` hands over (possibly nothing) comes in order between the
        messages ``__anext__`` yields: every sequence once, as a catching-up follower reads."""
        await append_ids(log, range(1, 41))
        reader = log.reader(KV_STREAM, start_seq=1, time_decode=False)
        items: Items = []
        try:
            while len(items) < 40:
                items += await take(reader, 1)
                items += reader.take_received(7)
        finally:
            await reader.close()
        assert [seq for seq, _ in items] == list(range(1, 41))
        assert event_ids(items) == list(range(1, 41))
        assert reader.last_seq == 40

    async def test_a_repeated_message_id_is_stored_once_and_answers_the_first_sequence(
            self, log: EventLog) -> None:
        first = await log.append(W1, [stored(1)], "same-id")
        await log.append(W1, [stored(2)], "other-id")
        again = await log.append(W1, [stored(99)], "same-id")  # a retry: payload is not looked at
        assert again == first == 1
        assert await log.bounds(KV_STREAM) == (1, 2)
        reader = log.reader(KV_STREAM)
        try:
            assert event_ids(await take(reader, 2)) == [1, 2]
        finally:
            await reader.close()

    async def test_replays_from_a_position_then_follows_live(self, log: EventLog) -> None:
        await append_ids(log, range(1, 11))
        reader = log.reader(KV_STREAM, start_seq=4)
        try:
            await reader.start()
            assert reader.pending == 7
            replayed = await take(reader, 7)
            assert [seq for seq, _ in replayed] == list(range(4, 11))
            follower = asyncio.create_task(take(reader, 5))
            await append_ids(log, range(11, 16))
            live = await follower
        finally:
            await reader.close()
        assert [seq for seq, _ in live] == list(range(11, 16))
        assert event_ids(live) == list(range(11, 16))

    async def test_a_reader_from_past_the_end_waits_for_the_next_message(
            self, log: EventLog) -> None:
        await append_ids(log, range(1, 4))
        reader = log.reader(KV_STREAM, start_seq=4)
        try:
            await reader.start()
            assert (reader.last_seq, reader.pending) == (3, 0)
            follower = asyncio.create_task(take(reader, 1))
            await append_ids(log, range(4, 5))
            assert event_ids(await follower) == [4]
        finally:
            await reader.close()

    async def test_close_ends_a_reader_waiting_for_more(self, log: EventLog) -> None:
        reader = log.reader(KV_STREAM)
        waiting = asyncio.create_task(take(reader, 1))
        await reader.start()
        await reader.close()
        assert await asyncio.wait_for(waiting, 30) == []

    async def test_bounds_of_a_new_a_written_and_an_emptied_stream(self, log: EventLog) -> None:
        assert await log.bounds(KV_STREAM) == (0, 0)
        await append_ids(log, range(1, 5))
        assert await log.bounds(KV_STREAM) == (1, 4)
        await log.purge(KV_STREAM, keep_from=3)
        assert await log.bounds(KV_STREAM) == (3, 4)
        await log.purge(KV_STREAM)
        assert await log.bounds(KV_STREAM) == (5, 4)
        assert await append_ids(log, range(5, 6)) == [5]  # sequences go on after a purge
        assert await log.bounds(KV_STREAM) == (5, 5)

    async def test_reading_from_a_purged_position_raises_start_purged(
            self, log: EventLog) -> None:
        await append_ids(log, range(1, 8))
        await log.purge(KV_STREAM, keep_from=5)
        reader = log.reader(KV_STREAM, start_seq=2)
        with pytest.raises(StartPurged) as raised:
            await take(reader, 1)
        await reader.close()
        assert (raised.value.stream, raised.value.wanted, raised.value.first_seq) == (
            KV_STREAM, 2, 5)
        reader = log.reader(KV_STREAM, start_seq=5)  # from the first kept message: fine
        try:
            assert [seq for seq, _ in await take(reader, 3)] == [5, 6, 7]
        finally:
            await reader.close()

    async def test_a_purge_under_a_started_reader_raises_start_purged_at_the_hole(
            self, log: EventLog) -> None:
        await append_ids(log, range(1, 8))
        reader = log.reader(KV_STREAM, start_seq=1)
        try:
            await reader.start()
            await log.purge(KV_STREAM, keep_from=4)
            with pytest.raises(StartPurged) as raised:
                await take(reader, 1)
        finally:
            await reader.close()
        assert (raised.value.wanted, raised.value.first_seq) == (1, 4)

    async def test_malformed_and_forged_messages_advance_the_sequence_unapplied(
            self, log: EventLog) -> None:
        await log.append(W1, [stored(1)], "good-1")
        await log.append_raw(W1, b"\x00 not an event batch", "bad")
        await log.append(W1, [stored(2, worker_id="w2")], "forged")  # w1 speaking for w2
        await log.append(W1, [stored(3)], "good-3")
        reader = log.reader(KV_STREAM)
        try:
            items = await take(reader, 4)
        finally:
            await reader.close()
        assert [(seq, len(events)) for seq, events in items] == [(1, 1), (2, 0), (3, 0), (4, 1)]
        assert (reader.malformed, reader.forged) == (2, 1)

    async def test_headers_and_the_last_message_per_subject(self, log: EventLog) -> None:
        assert await log.last_message(KV_STREAM, W1) is None
        await log.append(W1, [stored(1)], "a", headers={"Jr-Pos": "1"})
        await log.append(W2, [stored(1, "w2")], "b", headers={"Jr-Pos": "w2"})
        await log.append(W1, [stored(2)], "c", headers={"Jr-Pos": "2"})
        await log.append(W2, [stored(2, "w2")], "d")
        last = await log.last_message(KV_STREAM, W1)
        assert last is not None
        assert (last.seq, last.subject) == (3, W1)
        assert last.headers is not None and last.headers["Jr-Pos"] == "2"
        assert last.headers["Nats-Msg-Id"] == "c"
        assert [e.event_id for e in decode_batch(last.data)] == [2]  # type: ignore[attr-defined]

    async def test_streams_are_apart_and_a_subject_without_one_is_refused(
            self, log: EventLog) -> None:
        control = NAMES.control_subject("config")
        assert await log.append(control, [RequestFinished("r", "ok", 1, 1.0)], "ctl-1") == 1
        assert await append_ids(log, range(1, 3)) == [1, 2]
        assert await log.bounds(CONTROL_STREAM) == (1, 1)
        with pytest.raises(AppendFailed):
            await log.append("elsewhere.nobody.listens", [stored(1)], "lost")

    async def test_a_full_stream_refuses_new_appends_and_keeps_the_old(
            self, log: EventLog) -> None:
        names = Names("full")
        await log.ensure_streams(names, max_bytes=4096, kinds=(KV,))
        subject = names.kv_subject("w1")
        big = [stored(i) for i in range(40)]  # one message of roughly a kilobyte
        stored_seqs = []
        with pytest.raises(AppendFailed):
            for i in range(64):
                stored_seqs.append(await log.append(subject, big, f"big-{i}"))
        assert stored_seqs and stored_seqs == list(range(1, len(stored_seqs) + 1))
        assert await log.bounds(names.stream(KV)) == (1, len(stored_seqs))


class TestMemoryLog(EventLogContract):
    @pytest.fixture
    async def log(self) -> AsyncIterator[EventLog]:
        memory = MemoryLog()
        await memory.ensure_streams(NAMES)
        yield memory


class TestJetStreamLog(EventLogContract):
    @pytest.fixture
    async def log(self, nats_server: NatsServer, nats_connect) -> AsyncIterator[EventLog]:
        nc = await nats_connect(nats_server.url)
        js = nc.jetstream()
        # Two tries at most: a subject no stream captures answers "no responders", which the
        # runtime's appender retries as a passing state for many seconds.
        jetstream = JetStreamLog(js, Appender(js, timeout=5.0, attempts=2))
        await jetstream.ensure_streams(NAMES)
        yield jetstream
