"""The event log on a 3-node cluster: a reader and an appender ride out the loss of a node."""

from __future__ import annotations

import asyncio

from eventlog.appender import Appender
from eventlog.events import BlocksStored
from eventlog.names import Names
from eventlog.reader import StreamReader
from eventlog.server import NatsCluster
from eventlog.streams import ensure_streams

NAMES = Names("jr")
KV = NAMES.stream("kv")
SUBJECT = NAMES.kv_subject("w1")


def stored(event_id: int) -> BlocksStored:
    return BlocksStored(
        worker_id="w1", event_id=event_id, dp_rank=0, parent_hash=None,
        blocks=[(event_id, event_id)], ts=1.0,
    )  # fmt: skip


async def test_reader_survives_losing_the_node_it_is_connected_to(
    nats_cluster: NatsCluster, nats_connect
):
    nc = await nats_connect(nats_cluster.url)
    js = nc.jetstream()
    infos = await ensure_streams(js, NAMES)
    assert infos[KV].config.num_replicas == 3
    appender = Appender(js, timeout=1.0, attempts=12)
    for i in range(1, 31):
        await appender.append(SUBJECT, [stored(i)], msg_id=f"w1-{i}")

    reader = StreamReader(js, KV, batch=8, idle_heartbeat=0.25)
    seqs: list[int] = []
    ids: list[int] = []

    async def read_until(last: int) -> None:
        async for seq, events in reader:
            seqs.append(seq)
            ids.extend(e.event_id for e in events)  # type: ignore[union-attr]
            if seq == last:
                return

    await asyncio.wait_for(read_until(10), 10)
    assert nc.connected_url is not None
    victim = nats_cluster.urls.index(f"nats://127.0.0.1:{nc.connected_url.port}")
    nats_cluster.kill(victim)
    for i in range(31, 61):
        await appender.append(SUBJECT, [stored(i)], msg_id=f"w1-{i}")
    await asyncio.wait_for(read_until(60), 20)
    await reader.close()
    assert seqs == list(range(1, 61))
    assert ids == list(range(1, 61))
    assert reader.resets >= 1
