"""Snapshots, restore, purge, reset and the admin API, with replicas as real processes killed
with SIGKILL (design.md §8)."""

from __future__ import annotations

import asyncio
import inspect
import itertools
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import nats
import pytest
import pytest_asyncio

from eventlog.events import SnapshotTaken
from eventlog.names import CONTROL, Names
from eventlog.reader import StartPurged, StreamReader
from eventlog.streams import stream_bounds
from launch.local_cluster import LocalCluster
from snapshots.store import SnapshotStore
from tests.chaos.conftest import MODEL, Admin, Load, running, until

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(180)]
REPLICAS = ["r0", "r1", "r2"]


@pytest_asyncio.fixture
async def cluster(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[LocalCluster]:
    threshold = getattr(request, "param", 1_000_000)
    ns = "d" + request.node.name.split("[")[0][-12:].replace("_", "")
    async with LocalCluster(
            replicas=3, workers=2, data_dir=tmp_path, namespace=ns,
            router_args=["--router-snapshot-threshold", str(threshold), "--lease-ttl", "2"],
            worker_args=["--num-gpu-blocks", "1024"]) as c:
        yield c


@pytest_asyncio.fixture
async def admin(cluster: LocalCluster) -> AsyncIterator[Admin]:
    async with httpx.AsyncClient() as h:
        a = Admin(cluster, h)
        for name in REPLICAS:  # every replica sees both workers
            await until(lambda name=name: a.get(name, "/admin/workers"),
                        lambda w: len(w["workers"]) == 2, what=f"{name} sees workers")
        await until(lambda: a.states(REPLICAS),
                    lambda s: sum(x["leader"] for x in s.values()) == 1, what="one leader")
        yield a


async def leader_of(admin: Admin) -> str:
    states = await admin.states([n for n in REPLICAS if admin.c.children[n].running])
    leaders = [n for n, s in states.items() if s["leader"]]
    assert len(leaders) == 1, states
    return leaders[0]


def assert_equal_digests(states: dict[str, dict]) -> None:
    digests = {n: s["digests"]["state"] for n, s in states.items()}
    assert len(set(digests.values())) == 1, digests


async def snapshot_events(cluster: LocalCluster) -> list[SnapshotTaken]:
    """The SnapshotTaken events the control stream still holds (older ones are purged)."""
    nc = await nats.connect(cluster.nats_url)
    try:
        js = nc.jetstream()
        stream = Names(cluster.namespace).stream(CONTROL)
        for _ in range(5):  # the leader may purge between reading the bounds and reading
            first, last = await stream_bounds(js, stream)
            found: list[SnapshotTaken] = []
            if last == 0 or first > last:
                return found
            reader = StreamReader(js, stream, start_seq=max(first, 1))
            try:
                async for seq, batch in reader:
                    found.extend(e for e in batch if isinstance(e, SnapshotTaken))
                    if seq >= last:
                        return found
            except StartPurged:
                continue
            finally:
                await reader.close()
        return []
    finally:
        await nc.close()


async def test_replica_killed_under_load_restarts_ready_and_equal(
        cluster: LocalCluster, admin: Admin) -> None:
    load = Load([cluster.children[n].url for n in ("r0", "r1")])
    async with running(load, admin.h, max_requests=400):
        await until(lambda: asyncio.sleep(0, load.ok), lambda n: n >= 40, what="traffic")
        old = cluster.kill("r2", signal.SIGKILL)
        await until(lambda: asyncio.sleep(0, cluster.children["r2"].pid),
                    lambda p: p not in (None, old), what="r2 restarted")
        await until(lambda: admin.h.get(admin.url("r2") + "/ready"),
                    lambda r: r.status_code == 200, what="r2 ready")
    assert load.failed == 0, load.errors[:5]
    assert_equal_digests(await admin.converged(REPLICAS))


async def test_stopped_replica_finds_its_position_purged_and_loads_the_snapshot(
        cluster: LocalCluster, admin: Admin) -> None:
    leader = await leader_of(admin)
    victim = next(n for n in REPLICAS if n != leader)  # pause a follower, not the lease holder
    others = [n for n in REPLICAS if n != victim]
    load = Load([admin.url(n) for n in others])
    await load.run(admin.h, max_requests=60)
    assert load.ok == 60, load.errors[:5]
    before = (await admin.converged(REPLICAS))[victim]["positions"]
    pid = cluster.kill(victim, signal.SIGSTOP)  # paused: its position stays where it is
    router = Names(cluster.namespace).stream("router")

    async def router_bounds() -> tuple[int, int]:
        nc = await nats.connect(cluster.nats_url)
        try:
            return await stream_bounds(nc.jetstream(), router)
        finally:
            await nc.close()

    # The paused process may already hold one pull window of messages in its socket (a reader
    # asks for 256 at a time, and group commit packs many events per message): the purge must
    # reach past that window, or the paused replica just carries on without needing a snapshot.
    window = inspect.signature(StreamReader).parameters["batch"].default
    try:
        for _ in range(2):  # purge goes up to the previous snapshot: take two, with traffic
            await Load([admin.url(n) for n in others]).run(admin.h, max_requests=40)
            while (await router_bounds())[1] <= before["router"] + window + 1:
                await Load([admin.url(n) for n in others]).run(admin.h, max_requests=40)
            await admin.post(leader, "/admin/snapshot")
        first, _ = await router_bounds()
        assert first > before["router"] + window + 1, "messages past the pull window purged"
    finally:
        os.killpg(pid, signal.SIGCONT)  # the group, as it was stopped
    states = await admin.converged(REPLICAS, timeout=60)
    assert_equal_digests(states)
    assert states[victim]["restores"] >= 1, states[victim]  # it reloaded from the snapshot


async def test_corrupt_newest_blob_falls_back_to_previous_and_ends_equal(
        cluster: LocalCluster, admin: Admin) -> None:
    leader = await leader_of(admin)
    for _ in range(2):
        await Load([admin.url("r0")]).run(admin.h, max_requests=30)
        await admin.post(leader, "/admin/snapshot")
    nc = await nats.connect(cluster.nats_url)
    try:
        store = SnapshotStore(nc.jetstream(), Names(cluster.namespace))
        metas = await store.list()
        assert len(metas) >= 2
        await corrupt(nc, Names(cluster.namespace), metas[0].snapshot_id)
    finally:
        await nc.close()
    victim = next(n for n in REPLICAS if n != leader)
    old = cluster.kill(victim, signal.SIGKILL)
    await until(lambda: asyncio.sleep(0, cluster.children[victim].pid),
                lambda p: p not in (None, old), what="restarted")
    states = await admin.converged(REPLICAS, timeout=60)
    assert_equal_digests(states)
    log = Path(cluster.children[victim].log_path).read_text()
    assert "corrupt" in log.lower(), "the fallback is loud"


async def corrupt(nc: nats.NATS, names: Names, snapshot_id: str) -> None:
    """Overwrite a blob's bytes, keeping its name and metadata (test-only)."""
    from tests.integration.snapshots.test_snapshot_store import corrupt_blob

    await corrupt_blob(nc.jetstream(), names, snapshot_id)


@pytest.mark.parametrize("cluster", [40], indirect=True)
async def test_snapshots_follow_the_threshold_by_the_leader_and_survive_its_death(
        cluster: LocalCluster, admin: Admin) -> None:
    leader = await leader_of(admin)
    seen: dict[str, SnapshotTaken] = {}

    async def new_snapshot() -> list[SnapshotTaken]:
        # Old SnapshotTaken events are purged with the control stream: collect as we go.
        for s in await snapshot_events(cluster):
            seen.setdefault(s.snapshot_id, s)
        return list(seen.values())

    for burst in range(3):  # each burst appends ~60 messages: past the threshold of 40
        before = len(seen)
        await Load([admin.url(n) for n in REPLICAS]).run(admin.h, max_requests=20)
        await until(new_snapshot, lambda s, b=before: len(s) > b, what=f"snapshot {burst}")
    snaps = sorted(seen.values(), key=lambda s: s.positions["router"])
    assert {s.created_by for s in snaps} == {leader}  # only the lease holder snapshots
    marks = [s.positions["kv"] + s.positions["router"] for s in snaps]
    # One snapshot per crossing: never two for the same messages (three racing replicas).
    assert all(b - a > 40 for a, b in itertools.pairwise(marks)), marks
    killed_at = time.monotonic()
    cluster.kill(leader, signal.SIGKILL)
    # The lease moves within its TTL (2 s here) to a live process — maybe the restarted one.
    new = await until(lambda: admin.states(REPLICAS),
                      lambda s: sum(x["leader"] for x in s.values()) == 1,
                      timeout=60, what="lease moved")
    # Within the TTL plus the restart and a few rounds; generous: the machine may be loaded.
    assert time.monotonic() - killed_at < 2 + 58
    new_leader = next(n for n, s in new.items() if s["leader"])
    known = set(seen)
    await Load([admin.url(n) for n in REPLICAS]).run(admin.h, max_requests=30)
    snaps2 = await until(new_snapshot, lambda s: any(x.snapshot_id not in known for x in s),
                         what="snapshots continue")
    assert {x.created_by for x in snaps2 if x.snapshot_id not in known} == {new_leader}


async def test_reset_via_one_replica_new_epoch_everywhere_engines_reannounce(
        cluster: LocalCluster, admin: Admin) -> None:
    prefix = list(range(3000, 3000 + 16 * 20))
    r = await admin.h.post(admin.url("r0") + "/v1/completions",
                           json={"model": MODEL, "prompt": [*prefix, 1], "max_tokens": 2})
    home = r.headers["x-jetrouter-worker"]
    before = await admin.converged(REPLICAS)
    epoch = before["r0"]["epoch"]
    answer = await admin.post("r1", "/admin/reset")
    assert answer["epoch"] == epoch + 1
    states = await until(lambda: admin.states(REPLICAS),
                         lambda s: all(x["epoch"] == epoch + 1 for x in s.values()),
                         what="new epoch everywhere")
    # Engines re-announce: the cached prefix is known again on every replica.
    for n in REPLICAS:
        await until(lambda n=n: admin.get(n, "/admin/workers"),
                    lambda w: any(x["worker_id"] == home and x["cached_blocks"] >= 20
                                  for x in w["workers"]), what=f"{n} re-learned caches")
    states = await admin.converged(REPLICAS)
    assert_equal_digests(states)
    r = await admin.h.post(admin.url("r2") + "/v1/completions",
                           json={"model": MODEL, "prompt": [*prefix, 9], "max_tokens": 2})
    assert r.headers["x-jetrouter-worker"] == home


async def test_snapshot_threshold_put_on_one_replica_shows_everywhere(
        cluster: LocalCluster, admin: Admin) -> None:
    r = await admin.h.put(admin.url("r1") + "/admin/snapshot-threshold", headers=admin.auth,
                          json={"threshold": 12345})
    assert r.status_code == 200 and r.json() == {"threshold": 12345}
    await until(lambda: admin.states(REPLICAS),
                lambda s: all(x["snapshot_threshold"] == 12345 for x in s.values()),
                what="threshold everywhere")
    r = await admin.h.put(admin.url("r1") + "/admin/snapshot-threshold", headers=admin.auth,
                          json={"threshold": -3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "threshold"


ADMIN_ROUTES = [("GET", "/admin/state"), ("POST", "/admin/snapshot"),
                ("GET", "/admin/snapshots"), ("POST", "/admin/reset"),
                ("GET", "/admin/snapshot-threshold"), ("PUT", "/admin/snapshot-threshold"),
                ("GET", "/admin/replicas"), ("GET", "/admin/workers"),
                ("GET", "/admin/requests/some-id")]


async def test_admin_auth_on_every_route(cluster: LocalCluster, admin: Admin) -> None:
    url = admin.url("r0")
    for method, path in ADMIN_ROUTES:
        r = await admin.h.request(method, url + path, json={"threshold": 5})
        assert r.status_code == 401, (method, path, r.text)
        assert r.json()["error"]["type"] == "authentication_error"
        r = await admin.h.request(method, url + path, json={"threshold": 5},
                                  headers={"authorization": "Bearer wrong"})
        assert r.status_code == 403, (method, path, r.text)
        assert r.json()["error"]["type"] == "permission_error"


async def test_ledger_on_every_replica_and_rebuilt_after_deleting_the_database(
        cluster: LocalCluster, admin: Admin) -> None:
    ids = []
    for i in range(6):
        r = await admin.h.post(admin.url(REPLICAS[i % 3]) + "/v1/completions", json={
            "model": MODEL, "prompt": list(range(50 * i, 50 * i + 40)), "max_tokens": 3})
        assert r.status_code == 200
        ids.append(r.headers["x-jetrouter-request-id"])

    async def ledger(name: str) -> dict[str, dict]:
        out = {}
        for rid in ids:
            r = await admin.h.get(admin.url(name) + f"/admin/requests/{rid}", headers=admin.auth)
            if r.status_code != 200:
                return {}
            out[rid] = r.json()
        return out

    rows = {n: await until(lambda n=n: ledger(n),
                           lambda d: len(d) == len(ids) and all(
                               x["outcome"] == "ok" for x in d.values()), what=f"{n} ledger")
            for n in REPLICAS}
    assert rows["r0"] == rows["r1"] == rows["r2"]
    one = rows["r0"][ids[0]]
    assert one["candidates"] and {c["worker"] for c in one["candidates"]} == {"w0", "w1"}
    assert one["worker_id"] in ("w0", "w1") and one["replica_id"] == "r0"
    old = cluster.kill("r2", signal.SIGKILL)
    for f in Path(cluster.data_dir / "r2").glob("jetrouter.db*"):
        f.unlink()
    await until(lambda: asyncio.sleep(0, cluster.children["r2"].pid),
                lambda p: p not in (None, old), what="r2 restarted")
    rebuilt = await until(lambda: ledger("r2"),
                          lambda d: len(d) == len(ids) and all(
                              x["outcome"] == "ok" for x in d.values()), what="ledger rebuilt")
    assert rebuilt == rows["r0"]
