"""Two independent readers of the same streams, fed ~10,000 random events, agree exactly."""

from __future__ import annotations

import asyncio
import random
import time

import nats
import pytest

from eventlog.appender import Appender
from eventlog.events import BlocksStored, encode_batch
from eventlog.names import KV, ROUTER, STREAM_KINDS, Names
from eventlog.reader import StreamReader
from eventlog.streams import ensure_streams, stream_bounds
from natsops.server import NatsServer
from replicas.core.state import RouterState, StateConfig
from tests.eventgen import interleave, router_history, worker_history

NAMES = Names("jr")


def _replica_of(event) -> str:
    # router_history names requests "<replica>-<n>"; ReplicaLost carries its replica.
    rid = getattr(event, "replica_id", None)
    return rid or event.request_id.split("-")[0]


async def follow_into(state: RouterState, js, until: dict[str, int], timeout: float = 60) -> None:
    """Feed a state from all three streams until it has applied `until` (or fail)."""

    async def one(kind: str) -> None:
        if until[kind] == 0:
            return
        reader = StreamReader(js, NAMES.stream(kind), start_seq=state.positions[kind] + 1)
        try:
            async for seq, batch in reader:
                state.apply(kind, seq, batch)
                if seq >= until[kind]:
                    return
        finally:
            await reader.close()

    await asyncio.wait_for(asyncio.gather(*(one(k) for k in STREAM_KINDS)), timeout)


@pytest.mark.timeout(120)
async def test_two_readers_fed_10000_random_events_agree(nats_server: NatsServer) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        js = nc.jetstream()
        await ensure_streams(js, NAMES)
        appender = Appender(js)
        rng = random.Random(20261122)
        workers = [f"w{i}" for i in range(8)]
        kv = interleave(rng, [worker_history(rng, w, 600, dp_size=1 + i % 2)
                              for i, w in enumerate(workers)])
        router = interleave(rng, [router_history(rng, r, workers, 500) for r in ("ra", "rb")])
        n_events = sum(map(len, kv)) + sum(map(len, router))
        assert n_events >= 10_000

        async def publish(kind: str, batches: list, subject_of) -> None:
            for i in range(0, len(batches), 200):  # pipelined, order kept per chunk
                chunk = batches[i:i + 200]
                await asyncio.gather(*(appender.append(subject_of(b), b, f"{kind}-{i + j}")
                                       for j, b in enumerate(chunk)))

        # Reader 1 starts before publishing (follows live); reader 2 replays afterwards.
        live = RouterState(StateConfig(request_max_age=1e9))
        await publish(KV, kv, lambda b: NAMES.kv_subject(b[0].worker_id))
        half = {k: 0 for k in STREAM_KINDS}
        half[KV] = len(kv)
        live_task = asyncio.create_task(follow_into(live, js, {**half, ROUTER: len(router)}))
        await publish(ROUTER, router, lambda b: NAMES.router_subject(_replica_of(b[0])))
        bounds = {k: (await stream_bounds(js, NAMES.stream(k)))[1] for k in STREAM_KINDS}
        assert bounds[KV] == len(kv) and bounds[ROUTER] == len(router)
        await live_task

        replayed = RouterState(StateConfig(request_max_age=1e9))
        await follow_into(replayed, js, bounds)

        assert live.positions == replayed.positions == bounds
        assert live.digests() == replayed.digests()
        assert live.index.total_blocks > 0 and len(live.load) > 0  # a non-trivial state
        # And both equal a state built straight from the histories, in publish order.
        direct = RouterState(StateConfig(request_max_age=1e9))
        for seq, b in enumerate(kv, 1):
            direct.apply(KV, seq, b)
        for seq, b in enumerate(router, 1):
            direct.apply(ROUTER, seq, b)
        assert direct.digests() == live.digests()
    finally:
        await nc.close()


@pytest.mark.timeout(60)
async def test_malformed_messages_are_counted_and_skipped_by_the_state(
        nats_server: NatsServer) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        js = nc.jetstream()
        await ensure_streams(js, NAMES)
        subject = NAMES.kv_subject("x")
        await js.publish(subject, b"\x00\xffnot msgpack at all")
        await js.publish(subject, encode_batch([]) + b"")  # valid: an empty batch
        import msgspec
        await js.publish(subject, msgspec.msgpack.encode([{"type": "BlocksStored", "oops": 1}]))
        good = [BlocksStored("x", 1, 0, None, [(5, 7)], time.time())]
        await js.publish(subject, encode_batch(good))
        state = RouterState()
        await follow_into(state, js, {KV: 4, ROUTER: 0, "control": 0})
        assert state.positions[KV] == 4
        assert state.stats.counts[(KV, "message", "malformed")] == 3  # empty batch counts too
        assert state.index.find_matches([7]).scores == {("x", 0): 1}
    finally:
        await nc.close()
