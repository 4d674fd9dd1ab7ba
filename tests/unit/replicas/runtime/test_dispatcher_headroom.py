"""The dispatcher applying headroom for tenants under their share (replicas/core/tenant_headroom.py)
behind a port with a real RouterState: a flood request that finds only the held engine open
waits, even with nothing queued before it; the victim takes the held engine at once; the hold
lapses by itself when the victim stops being active."""

from __future__ import annotations

import asyncio
import time

import pytest

from eventlog import events as ev
from eventlog.hashing import tokens_hashes
from eventlog.names import KV, ROUTER
from replicas.core.tenant_headroom import ACTIVE_FOR
from replicas.runtime.dispatcher import Dispatcher, RouteRequest
from tests.unit.replicas.runtime.test_dispatcher import TOKENS, Port, _dispatcher
from tests.waiting import until

pytestmark = pytest.mark.timeout(10)


def _fleet(port: Port, victim_ago: float) -> None:
    """Two engines: w0 computing a flood prompt, w1 open; the flood served 50x the victim, whose
    one request was admitted ``victim_ago`` seconds ago and has ended."""
    for seq, worker in enumerate(("w0", "w1"), 1):
        port.state.apply(KV, seq, [ev.WorkerRegistered(worker, f"http://{worker}", "m", 16,
                                                       1000, 8192, 1.0)])
    now = time.time()
    events: list[ev.Event] = [
        ev.RequestRouted("f0", "r2", "w0", 0, 256, [], 0, 8, 0, now, tenant="flood",
                         tenant_tokens=12_000),
        ev.RequestRouted("v0", "r2", "w1", 0, 64, [], 0, 8, 0, now - victim_ago,
                         tenant="victim", tenant_tokens=240),
        ev.RequestFinished("v0", ev.Outcome.OK, 8, now - victim_ago + 0.1)]
    for seq, e in enumerate(events, 1):
        port.state.apply(ROUTER, seq, [e])


def _queued(fraction: float) -> tuple[Port, Dispatcher]:
    port = Port()
    d, _ = _dispatcher(port, queue_threshold=0.01, tenant_fair_queue=True,
                       tenant_headroom=fraction)
    return port, d


def _req(rid: str, tenant: str) -> RouteRequest:
    return RouteRequest(rid, "m", TOKENS, tenant=tenant, tenant_tokens=len(TOKENS) + 8)


async def test_a_flood_request_waits_while_the_only_open_engine_is_held_for_the_victim() -> None:
    port, d = _queued(0.5)
    _fleet(port, victim_ago=0.5)
    flood = asyncio.create_task(d.route(_req("f1", "flood")))
    await until(d.queue_depth, lambda n: n == 1, timeout=5, what="the flood request queued")
    assert not flood.done()
    # The victim's request, queued behind the flood's (nobody overtakes the queue), leaves
    # first, into the held engine.
    d.start()
    try:
        victim = await asyncio.wait_for(d.route(_req("v1", "victim")), 5)
        assert victim.worker_id == "w1"
        assert not flood.done() and d.queue_depth() == 1  # every engine busy now
    finally:
        flood.cancel()
        await d.stop()


async def test_without_headroom_the_flood_takes_the_last_opening() -> None:
    port, d = _queued(0.0)
    _fleet(port, victim_ago=0.5)
    routed = await asyncio.wait_for(d.route(_req("f1", "flood")), 5)
    assert routed.worker_id == "w1"


async def test_the_hold_lapses_when_the_victim_stops_being_active() -> None:
    port, d = _queued(0.5)
    _fleet(port, victim_ago=ACTIVE_FOR - 0.3)  # active for 0.3 s more, then idle
    started = time.monotonic()
    flood = asyncio.create_task(d.route(_req("f1", "flood")))
    await until(d.queue_depth, lambda n: n == 1, timeout=5, what="the flood request queued")
    d.start()  # nothing else happens: the queue wakes up when the hold may lapse
    try:
        routed = await asyncio.wait_for(flood, 5)
        assert routed.worker_id == "w1"
        assert time.monotonic() - started >= 0.2
    finally:
        await d.stop()


async def test_a_flood_request_routed_at_once_keeps_off_the_held_engine() -> None:
    """Three engines, two open: the flood may be routed without queueing, but not to the one
    held for the victim — even though that one holds the flood's prompt in its cache."""
    port, d = _queued(0.5)
    _fleet(port, victim_ago=0.5)
    port.state.apply(KV, 3, [ev.WorkerRegistered("w2", "http://w2", "m", 16, 1000, 8192, 1.0)])
    hashes = tokens_hashes(TOKENS, 16)
    port.state.apply(KV, 4, [ev.BlocksStored("w1", 1, 0, None,
                                             [(i + 1, h) for i, h in enumerate(hashes)], 2.0)])
    routed = await asyncio.wait_for(d.route(_req("f1", "flood")), 5)
    assert routed.worker_id == "w2"
    assert d.queue_depth() == 0
