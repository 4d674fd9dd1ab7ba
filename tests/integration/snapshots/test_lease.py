"""LeaderLease against real nats-servers: one holder at a time, takeover on expiry and release,
CAS loss, resuming our own lease, NATS outages, and a 3-node cluster."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from nats.js import JetStreamContext

from eventlog.names import Names
from natsops.server import NatsCluster, NatsServer
from snapshots.lease import LeaderLease

NAMES = Names("jr")
TTL = 3.0  # long enough that a loaded machine does not outlive a lease between two steps
SLACK = 3.0  # seconds of slack on top of the TTL: these machines are shared and busy

Connect = Callable[[str], Awaitable[object]]


async def wait_for(condition: Callable[[], bool], timeout: float, what: str,
                   check: Callable[[], None] | None = None) -> float:
    """Poll ``condition`` until true; returns the seconds it took. ``check`` runs at every poll
    (e.g. 'never two leaders')."""
    start = time.monotonic()
    while True:
        if check is not None:
            check()
        if condition():
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{what}: not within {timeout:.2f}s")
        await asyncio.sleep(0.02)


def at_most_one_leader(leases: list[LeaderLease]) -> None:
    holders = [lease.holder for lease in leases if lease.is_leader]
    assert len(holders) <= 1, f"two leaders at once: {holders}"


def leaders(leases: list[LeaderLease]) -> list[str]:
    return [lease.holder for lease in leases if lease.is_leader]


class Running:
    """Leases with their ``run`` loops, recording every on_change call."""

    def __init__(self, leases: list[LeaderLease]) -> None:
        self.leases = leases
        self.changes: list[tuple[str, bool]] = []
        self.tasks: dict[str, asyncio.Task[None]] = {}

    def start(self, lease: LeaderLease) -> None:
        async def on_change(leader: bool, holder: str = lease.holder) -> None:
            self.changes.append((holder, leader))

        self.tasks[lease.holder] = asyncio.create_task(lease.run(on_change))

    async def stop(self, lease: LeaderLease) -> None:
        await lease.stop()
        await asyncio.wait_for(self.tasks.pop(lease.holder), timeout=5)

    async def close(self) -> None:
        for lease in self.leases:
            await lease.stop()
        for task in self.tasks.values():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


@pytest.fixture
async def contenders(js: tuple[object, JetStreamContext], nats_connect: Connect
                     ) -> list[LeaderLease]:
    """Three leases, each on its own connection, as three replicas would be."""
    leases = [LeaderLease(js[1], NAMES, "r0", ttl=TTL)]
    for holder in ("r1", "r2"):
        nc = await nats_connect(js[0].connected_url.geturl())  # type: ignore[attr-defined]
        leases.append(LeaderLease(nc.jetstream(), NAMES, holder, ttl=TTL))  # type: ignore[attr-defined]
    return leases


@pytest.fixture
async def running(contenders: list[LeaderLease]) -> AsyncIterator[Running]:
    r = Running(contenders)
    yield r
    await r.close()


async def test_racing_acquires_have_exactly_one_winner(contenders: list[LeaderLease]) -> None:
    for round_ in range(3):
        results = await asyncio.gather(*(lease.try_acquire() for lease in contenders))
        assert sum(results) == 1, results
        winner = contenders[results.index(True)]
        assert leaders(contenders) == [winner.holder]
        assert await contenders[0].current() == winner.holder
        # Losers keep losing while the winner holds it; the winner renews.
        assert await winner.renew() is True
        for lease in contenders:
            if lease is not winner:
                assert await lease.try_acquire() is False
        await winner.release()
        assert await contenders[0].current() is None, round_


async def test_expired_lease_is_taken_and_old_holder_cannot_renew(
        contenders: list[LeaderLease]) -> None:
    old, new = contenders[0], contenders[1]
    assert await old.try_acquire()
    # Nobody renews: the server expires the key after the TTL, and our own view gave up first.
    await wait_for(lambda: not old.is_leader, TTL, "old holder steps down by its own deadline")
    deadline = time.monotonic() + TTL * 3
    while not await new.try_acquire():
        assert time.monotonic() < deadline, "key never expired"
        await asyncio.sleep(0.05)
    assert await old.renew() is False  # CAS on a revision that is gone
    assert not old.is_leader and new.is_leader
    assert await new.current() == "r1"
    await old.release()  # not ours: must not delete the new holder's key
    assert await new.current() == "r1"


async def test_same_holder_resumes_its_lease(js: tuple[object, JetStreamContext]) -> None:
    """A replica restarted under the same id takes its lease back at once (holder ids must be
    unique per live process: two live objects with one id would share the lease)."""
    first = LeaderLease(js[1], NAMES, "r0", ttl=TTL)
    assert await first.try_acquire()
    before = first.revision
    await first.stop()  # the old process is gone (its key stays until the TTL)
    again = LeaderLease(js[1], NAMES, "r0", ttl=TTL)  # the same replica, restarted
    assert await again.try_acquire() is True
    assert again.revision is not None and before is not None and again.revision > before
    assert await LeaderLease(js[1], NAMES, "r9", ttl=TTL).try_acquire() is False


async def test_renew_after_a_lost_answer_keeps_the_lease(contenders: list[LeaderLease]) -> None:
    lease = contenders[0]
    assert await lease.try_acquire()
    real = lease.revision
    assert real is not None
    lease._revision = real - 1  # as if our last update was applied but its answer lost
    assert await lease.renew() is True
    assert lease.revision is not None and lease.revision > real
    assert await contenders[1].try_acquire() is False


async def test_loop_elects_one_and_takes_over_when_holder_stops(running: Running) -> None:
    leases = running.leases
    for lease in leases:
        running.start(lease)
    await wait_for(lambda: len(leaders(leases)) == 1, 3 * TTL, "a leader is elected",
                   check=lambda: at_most_one_leader(leases))
    first = next(lease for lease in leases if lease.is_leader)
    # Renewals keep the same holder across several TTLs.
    hold_until = time.monotonic() + 2.5 * TTL
    await wait_for(lambda: time.monotonic() > hold_until, 3 * TTL, "holding",
                   check=lambda: (at_most_one_leader(leases),
                                  assert_leader(leases, first.holder)))

    await running.stop(first)  # stopped without release: the key must expire
    assert not first.is_leader
    took = await wait_for(lambda: len(leaders(leases)) == 1, TTL + TTL / 3 + SLACK,
                          "takeover after the holder stopped",
                          check=lambda: at_most_one_leader(leases))
    second = next(lease for lease in leases if lease.is_leader)
    assert second is not first
    print(f"takeover after stop: {took:.2f}s (ttl {TTL}s)")
    assert running.changes[0] == (first.holder, True)
    assert (first.holder, False) in running.changes  # the stop reported the step-down
    # ``is_leader`` turns true inside the acquire; the run loop reports it after that call
    # returns, which a busy machine can delay past the poll that saw the new leader.
    await wait_for(lambda: running.changes[-1] == (second.holder, True), SLACK,
                   "the new holder's on_change(True)")


def assert_leader(leases: list[LeaderLease], holder: str) -> None:
    assert leaders(leases) == [holder]


async def test_release_hands_over_before_the_ttl(js: tuple[object, JetStreamContext],
                                                 nats_connect: Connect) -> None:
    ttl = 3.0  # long enough that a takeover well under it cannot be an expiry
    leases = []
    for holder in ("a", "b"):
        nc = await nats_connect(js[0].connected_url.geturl())  # type: ignore[attr-defined]
        leases.append(LeaderLease(nc.jetstream(), Names("rel"), holder, ttl=ttl))  # type: ignore[attr-defined]
    running = Running(leases)
    try:
        running.start(leases[0])
        await wait_for(lambda: leases[0].is_leader, ttl, "a leads")
        running.start(leases[1])
        assert await leases[1].try_acquire() is False  # a holds it; b's loop keeps trying
        await leases[0].release()
        # Well under b's ttl/3 pacing: b saw the release on the key's subject and woke up.
        took = await wait_for(lambda: leases[1].is_leader, ttl * 0.25, "b takes over",
                              check=lambda: at_most_one_leader(leases))
        print(f"takeover after release: {took:.2f}s (ttl {ttl}s)")
        assert await leases[1].current() == "b"
        assert running.changes.count(("a", False)) == 1
    finally:
        await running.close()


async def test_stop_then_release_frees_the_key(running: Running) -> None:
    """A graceful shutdown (stop the loop, then release) must still delete the key."""
    holder, other = running.leases[0], running.leases[1]
    running.start(holder)
    await wait_for(lambda: holder.is_leader, 3 * TTL, "holder leads")
    await running.stop(holder)
    assert await holder.current() == holder.holder  # stopped, not released: key still there
    await holder.release()
    assert await holder.current() is None
    assert await other.try_acquire() is True
    assert running.changes == [(holder.holder, True), (holder.holder, False)]


async def test_outage_longer_than_ttl_steps_down_then_recovers(
        nats_server: NatsServer, nats_connect: Connect) -> None:
    leases = []
    for holder in ("a", "b"):
        nc = await nats_connect(nats_server.url)
        leases.append(LeaderLease(nc.jetstream(), NAMES, holder, ttl=TTL))  # type: ignore[attr-defined]
    running = Running(leases)
    try:
        for lease in leases:
            running.start(lease)
        await wait_for(lambda: len(leaders(leases)) == 1, 3 * TTL, "a leader is elected")
        await nats_server.astop()
        took = await wait_for(lambda: not leaders(leases), TTL + 0.5, "step down in the outage")
        print(f"stepped down {took:.2f}s into the outage")
        # The loop reports it too (at its next round, ttl/3 later at most).
        await wait_for(lambda: any(not leader for _, leader in running.changes), TTL,
                       "on_change(False) during the outage")
        await nats_server.astart()
        await wait_for(lambda: len(leaders(leases)) == 1, 10.0, "re-elected after reconnect",
                       check=lambda: at_most_one_leader(leases))
    finally:
        await running.close()


async def test_bucket_ttl_wins_over_a_different_configured_ttl(
        js: tuple[object, JetStreamContext]) -> None:
    short = LeaderLease(js[1], NAMES, "a", ttl=TTL)
    assert await short.try_acquire()
    other = LeaderLease(js[1], NAMES, "b", ttl=5.0)
    assert await other.try_acquire() is False
    assert other.ttl == pytest.approx(TTL)  # it times its renewals by the server's expiry


async def test_cluster_takeover(nats_cluster: NatsCluster, nats_connect: Connect) -> None:
    leases = []
    for i, holder in enumerate(("a", "b", "c")):
        nc = await nats_connect(nats_cluster[i].url)  # each replica on a different server
        leases.append(LeaderLease(nc.jetstream(), Names("cl"), holder, ttl=TTL))  # type: ignore[attr-defined]
    running = Running(leases)
    try:
        for lease in leases:
            running.start(lease)
        await wait_for(lambda: len(leaders(leases)) == 1, 10.0, "a leader is elected",
                       check=lambda: at_most_one_leader(leases))
        first = next(lease for lease in leases if lease.is_leader)
        await running.stop(first)
        took = await wait_for(lambda: len(leaders(leases)) == 1, TTL + TTL / 3 + 2 * SLACK,
                              "takeover in the cluster",
                              check=lambda: at_most_one_leader(leases))
        print(f"cluster takeover: {took:.2f}s (ttl {TTL}s)")
        assert next(lease for lease in leases if lease.is_leader) is not first
        info = await leases[1].js.stream_info("KV_cl-leases")
        assert info.config.num_replicas == 3
    finally:
        await running.close()
