"""The leader's snapshot capture in slices (leader.py; index_capture.py for the compact index,
index_reference_capture.py for the reference one) with a real replica on a real nats-server,
KV messages appended all the while: each snapshot decodes to the state at its positions, KV
messages wait while the index is copied and are all applied after, once each, and the KV hold
ends on every path (a failed capture, a cancelled one, the lease lost)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
from collections.abc import AsyncIterator, Iterator

import pytest

from eventlog.jetstream_log import JetStreamLog
from eventlog.names import KV, ROUTER, Names
from natsops.server import NatsServer
from replicas.core import index_capture, state_codec
from replicas.core.state import RouterState, StateConfig
from replicas.runtime import follower as follower_module
from replicas.runtime import leader as leader_module
from replicas.runtime.leader import NoLeader
from replicas.runtime.replica import Replica, ReplicaConfig
from tests.conftest import Connect
from tests.eventgen import worker_history
from tests.waiting import until

pytestmark = pytest.mark.timeout(120)

NAMES = Names("jr")


class Feeder:
    """Appends KV batches of several workers one after the other, and keeps the digests of the
    state after each one (what a snapshot at that KV position must decode to)."""

    def __init__(self, log: JetStreamLog, seed: int = 1) -> None:
        rng = random.Random(seed)
        self.log = log
        histories = [worker_history(rng, f"w{i}", 400) for i in range(6)]
        # round robin, so every worker's messages keep coming
        self.batches = [b for group in itertools.zip_longest(*histories) for b in group if b]
        self.reference = RouterState()  # both index forms have the same digests
        self.digests: dict[int, dict[str, int]] = {0: self.reference.digests()}
        self.last = 0

    async def append(self, n: int, burst: int = 1) -> None:
        """``n`` batches, ``burst`` at a time (of as many workers: appended concurrently, so
        they may reach the replica together)."""
        end = min(self.last + n, len(self.batches))
        while self.last < end:
            chunk = self.batches[self.last:min(self.last + burst, end)]
            seqs = await asyncio.gather(*(
                self.log.append(NAMES.kv_subject(str(batch[0].worker_id)), batch,  # type: ignore[union-attr]
                                msg_id=f"feed.{self.last + i}")
                for i, batch in enumerate(chunk)))
            for seq, batch in sorted(zip(seqs, chunk, strict=True), key=lambda x: x[0]):
                self.reference.apply(KV, seq, batch)
                self.digests[seq] = self.reference.digests()
            self.last += len(chunk)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set() and self.last < len(self.batches):
            await self.append(6, burst=6)


@pytest.fixture(params=["compact", "reference"])
def form(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def replica(nats_server: NatsServer, monkeypatch: pytest.MonkeyPatch, form: str
                  ) -> AsyncIterator[Replica]:
    # Small steps and no slice budget: the loop runs after every step, so KV messages arrive
    # in the middle of a capture.
    monkeypatch.setattr(index_capture, "STEP_CELLS", 64)
    monkeypatch.setattr(leader_module, "_CAPTURE_SLICE", 0.0)
    # KV messages that came together are applied one slice each, a pass through the loop
    # between two: a hold may start between two slices of what the reader took.
    monkeypatch.setattr(follower_module, "_KV_SLICE", 1)
    config = ReplicaConfig("r1", nats_server.url, state=StateConfig(index_form=form),
                           canary_interval=0,
                           snapshot_threshold=10**9, worker_timeout=86400,
                           replica_timeout=86400)
    replica = Replica(config)
    await replica.start()
    try:
        await replica.wait_ready(30)
        await until(lambda: replica.is_leader, timeout=30, what="the lease")
        yield replica
    finally:
        await replica.stop()


@pytest.fixture
async def feeder(nats_server: NatsServer, nats_connect: Connect) -> Feeder:
    nc = await nats_connect(nats_server.url)
    log = JetStreamLog(nc.jetstream())
    await log.ensure_streams(NAMES)
    return Feeder(log)


async def applied(replica: Replica, feeder: Feeder) -> None:
    await until(lambda: replica.state.positions[KV], lambda p: p >= feeder.last, timeout=30,
                what="the KV messages applied")


async def test_snapshots_taken_while_kv_messages_arrive_are_the_state_at_their_positions(
        replica: Replica, feeder: Feeder) -> None:
    assert replica.leader is not None
    await feeder.append(200)  # a state to copy in some hundreds of steps
    await applied(replica, feeder)
    stop = asyncio.Event()
    feeding = asyncio.create_task(feeder.run(stop))
    try:
        for _ in range(4):
            answer = await replica.leader.take_snapshot("test")
            assert not replica.follower.kv_held
            assert answer["positions"][ROUTER] == 0  # no decisions here: KV decides it all
            blob = await replica.leader.store.get(answer["snapshot_id"])
            restored = RouterState.decode(blob, replica.state.config)
            assert restored.positions[KV] == answer["positions"][KV]
            assert restored.digests() == feeder.digests[answer["positions"][KV]]
    finally:
        stop.set()
        await feeding
    # KV messages came while the index was copied, and waited for the copy to end
    assert replica.follower.kv_waits > 0
    # and every message was applied, once: the replica's state is the feeder's
    await applied(replica, feeder)
    assert replica.state.digests() == feeder.reference.digests()


def endless_capture(started: asyncio.Event, failing: asyncio.Event):  # type: ignore[no-untyped-def]
    """A stand-in for ``RouterState.capture`` whose steps go on until ``failing`` is set."""

    def capture(state: RouterState) -> state_codec.Capture:
        def steps() -> Iterator[None]:
            for n in itertools.count():
                if n == 3:
                    started.set()
                if failing.is_set():
                    raise RuntimeError("the copy failed")
                yield

        return state_codec.Capture(steps(), state.encoder())

    return capture


async def kv_applies_again(replica: Replica, feeder: Feeder) -> None:
    assert not replica.follower.kv_held
    await feeder.append(3)
    await applied(replica, feeder)
    assert replica.state.digests() == feeder.reference.digests()


@pytest.mark.parametrize("ending", ["failed", "cancelled", "lease lost"])
async def test_the_kv_hold_ends_however_the_capture_ends(
        replica: Replica, feeder: Feeder, monkeypatch: pytest.MonkeyPatch, ending: str) -> None:
    leader = replica.leader
    assert leader is not None
    await feeder.append(20)
    await applied(replica, feeder)
    started, failing = asyncio.Event(), asyncio.Event()
    monkeypatch.setattr(RouterState, "capture", endless_capture(started, failing))
    snapshot = asyncio.create_task(leader.take_snapshot("test"))
    async with asyncio.timeout(30):
        await started.wait()
    assert replica.follower.kv_held
    waits = replica.follower.kv_waits
    await feeder.append(2)
    await until(lambda: replica.follower.kv_waits, lambda n: n > waits, timeout=30,
                what="a KV message waiting for the hold")
    assert replica.state.positions[KV] == feeder.last - 2
    if ending == "failed":
        failing.set()
    elif ending == "cancelled":
        snapshot.cancel()
    elif ending == "lease lost":
        monkeypatch.setattr(leader.lease, "_valid_until", 0.0)  # as after a stalled renewal
    expected = {"failed": RuntimeError, "cancelled": asyncio.CancelledError,
                "lease lost": NoLeader}[ending]
    with pytest.raises(expected):
        async with asyncio.timeout(30):
            await snapshot
    await kv_applies_again(replica, feeder)
    with contextlib.suppress(Exception):
        await leader.lease.renew()
