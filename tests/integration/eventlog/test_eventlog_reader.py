"""StreamReader against real nats-server: replay + follow, purges, malformed input, restarts."""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
import pytest

from eventlog import kv_decode
from eventlog.appender import Appender
from eventlog.events import BlocksStored, decode_batch, encode_batch
from eventlog.kv_decode import decode_kv_batch
from eventlog.names import Names
from eventlog.packed_pairs import PackedPairs
from eventlog.reader import StartPurged, StreamReader
from eventlog.wire import EVENT_FORMAT, FORMAT_HEADER, NewerFormat
from natsops.server import NatsServer
from tests.log_items import Items, event_ids, stored, take
from tests.waiting import until

NAMES = Names("jr")
KV = NAMES.stream("kv")
SUBJECT = NAMES.kv_subject("w1")


async def append_range(appender: Appender, ids: range) -> None:
    for i in ids:
        await appender.append(SUBJECT, [stored(i)], msg_id=f"w1-{i}")


async def test_replays_then_follows_live_in_order(js):
    _, context = js
    appender = Appender(context)
    await append_range(appender, range(1, 11))
    async with StreamReader(context, KV, start_seq=3, batch=4) as reader:
        replayed = await take(reader, 8)
        assert [seq for seq, _ in replayed] == list(range(3, 11))
        assert event_ids(replayed) == list(range(3, 11))
        assert reader.pending == 0 and reader.last_seq == 10

        follower = asyncio.create_task(take(reader, 5))
        await append_range(appender, range(11, 16))
        live = await follower
        assert [seq for seq, _ in live] == list(range(11, 16))
        assert event_ids(live) == list(range(11, 16))
        assert reader.resets == 0


async def test_pending_counts_what_is_left(js):
    _, context = js
    await append_range(Appender(context), range(1, 21))
    async with StreamReader(context, KV, batch=8) as reader:
        await reader.start()
        assert reader.pending == 20
        await take(reader, 5)
        assert (reader.last_seq, reader.pending) == (5, 15)


async def test_start_below_purged_sequence_raises(js):
    _, context = js
    await append_range(Appender(context), range(1, 11))
    await context.purge_stream(KV, seq=6)  # keeps 6..10
    reader = StreamReader(context, KV, start_seq=2)
    with pytest.raises(StartPurged) as info:
        await take(reader, 1)
    assert (info.value.stream, info.value.wanted, info.value.first_seq) == (KV, 2, 6)
    async with StreamReader(context, KV, start_seq=6) as ok:
        assert [seq for seq, _ in await take(ok, 5)] == [6, 7, 8, 9, 10]


async def test_purge_under_a_slow_reader_raises(js):
    _, context = js
    await append_range(Appender(context), range(1, 21))
    async with StreamReader(context, KV, batch=4, catch_up_batch=4) as reader:  # pulls of 4
        assert [seq for seq, _ in await take(reader, 4)] == [1, 2, 3, 4]
        await context.purge_stream(KV, seq=15)
        with pytest.raises(StartPurged) as info:
            await take(reader, 1)
        assert (info.value.wanted, info.value.first_seq) == (5, 15)


async def test_malformed_messages_are_counted_and_skipped(js, caplog):
    _, context = js
    appender = Appender(context)
    await append_range(appender, range(1, 3))
    await context.publish(NAMES.kv_subject("x"), b"\xc1 not msgpack at all")
    await context.publish(NAMES.kv_subject("x"), msgspec.msgpack.encode([{"type": "Nope", "a": 1}]))
    await append_range(appender, range(3, 5))
    caplog.set_level(logging.WARNING, logger="eventlog.reader")
    async with StreamReader(context, KV) as reader:
        items = await take(reader, 6)
    assert [seq for seq, _ in items] == [1, 2, 3, 4, 5, 6]
    assert [len(events) for _, events in items] == [1, 1, 0, 0, 1, 1]
    assert event_ids(items) == [1, 2, 3, 4]
    assert reader.malformed == 2
    logged = [r.getMessage() for r in caplog.records if "malformed" in r.getMessage()]
    assert len(logged) == 2 and "seq 3" in logged[0] and "seq 4" in logged[1]


async def test_packed_blocks_read_as_decode_batch_reads_them(js):
    """A reader decoding with ``decode_kv_batch`` (a replica whose index takes packed blocks)
    yields events equal to ``decode_batch``'s, and skips the same malformed messages."""
    _, context = js
    appender = Appender(context)
    blocks = [(2**64 - 1 - i, i) for i in range(40)]  # past the small-message cut
    await appender.append(SUBJECT, [BlocksStored("w1", 1, 0, None, blocks, 1.0)], msg_id="p1")
    good = encode_batch([BlocksStored("w1", 2, 0, 7, blocks, 2.0)])
    # the first pair's tokens hash 0 written as -1 (int 8): decode_batch refuses it
    negative = good.replace(b"\xff\xff\x00\x92", b"\xff\xff\xd0\xff\x92", 1)
    assert negative != good
    await context.publish(SUBJECT, negative)
    await context.publish(SUBJECT, good)
    read: dict[str, Items] = {}
    for name, decode in (("batch", decode_batch), ("packed", decode_kv_batch)):
        async with StreamReader(context, KV, decode=decode) as reader:
            read[name] = await take(reader, 3)
            assert reader.malformed == 1
    assert read["packed"] == read["batch"]
    assert [len(events) for _, events in read["packed"]] == [1, 0, 1]
    if kv_decode.AVAILABLE:
        assert isinstance(read["packed"][0][1][0].blocks, PackedPairs)  # type: ignore[union-attr]


async def test_resumes_across_server_restart_without_gaps_or_duplicates(
    nats_server: NatsServer, js
):
    _, context = js
    appender = Appender(context, timeout=1.0, attempts=10)
    await append_range(appender, range(1, 51))
    reader = StreamReader(context, KV, batch=8, idle_heartbeat=0.2)
    seen = await take(reader, 20)
    await nats_server.arestart()  # same port, same store dir
    await append_range(appender, range(51, 81))
    seen += await take(reader, 60, timeout=20)
    await reader.close()
    assert [seq for seq, _ in seen] == list(range(1, 81))
    assert event_ids(seen) == list(range(1, 81))
    assert reader.resets >= 1


async def test_close_ends_a_waiting_iteration(js):
    _, context = js
    reader = StreamReader(context, KV)
    waiting = asyncio.create_task(take(reader, 1))
    await reader.start()
    await reader.close()
    assert await asyncio.wait_for(waiting, 5) == []


async def test_consumer_deleted_under_the_reader_is_recreated(js):
    _, context = js
    appender = Appender(context)
    await append_range(appender, range(1, 6))
    async with StreamReader(context, KV, batch=4) as reader:
        assert [seq for seq, _ in await take(reader, 5)] == [1, 2, 3, 4, 5]
        follower = asyncio.create_task(take(reader, 3))
        consumers = []
        while not consumers:  # the follower's pull request is open once the consumer is listed
            consumers = await context.consumers_info(KV)
        for info in consumers:
            await context.delete_consumer(KV, info.name)
        await append_range(appender, range(6, 9))
        assert [seq for seq, _ in await follower] == [6, 7, 8]
        assert reader.resets >= 1


async def test_a_lingering_reader_takes_a_quiet_spell_s_later_messages_in_one_pull(js):
    _, context = js
    appender = Appender(context)
    await append_range(appender, range(1, 4))
    linger = 4.0
    async with StreamReader(context, KV, batch=2, linger=linger) as reader:
        assert [seq for seq, _ in await take(reader, 3)] == [1, 2, 3]  # replay: no linger
        follower = asyncio.create_task(take(reader, 6))
        # A quiet spell starts once the reader has caught up (a message that comes while it
        # still drains what it replayed is taken with those).
        await until(lambda: reader.caught_up, timeout=30, what="reader caught up",
                    interval=0.01)
        await append_range(appender, range(4, 5))
        # The first message of a quiet spell comes at once...
        await until(lambda: reader.last_seq == 4, timeout=30, what="message 4 read",
                    interval=0.01)
        seen_4 = time.monotonic()
        await append_range(appender, range(5, 10))
        # ...the next ones wait on the server for the linger, then come in one go (in pulls
        # of `batch`, as many as it takes), in order, without gaps. (Only checkable while the
        # linger lasts: a machine busy enough to take longer over five appends has let it end.)
        if time.monotonic() - seen_4 < linger:
            assert reader.last_seq == 4
        live = await follower
        assert [seq for seq, _ in live] == list(range(4, 10))
        assert event_ids(live) == list(range(4, 10))
        assert reader.resets == 0
        closing = asyncio.create_task(take(reader, 1))  # caught up: one message asked for
        await append_range(appender, range(10, 11))
        assert [seq for seq, _ in await closing] == [10]
    assert reader.resets == 0


async def test_close_ends_a_lingering_reader_at_once(js):
    _, context = js
    appender = Appender(context)
    reader = StreamReader(context, KV, linger=60.0)
    await append_range(appender, range(1, 2))
    assert [seq for seq, _ in await take(reader, 1)] == [1]  # caught up
    follower = asyncio.create_task(take(reader, 1))
    await append_range(appender, range(2, 3))
    assert [seq for seq, _ in await follower] == [2]  # a quiet spell's first: at once
    waiting = asyncio.create_task(take(reader, 1))  # lingers 60 s before pulling again
    await append_range(appender, range(3, 4))
    await reader.close()
    assert await asyncio.wait_for(waiting, 5) == []


async def test_catching_up_takes_what_a_pull_brought_without_awaiting(js):
    """Far behind, one pull asks for up to ``catch_up_batch`` messages; ``take_received`` hands
    over what has arrived as ``__anext__`` would, in order, and a live message still comes
    through ``__anext__``."""
    _, context = js
    appender = Appender(context)
    await append_range(appender, range(1, 301))
    async with StreamReader(context, KV, batch=8, catch_up_batch=128,
                            time_decode=False) as reader:
        items = await take(reader, 1)
        await until(lambda: len(reader._buf) >= 127, timeout=30)  # one pull: 128, not 8
        while len(items) < 300:
            taken = reader.take_received(50)
            assert len(taken) <= 50
            items += taken if taken else await take(reader, 1)
        assert [seq for seq, _ in items] == list(range(1, 301))
        assert event_ids(items) == list(range(1, 301))
        assert reader.last_seq == 300 and reader.last_decode_s == 0.0
        assert reader.take_received(10) == []
        follower = asyncio.create_task(take(reader, 1))
        await append_range(appender, range(301, 302))
        assert [seq for seq, _ in await follower] == [301]


async def test_a_newer_format_met_by_take_received_is_raised_by_the_next_anext(js):
    """Every message before it is handed over; the reader stays before it, for good."""
    _, context = js
    appender = Appender(context)
    await append_range(appender, range(1, 4))
    await appender.append(SUBJECT, [stored(4)], msg_id="w1-4",
                          headers={FORMAT_HEADER: str(EVENT_FORMAT + 1)})
    await append_range(appender, range(5, 7))
    async with StreamReader(context, KV, batch=2, catch_up_batch=16) as reader:
        items = await take(reader, 1)
        await until(lambda: len(reader._buf) >= 5, timeout=30)
        items += reader.take_received(10)
        assert [seq for seq, _ in items] == [1, 2, 3]
        assert reader.take_received(10) == []
        with pytest.raises(NewerFormat):
            await asyncio.wait_for(reader.__anext__(), 30)
        assert reader.last_seq == 3


async def test_a_catch_up_tail_reads_every_message_once_in_order_across_pulls(js, caplog):
    """A tail as a restarting replica reads it (one ``__anext__``, then ``take_received`` until
    the pull is spent, pulls of 16 over 150 messages): every sequence exactly once, in order; the
    malformed, forged and wrongly marked messages inside it counted and skipped; messages marked
    format 1 or carrying other headers applied."""
    _, context = js
    appender = Appender(context)
    bad: dict[int, str] = {}
    for i in range(1, 151):
        if i % 37 == 0:
            await context.publish(SUBJECT, b"\xc1 garbage", headers={"Nats-Msg-Id": f"g{i}"})
            bad[i] = "malformed"
        elif i % 41 == 0:  # w2's event on w1's subject
            forged = BlocksStored("w2", i, 0, None, [(i, i)], 1.0)
            await appender.append(SUBJECT, [forged], msg_id=f"f{i}")
            bad[i] = "forged"
        elif i % 43 == 0:
            await appender.append(SUBJECT, [stored(i)], msg_id=f"x{i}",
                                  headers={FORMAT_HEADER: "x"})
            bad[i] = "unknown format"
        else:
            headers = {FORMAT_HEADER: "1", "Other": "y"} if i % 10 == 0 else None
            await appender.append(SUBJECT, [stored(i)], msg_id=f"w1-{i}", headers=headers)
    caplog.set_level(logging.WARNING, logger="eventlog.reader")
    items: Items = []
    async with StreamReader(context, KV, batch=4, catch_up_batch=16,
                            time_decode=False) as reader:
        while len(items) < 150:
            items += await take(reader, 1)
            items += reader.take_received(5)  # smaller than a pull: a pull spans several takes
            items += reader.take_received(1 << 20)
    assert [seq for seq, _ in items] == list(range(1, 151))
    assert [seq for seq, events in items if not events] == sorted(bad)
    assert event_ids(items) == [i for i in range(1, 151) if i not in bad]
    assert (reader.malformed, reader.forged) == (len(bad), list(bad.values()).count("forged"))
    assert reader.last_seq == 150 and reader.pending == 0
    assert len([r for r in caplog.records if "skipping" in r.getMessage()]) == len(bad)
