"""Replica and worker liveness on a real nats-server, with real RouterStates fed from the streams,
a real Appender, and simulated workers as real processes (SIGKILLed, not mocked).

Short timings: heartbeat every 0.25 s, replica/worker timeout 1.5 s. "Exactly one" is checked
after the leaders have run several more rounds past the point where a second declaration could
have happened (counted rounds, never sleeps).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Awaitable, Callable

import nats
import pytest
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from eventlog import events as ev
from eventlog.appender import Appender
from eventlog.names import CONTROL, KV, ROUTER, Names
from eventlog.reader import StreamReader
from eventlog.streams import stream_bounds
from natsops.server import NatsServer
from replicas.core.divergence import Divergence
from replicas.core.state import RouterState
from replicas.runtime.liveness import Heartbeat, Liveness, liveness_subject
from tests.divergence_hook import inject_divergence
from tests.port_stub import PortIdentity
from tests.waiting import until
from workers.procs import WorkerProcess

pytestmark = pytest.mark.timeout(60)

NAMES = Names("jr")
INTERVAL = 0.25
TIMEOUT = 1.5
SLACK = 4.0  # "within timeout + a few seconds"


class Node(PortIdentity):
    """One router replica reduced to what liveness needs (the replica port: its id, a RouterState
    following the KV and router streams, a real Appender), its own connection, and a Liveness."""

    def __init__(self, rid: str, nc: NATS, *, leader: bool,
                 extra_workers: dict[str, str] | None = None) -> None:
        self.rid, self.nc, self.leader = rid, nc, leader
        self.port_names = NAMES
        self.js: JetStreamContext = nc.jetstream()
        self.state = RouterState()
        self.appender = Appender(self.js)
        self.extra_workers = extra_workers or {}  # registered on start, never sending gauges
        self.readers: list[asyncio.Task[None]] = []
        self.divergences: list[Divergence] = []
        self.live = Liveness(
            self, self.js, nc, heartbeat_interval=INTERVAL, replica_timeout=TIMEOUT,
            worker_timeout=TIMEOUT, on_divergence=self.divergences.append)

    async def append(self, subject: str, event: ev.Event, msg_id: str | None) -> int:
        assert subject == liveness_subject(NAMES, event)
        assert msg_id is not None
        return await self.appender.append(subject, [event], msg_id)

    async def wait_ready(self, timeout: float | None = None) -> None:
        return None

    async def wait_applied(self, kind: str, seq: int, timeout: float = 10.0) -> None:
        await until(lambda: self.state.positions[kind] >= seq, timeout=timeout)

    async def _follow(self, kind: str) -> None:
        reader = StreamReader(self.js, NAMES.stream(kind), idle_heartbeat=0.5)
        try:
            async for seq, batch in reader:
                self.state.apply(kind, seq, batch)
        finally:
            await reader.close()

    async def start(self) -> Node:
        for wid, url in self.extra_workers.items():
            await self.appender.append(NAMES.kv_subject(wid), [ev.WorkerRegistered(
                wid, url, "sim", self.state.config.block_size, 1000, 8192, time.time())],
                f"{wid}.registered")
        self.readers = [asyncio.create_task(self._follow(k)) for k in (KV, ROUTER, CONTROL)]
        await self.live.start()
        return self

    async def crash(self) -> None:
        """Heartbeats just stop: no key deletion, nothing appended on the way out."""
        await self.live.stop(delete_key=False)
        for t in self.readers:
            t.cancel()
        for t in self.readers:
            with contextlib.suppress(asyncio.CancelledError):
                await t

    async def route(self, request_id: str, worker_id: str = "w1") -> None:
        event = ev.RequestRouted(request_id, self.rid, worker_id, 0, 64, [1, 2, 3, 4], 0, 16, 0,
                                 time.time())
        await self.appender.append(NAMES.router_subject(self.rid), [event], f"{request_id}.r")


async def stream_events(js: JetStreamContext, kind: str) -> list[ev.Event]:
    """Every event currently in a stream, read back through a fresh reader."""
    _, last = await stream_bounds(js, NAMES.stream(kind))
    out: list[ev.Event] = []
    if last == 0:
        return out
    async with StreamReader(js, NAMES.stream(kind)) as reader:
        async for seq, batch in reader:
            out.extend(batch)
            if seq >= last:
                break
    return out


async def lost(js: JetStreamContext) -> list[str]:
    return [e.replica_id for e in await stream_events(js, ROUTER)
            if isinstance(e, ev.ReplicaLost)]


async def retired(js: JetStreamContext) -> list[str]:
    return [e.worker_id for e in await stream_events(js, KV) if isinstance(e, ev.WorkerRetired)]


async def rounds_pass(nodes: list[Node], n: int) -> None:
    """Wait until every node has completed `n` more heartbeat and worker rounds."""
    hb = {x.rid: x.live.rounds + n for x in nodes}
    wk = {x.rid: x.live.worker_rounds + n for x in nodes}
    await until(lambda: all(x.live.rounds >= hb[x.rid] and x.live.worker_rounds >= wk[x.rid]
                            for x in nodes))


async def test_heartbeats_lost_replica_declared_once_and_comeback_starts_clean(
    js: tuple[NATS, JetStreamContext], nats_url: str,
    nats_connect: Callable[[str], Awaitable[NATS]],
) -> None:
    _, check = js
    # A and C both lead: a hand-over overlap, where both must append the same ReplicaLost once.
    a = await Node("A", await nats_connect(nats_url), leader=True).start()
    b = await Node("B", await nats_connect(nats_url), leader=False).start()
    c = await Node("C", await nats_connect(nats_url), leader=True).start()
    nodes = [a, c]
    try:
        peers = await until(lambda: _peers_are(b, {"A", "C"}))
        assert peers["A"].leader and peers["C"].ready and set(peers["A"].positions) == {
            KV, ROUTER, CONTROL} and "state" in peers["A"].digests
        await until(lambda: _peers_are(a, {"B", "C"}))
        await until(lambda: _peers_are(c, {"A", "B"}))

        await a.route("req-a")
        await b.route("req-b1")
        await b.route("req-b2")
        await until(lambda: all(len(x.state.load) == 3 for x in (a, b, c)))
        await rounds_pass([a, c], 2)
        assert await lost(check) == []  # everyone heartbeating: nobody is lost
        view = {r["replica_id"]: r for r in await a.live.view()}
        assert (view["A"]["owned_requests"], view["B"]["owned_requests"],
                view["C"]["owned_requests"]) == (1, 2, 0)

        await b.crash()
        t0 = time.monotonic()
        # The lost-timer runs from the last heartbeat each leader heard, which on a busy machine
        # can be well before crash() returned: bound the declaration from below by that.
        heard = min(x.live.peers_status["B"].changed_at for x in nodes)
        assert await until(lambda: lost(check), timeout=TIMEOUT + SLACK) == ["B"]
        assert time.monotonic() - heard >= TIMEOUT
        assert time.monotonic() - t0 <= TIMEOUT + SLACK
        # Every replica frees exactly B's requests ...
        await until(lambda: all(set(x.state.load._requests) == {"req-a"} for x in nodes))
        # ... and, with B's load gone, neither leader declares it again.
        await rounds_pass(nodes, 4)
        assert await lost(check) == ["B"]
        assert "B" not in await a.live.peers()
        view = {r["replica_id"]: r for r in await a.live.view()}
        assert view["A"]["self"] and view["C"]["live"] and not view["C"]["divergent"]
        assert not view["B"]["live"] and view["B"]["age_s"] > TIMEOUT  # type: ignore[operator]
        assert view["B"]["owned_requests"] == 0  # its requests were freed with the declaration
        # one or both leaders appended it (whoever applied the other's first had nothing left)
        assert 1 <= a.live.declared_lost.count("B") + c.live.declared_lost.count("B") <= 2

        # B comes back under the same id: it starts clean and is not declared for the old lapse.
        b2 = await Node("B", await nats_connect(nats_url), leader=False).start()
        await until(lambda: _peers_are(a, {"B", "C"}))
        await b2.route("req-b3")
        await until(lambda: all("req-b3" in x.state.load._requests for x in nodes))
        await rounds_pass(nodes, int(TIMEOUT / INTERVAL) + 2)  # longer than a timeout
        assert await lost(check) == ["B"]
        assert all("req-b3" in x.state.load._requests for x in nodes)

        # A new lapse of the returned B is a new declaration.
        await b2.crash()
        await until(lambda: _count(lost(check), 2), timeout=TIMEOUT + SLACK)
        await until(lambda: all(set(x.state.load._requests) == {"req-a"} for x in nodes))
        await rounds_pass(nodes, 4)
        assert await lost(check) == ["B", "B"]
    finally:
        for x in (a, c):
            await x.crash()


async def test_only_the_leader_declares_and_a_new_leader_uses_what_it_watched(
    js: tuple[NATS, JetStreamContext], nats_url: str,
    nats_connect: Callable[[str], Awaitable[NATS]],
) -> None:
    _, check = js
    a = await Node("A", await nats_connect(nats_url), leader=False).start()
    b = await Node("B", await nats_connect(nats_url), leader=False).start()
    try:
        await until(lambda: _peers_are(a, {"B"}))
        await b.route("req-b")
        await until(lambda: len(a.state.load) == 1)
        await b.crash()
        # Well past the timeout, nobody leads: nothing is declared.
        await until(lambda: a.live.peers_status["B"].age(time.monotonic()) > TIMEOUT + 0.5)
        await rounds_pass([a], 2)
        assert await lost(check) == []
        # A takes the lease: it has timed B's lapse all along, so it declares at once.
        a.leader = True
        t0 = time.monotonic()
        await until(lambda: lost(check), timeout=SLACK)
        assert time.monotonic() - t0 < 1.0 + 2 * INTERVAL
        assert await lost(check) == ["B"]
    finally:
        await a.crash()


async def test_an_injected_divergence_is_detected_by_both_sides(
    js: tuple[NATS, JetStreamContext], nats_url: str,
    nats_connect: Callable[[str], Awaitable[NATS]],
) -> None:
    a = await Node("A", await nats_connect(nats_url), leader=True).start()
    b = await Node("B", await nats_connect(nats_url), leader=False).start()
    try:
        await b.route("req-b")  # some shared state, then quiet streams: equal positions
        await until(lambda: all(len(x.state.load) == 1 for x in (a, b)))
        await until(lambda: _peers_are(a, {"B"}))
        await rounds_pass([a, b], 2)
        assert a.divergences == b.divergences == []  # equal positions, equal digests

        inject_divergence(b.state, "index")
        await until(lambda: a.divergences and b.divergences)
        d = a.divergences[0]
        assert (d.peer_id, d.parts) == ("B", ("index",))
        assert d.theirs == b.state.digests() and d.mine == a.state.digests()
        assert b.divergences[0].peer_id == "A"
        view = {r["replica_id"]: r for r in await a.live.view()}
        assert view["B"]["divergent"] and not view["A"]["divergent"]
        await rounds_pass([a, b], 3)
        assert len(a.divergences) == 1 and a.live.divergence.total == 1  # counted once
    finally:
        await a.crash()
        await b.crash()


async def test_a_nats_outage_longer_than_the_timeout_declares_nobody(
    js: tuple[NATS, JetStreamContext], nats_server: NatsServer,
    nats_connect: Callable[[str], Awaitable[NATS]],
) -> None:
    """Nobody's heartbeats got through while NATS was down, so nobody's lapse can be judged
    across the outage. B reconnects slowly (1 s between attempts) while the leader A is back at
    once: without restarting its timers A would see B's entry unchanged for longer than the
    timeout and declare it lost."""
    _, check = js
    a = await Node("A", await nats_connect(nats_server.url), leader=True).start()
    slow = await nats.connect(nats_server.url, reconnect_time_wait=1.0,
                              max_reconnect_attempts=-1, connect_timeout=2)
    b = await Node("B", slow, leader=False).start()
    try:
        await until(lambda: _peers_are(a, {"B"}))
        await b.route("req-b")
        await until(lambda: len(a.state.load) == 1)
        await nats_server.astop()
        t0 = time.monotonic()
        await until(lambda: time.monotonic() - t0 > TIMEOUT + 0.5)  # an outage past the timeout
        await nats_server.astart()
        await until(lambda: _peers_are(a, {"B"}), timeout=10)
        await rounds_pass([a], int(TIMEOUT / INTERVAL) + 2)
        assert await lost(check) == []
        assert "req-b" in a.state.load._requests
    finally:
        await b.crash()
        await a.crash()
        await slow.close()


async def test_killed_worker_is_retired_and_healthy_ones_never(
    js: tuple[NATS, JetStreamContext], nats_server: NatsServer,
    nats_connect: Callable[[str], Awaitable[NATS]],
) -> None:
    _, check = js
    args = ["--nats-url", nats_server.url, "--namespace", "jr"]
    w1 = WorkerProcess([*args, "--worker-id", "w1"])
    w2 = WorkerProcess([*args, "--worker-id", "w2"])
    w3 = WorkerProcess([*args, "--worker-id", "w3"])
    await asyncio.gather(*(asyncio.to_thread(w.start) for w in (w1, w2, w3)))
    a: Node | None = None
    try:
        # "w-quiet" is known but never sends gauges (as if its NATS link were broken), while
        # its /health (w2's server) answers: it must never be retired.
        a = await Node("A", await nats_connect(nats_server.url), leader=True,
                       extra_workers={"w-quiet": w2.url}).start()
        await until(lambda: {"w1", "w2", "w3"} <= set(a.state.workers))
        await until(lambda: {"w1", "w2", "w3"} <= set(a.live._gauges))  # gauges flowing

        w1.kill()  # SIGKILL: /health refuses connections
        t0 = time.monotonic()
        assert await until(lambda: retired(check), timeout=TIMEOUT + SLACK) == ["w1"]
        assert time.monotonic() - t0 <= TIMEOUT + SLACK
        await until(lambda: "w1" not in a.state.workers)  # applied: its blocks leave the index

        assert w3.proc is not None
        w3.proc.send_signal(signal.SIGSTOP)  # hung: /health accepts but never answers
        t0 = time.monotonic()
        await until(lambda: _count(retired(check), 2), timeout=TIMEOUT + SLACK)
        assert time.monotonic() - t0 <= TIMEOUT + SLACK
        assert await retired(check) == ["w1", "w3"]

        # w-quiet has been silent longer than the timeout and was health-checked (and spared).
        await until(lambda: a.live.workers_status["w-quiet"].warned_nats_only)
        await rounds_pass([a], int(TIMEOUT / INTERVAL) + 2)
        assert await retired(check) == ["w1", "w3"]
        await until(lambda: set(a.state.workers) == {"w2", "w-quiet"})
        assert a.live.retired == ["w1", "w3"]
    finally:
        if a is not None:
            await a.crash()
        if w3.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                w3.proc.send_signal(signal.SIGCONT)
        for w in (w1, w2, w3):
            w.kill()


async def _peers_are(node: Node, expected: set[str]) -> dict[str, Heartbeat] | None:
    peers = await node.live.peers()
    return peers if set(peers) == expected else None


async def _count(values: Awaitable[list[str]], n: int) -> bool:
    return len(await values) >= n
