"""Appender against real nats-server: exactly-once by message id, retries, named failures."""

from __future__ import annotations

import asyncio

import pytest

from eventlog.appender import Appender, AppendFailed
from eventlog.events import AllBlocksCleared, BlocksStored, decode_batch
from eventlog.names import Names
from eventlog.streams import stream_bounds
from natsops.server import NatsServer

NAMES = Names("jr")
KV = NAMES.stream("kv")


def stored(event_id: int) -> BlocksStored:
    return BlocksStored(
        worker_id="w1", event_id=event_id, dp_rank=0, parent_hash=None,
        blocks=[(event_id, event_id * 7)], ts=1.0,
    )  # fmt: skip


async def test_same_msg_id_twice_is_one_message_with_one_seq(js):
    _, context = js
    appender = Appender(context)
    subject = NAMES.kv_subject("w1")
    first = await appender.append(subject, [stored(1)], msg_id="w1-1")
    other = await appender.append(subject, [stored(2)], msg_id="w1-2")
    again = await appender.append(subject, [stored(1)], msg_id="w1-1")
    assert (first, other, again) == (1, 2, 1)
    assert appender.duplicates == 1
    assert await stream_bounds(context, KV) == (1, 2)
    raw = await context.get_msg(KV, 1)
    assert decode_batch(raw.data) == [stored(1)]
    assert raw.headers is not None and raw.headers["Nats-Msg-Id"] == "w1-1"


async def test_batch_round_trips_in_order(js):
    _, context = js
    batch = [AllBlocksCleared(worker_id="w1", event_id=1, dp_rank=0, ts=1.0), stored(2)]
    seq = await Appender(context).append(NAMES.kv_subject("w1"), batch, msg_id="b")
    assert decode_batch((await context.get_msg(KV, seq)).data) == batch


async def test_append_rides_out_a_server_restart(nats_server: NatsServer, js):
    _, context = js
    appender = Appender(context, timeout=1.0, attempts=8)
    subject = NAMES.kv_subject("w1")
    assert await appender.append(subject, [stored(1)], msg_id="r-1") == 1
    nats_server.kill()
    # The server is down while the append starts: it must retry until the restart completes.
    pending = asyncio.create_task(appender.append(subject, [stored(2)], msg_id="r-2"))
    await nats_server.arestart()
    assert await asyncio.wait_for(pending, 20) == 2
    # A retry of the same id after the restart still dedups against the persisted stream.
    assert await appender.append(subject, [stored(2)], msg_id="r-2") == 2
    assert await stream_bounds(context, KV) == (1, 2)


async def test_no_stream_for_subject_fails_with_subject_and_cause(js):
    _, context = js
    appender = Appender(context, timeout=0.2, attempts=2)
    with pytest.raises(AppendFailed) as info:
        await appender.append("nowhere.at.all", [stored(1)], msg_id="x")
    assert info.value.subject == "nowhere.at.all"
    assert "nowhere.at.all" in str(info.value)
    assert info.value.cause is not None
    assert appender.retries == 1


async def test_empty_msg_id_is_refused(js):
    with pytest.raises(ValueError):
        await Appender(js[1]).append(NAMES.kv_subject("w1"), [stored(1)], msg_id="")
