"""Liveness across the loss of one NATS server of three: heartbeats must not stall behind it.

Three replicas' liveness, each connected first to a different server of a real 3-node cluster.
The server leading the heartbeat bucket's stream is SIGKILLed; for many rounds afterwards every
replica keeps judging both peers live (``peers()``, read as often as an operator's admin view may
be), and the leader declares nobody lost (every replica pretends to own requests, so a lapse
would be declared).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import nats
import pytest
from nats.aio.client import Client as NATS

from eventlog import events as ev
from eventlog.names import ROUTER, Names
from natsops.server import NatsCluster, NatsServer
from replicas.core.state import RouterState
from replicas.runtime.liveness import Liveness, PeerStatus
from tests.port_stub import PortIdentity
from tests.waiting import until

pytestmark = pytest.mark.timeout(120)

NAMES = Names("jr")
INTERVAL = 0.25
TIMEOUT = 3.0
IDS = ("A", "B", "C")


class Replica(PortIdentity):
    """The replica port liveness needs: a RouterState in which every replica owns one request,
    appends recorded instead of written."""

    def __init__(self, rid: str, nc: NATS, leader: bool) -> None:
        self.rid, self.nc, self.leader = rid, nc, leader
        self.port_names = NAMES
        self.declared: list[str] = []
        self.state = RouterState()
        self.state.apply(ROUTER, 1, [
            ev.RequestRouted(f"q-{owner}", owner, "w1", 0, 64, [1, 2, 3, 4], 0, 16, 0, 1.0)
            for owner in IDS])
        self.live = Liveness(self, nc.jetstream(), nc, heartbeat_interval=INTERVAL,
                             replica_timeout=TIMEOUT, worker_timeout=TIMEOUT)

    async def append(self, subject: str, event: ev.Event, msg_id: str | None) -> int:
        # What the leader would append to the router stream: recorded, it is the output here.
        self.declared.append(getattr(event, "replica_id", "?"))
        return 0

    async def wait_ready(self, timeout: float | None = None) -> None:
        return None

    async def wait_applied(self, kind: str, seq: int, timeout: float = 10.0) -> None:
        return None

    def peer_ages(self) -> dict[str, float]:
        now = time.monotonic()
        return {r: round(p.age(now), 2) for r, p in self.live.peers_status.items()
                if r != self.rid}


@pytest.fixture
async def replicas(nats_cluster: NatsCluster) -> AsyncIterator[list[Replica]]:
    urls = nats_cluster.urls
    out: list[Replica] = []
    try:
        for k, rid in enumerate(IDS):
            # Each replica starts on a different server; the rest of the list is its fail-over.
            nc = await nats.connect(servers=urls[k:] + urls[:k], dont_randomize=True,
                                    reconnect_time_wait=0.2, max_reconnect_attempts=-1,
                                    connect_timeout=2)
            rep = Replica(rid, nc, leader=(rid == "A"))
            await rep.live.start()
            out.append(rep)
        yield out
    finally:
        for rep in out:
            with contextlib.suppress(Exception):
                await rep.live.stop(delete_key=False)
            await rep.nc.close()


async def test_a_dead_nats_server_makes_no_live_peer_look_stale(
        nats_cluster: NatsCluster, replicas: list[Replica]) -> None:
    for rep in replicas:
        others = set(IDS) - {rep.rid}
        await until(rep.live.peers, lambda p, others=others: set(p) == others,
                    timeout=30, what=f"{rep.rid} sees both peers")
    info = await replicas[0].nc.jetstream().stream_info(f"KV_{NAMES.replicas_bucket}")
    leader = info.cluster.leader if info.cluster else None
    victim = next(s for s in nats_cluster.servers if s.server_name == leader)

    # Each replica's own judgement, not the wall-clock age of a peer's last heartbeat: this
    # process may be starved for seconds on a busy machine, and on waking it reads the clock
    # before the heartbeats queued in its sockets (a 3.4 s "age" with every peer alive). The
    # replica discounts such a stall of its own (liveness.py `_refresh`); a heartbeat that
    # really stalls behind the dead server's stream leader election (4-9 s) is judged stale.
    stale: list[tuple[str, list[str], dict[str, float]]] = []
    stop = asyncio.Event()

    async def sample() -> None:
        while not stop.is_set():
            for rep in replicas:
                live = set(await rep.live.peers())
                if live != set(IDS) - {rep.rid}:
                    stale.append((rep.rid, sorted(live), rep.peer_ages()))
            await asyncio.sleep(0.02)  # sampling period of the observation, not a sync

    sampler = asyncio.create_task(sample())
    rounds = {rep.rid: rep.live.rounds for rep in replicas}
    await asyncio.to_thread(victim.kill)
    try:
        # Long past a stream leader election (4-9 s) and twice the timeout: counted rounds.
        need = int(12.0 / INTERVAL)
        await until(lambda: all(rep.live.rounds >= rounds[rep.rid] + need for rep in replicas),
                    timeout=90, what=f"{need} heartbeat rounds on every replica after the kill")
    finally:
        stop.set()
        await sampler
    assert not stale, (f"a live peer was judged stale ((replica, peers it judged live, ages) "
                       f"{stale[:5]}, killed {victim.server_name})")
    assert [r.declared for r in replicas] == [[], [], []]
    for rep in replicas:
        assert set(await rep.live.peers()) == set(IDS) - {rep.rid}


async def test_liveness_started_while_jetstream_has_no_quorum_binds_once_it_is_back(
        nats_cluster: NatsCluster) -> None:
    """A replica starting into a cluster that cannot answer JetStream yet (two of three servers
    down: no meta leader) keeps asking instead of exiting, and starts once they are back."""
    survivor = nats_cluster.urls[0]
    nats_cluster.kill(1)
    nats_cluster.kill(2)
    nc = await nats.connect(servers=[survivor], reconnect_time_wait=0.2,
                            max_reconnect_attempts=-1, connect_timeout=2)
    rep = Replica("A", nc, leader=False)
    try:
        starting = asyncio.create_task(rep.live.start())
        # The first bind attempts fail while quorum is gone: the start is still pending.
        await until(lambda: rep.live._kv is None and not starting.done(), timeout=10)
        await asyncio.to_thread(nats_cluster.restart, 1)
        await asyncio.to_thread(nats_cluster.restart, 2)
        await asyncio.wait_for(starting, 60)
        kv = rep.live._kv
        assert kv is not None
        await until(lambda: kv.get("A"), lambda entry: bool(entry.value), timeout=30,
                    what="its heartbeat in the bucket", tolerate=(Exception,))
    finally:
        await rep.live.stop()
        await nc.close()


async def test_a_stalled_leader_does_not_count_the_stall_toward_a_peer_silence(
        nats_server: NatsServer) -> None:
    """The leader's loop stalls for less than its blind-spell threshold while a live peer is
    already late (its heartbeats queued, unread): the stall does not push the peer past the
    timeout, and a peer that stays silent is still declared once it has been silent for a
    full timeout of observed time. Rounds are driven by hand on an injected clock."""
    now = [100.0]
    nc = await nats.connect(nats_server.url, connect_timeout=2)
    try:
        leader = Replica("A", nc, leader=True)
        leader.live = Liveness(leader, nc.jetstream(), nc, heartbeat_interval=INTERVAL,
                               replica_timeout=TIMEOUT, worker_timeout=TIMEOUT,
                               clock=lambda: now[0])
        live = leader.live
        live.peers_status["B"] = PeerStatus("B", 1, now[0], None, mark="b.1")

        async def round_at(t: float) -> None:
            now[0] = t
            await live.peers()
            await live._declare_lost_replicas()

        t = now[0]
        for _ in range(8):  # B heard at 100.0, then silent: 2.0 s of observed silence so far
            t += INTERVAL
            await round_at(t)
        assert leader.declared == []
        # Our loop stalls for 1.2 s (with the round's own interval, under half the timeout: not
        # a blind spell) and wakes up with B's heartbeats unread: 3.45 s since B was heard, but
        # B's silence counts only the 2.25 s we observed.
        t += INTERVAL + 1.2
        await round_at(t)
        assert leader.declared == []
        while t < 100.0 + TIMEOUT + 1.2 + INTERVAL:  # B stays silent: declared in the end
            t += INTERVAL
            await round_at(t)
        assert "B" in leader.declared
    finally:
        await nc.close()
