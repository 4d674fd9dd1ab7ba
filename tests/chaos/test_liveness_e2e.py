"""Liveness end to end with real processes (design.md §7): replicas and workers started by
`LocalCluster(restart=False)`, killed or stopped with signals, observed over their HTTP admin API.

One cluster serves the module; the tests run in file order, least destructive first: the
divergence hook, then a worker stopped for good, then a replica killed for good.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio

from launch.local_cluster import LocalCluster
from tests.chaos.conftest import MODEL, Admin, until

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(120)]
cluster_test = pytest.mark.asyncio(loop_scope="module")
REPLICAS = ["r0", "r1", "r2"]
WORKERS = ["w0", "w1", "w2"]
TIMEOUT = 2.0  # --replica-timeout and --worker-timeout
SLACK = 8.0  # "within the timeout + a few seconds", on a loaded 2-core machine


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def admin(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Admin]:
    data = Path(tmp_path_factory.mktemp("liveness"))
    # The replicas serve the divergence hook route too (tests/divergence_hook.py).
    async with LocalCluster(
            replicas=3, workers=3, data_dir=data, namespace="lve", restart=False,
            router_module="tests.divergence_hook",
            router_args=["--replica-timeout", str(TIMEOUT), "--worker-timeout", str(TIMEOUT),
                         "--heartbeat-interval", "0.25", "--lease-ttl", "2",
                         "--canary-interval", "0"],
            # Slow decode: a 1500-token stream stays open for many seconds.
            worker_args=["--speedup-ratio", "0.25"]) as cluster:
        async with httpx.AsyncClient() as h:
            a = Admin(cluster, h)
            for name in REPLICAS:
                await until(lambda name=name: worker_ids(a, name),
                            lambda ids: ids == set(WORKERS), what=f"{name} sees workers")
            yield a


async def worker_ids(admin: Admin, replica: str) -> set[str]:
    return {w["worker_id"] for w in (await admin.get(replica, "/admin/workers"))["workers"]}


async def loads(admin: Admin, replica: str) -> dict[str, tuple[int, int]]:
    ws = (await admin.get(replica, "/admin/workers"))["workers"]
    return {w["worker_id"]: (w["active_prefill_tokens"], w["active_decode_blocks"]) for w in ws}


async def metric(admin: Admin, replica: str, name: str) -> float:
    text = (await admin.h.get(admin.url(replica) + "/metrics")).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


@cluster_test
async def test_injected_divergence_is_detected_by_a_peer(admin: Admin) -> None:
    name = "jetrouter_replica_divergence_total"
    before = await metric(admin, "r1", name)
    await admin.converged(REPLICAS)  # quiet streams: replicas sit at equal positions
    await admin.post("r0", "/admin/debug/inject-divergence", {"part": "index"})
    await until(lambda: metric(admin, "r1", name), lambda v: v > before,
                timeout=15, what="divergence counted on r1")
    rows = await until(lambda: admin.get("r1", "/admin/replicas"),
                       lambda d: any(r["replica_id"] == "r0" and r["divergent"]
                                     for r in d["replicas"]),
                       timeout=15, what="/admin/replicas shows r0 divergent")
    peers = rows["replicas"]  # type: ignore[index]
    assert not any(r["divergent"] for r in peers if r["replica_id"] == "r2"), peers


@cluster_test
async def test_stopped_worker_is_retired_everywhere_and_gets_no_more_requests(
        admin: Admin) -> None:
    victim = "w2"
    pid = admin.c.kill(victim, signal.SIGSTOP)  # no load gauges and no /health answer
    try:
        for name in REPLICAS:
            await until(lambda name=name: worker_ids(admin, name),
                        lambda ids: victim not in ids, timeout=TIMEOUT + SLACK + 10,
                        what=f"{victim} retired on {name}")
        for i in range(24):  # every prefix family, through every replica
            r = await admin.h.post(admin.url(REPLICAS[i % 3]) + "/v1/completions", timeout=30,
                                   json={"model": MODEL, "prompt": [*range(50 * i, 50 * i + 40)],
                                         "max_tokens": 2})
            assert r.status_code == 200, r.text
            assert r.headers["x-jetrouter-worker"] != victim
    finally:
        os.killpg(pid, signal.SIGCONT)  # the group, as it was stopped
        with contextlib.suppress(ProcessLookupError):
            admin.c.kill(victim, signal.SIGKILL)  # keep it out of the next test


class Streams:
    """Long streaming completions held open through one replica."""

    def __init__(self, admin: Admin) -> None:
        self.admin = admin
        self.ids: list[str] = []
        self._tasks: list[asyncio.Task[None]] = []

    async def open(self, replica: str, first_token: int, count: int) -> None:
        started = [asyncio.Event() for _ in range(count)]
        for k in range(count):
            # Distinct prompts (no shared blocks): each request's load adds up on its own.
            prompt = [*range(first_token + 200 * k, first_token + 200 * k + 64)]
            self._tasks.append(asyncio.create_task(self._one(replica, prompt, started[k])))
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 30)

    async def _one(self, replica: str, prompt: list[int], started: asyncio.Event) -> None:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 1500, "stream": True}
        with contextlib.suppress(httpx.HTTPError):
            async with self.admin.h.stream("POST", self.admin.url(replica) + "/v1/completions",
                                           json=body, timeout=60) as resp:
                assert resp.status_code == 200
                self.ids.append(resp.headers["x-jetrouter-request-id"])
                started.set()
                async for _ in resp.aiter_bytes():
                    pass

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def total(load: dict[str, tuple[int, int]]) -> int:
    return sum(a + b for a, b in load.values())


@cluster_test
async def test_paused_replica_is_declared_lost_then_rejoins_without_double_freeing(
        admin: Admin) -> None:
    """SIGSTOP past --replica-timeout: the leader declares it lost and its load is freed on
    every other replica; SIGCONT: it heartbeats again (live, no longer declared lost), applies
    its own ReplicaLost, and when its old requests end nothing is freed a second time."""
    victim, others = "r1", ["r0", "r2"]
    kept, doomed = Streams(admin), Streams(admin)
    pid = None
    try:
        await kept.open("r0", 300_000, 2)
        share = await until(lambda: stable_equal_loads(admin, REPLICAS),
                            lambda v: v is not None and all(p == 0 for p, _ in v.values()),
                            what="equal loads everywhere, prefills done")
        await doomed.open(victim, 320_000, 3)
        await until(lambda: loads(admin, "r0"),
                    lambda v: total(v) > total(share),  # type: ignore[arg-type]
                    what="paused replica's requests charged")
        pid = admin.c.kill(victim, signal.SIGSTOP)
        for name in others:
            await until(lambda name=name: loads(admin, name), lambda v: v == share,
                        timeout=TIMEOUT + SLACK, what=f"{name} back to the kept share {share}")
        for rid in doomed.ids:  # freed by a ReplicaLost, not by the requests ending
            row = await until(lambda rid=rid: admin.get("r0", f"/admin/requests/{rid}"),
                              lambda r: r["lost"], what=f"{rid} lost in the ledger")
            assert row["replica_id"] == victim  # type: ignore[index]
        os.killpg(pid, signal.SIGCONT)  # the group, as it was stopped
        pid = None
        await until(lambda: admin.get("r0", "/admin/replicas"),
                    lambda d: any(r["replica_id"] == victim and r["live"]
                                  and not r["declared_lost"]
                                  for r in d["replicas"]),  # type: ignore[index]
                    timeout=SLACK + 10, what=f"{victim} live again")
        await doomed.close()  # its old requests end now: RequestFinished for freed requests
        for name in REPLICAS:
            await until(lambda name=name: loads(admin, name), lambda v: v == share,
                        timeout=SLACK + 10, what=f"{name} at the kept share, nothing freed twice")
            state = await admin.state(name)
            assert state["active_requests"] == len(kept.ids), state
        await kept.close()  # the kept requests end too: no load left anywhere, none negative
        for name in REPLICAS:
            await until(lambda name=name: loads(admin, name), lambda v: total(v) == 0,
                        what=f"no load left on {name}")
        states = await admin.converged(REPLICAS)
        # The load part only: an earlier test in this module injected an index divergence.
        assert len({s["digests"]["load"] for s in states.values()}) == 1, states
    finally:
        if pid is not None:
            os.killpg(pid, signal.SIGCONT)  # the group, as it was stopped
        await kept.close()
        await doomed.close()


@cluster_test
async def test_replica_lost_frees_exactly_its_requests_on_every_replica(admin: Admin) -> None:
    victim, survivors = "r2", ["r0", "r1"]
    kept, doomed = Streams(admin), Streams(admin)
    try:
        await kept.open("r0", 100_000, 2)
        await kept.open("r1", 110_000, 2)
        # The survivors' share, once every replica has applied those decisions (and prefills).
        share = await until(lambda: stable_equal_loads(admin, REPLICAS),
                            lambda v: v is not None and all(p == 0 for p, _ in v.values()),
                            what="equal loads everywhere, prefills done")
        await doomed.open(victim, 120_000, 3)
        await until(lambda: loads(admin, "r0"),
                    lambda v: total(v) > total(share),  # type: ignore[arg-type]
                    what="victim's requests charged")
        admin.c.kill(victim, signal.SIGKILL)  # restart=False: it stays dead
        for name in survivors:
            await until(lambda name=name: loads(admin, name), lambda v: v == share,
                        timeout=TIMEOUT + SLACK,
                        what=f"{name} back to the survivors' share {share}")
            state = await admin.state(name)
            assert state["active_requests"] == len(kept.ids), state
        for rid in doomed.ids:
            row = await until(lambda rid=rid: admin.get("r0", f"/admin/requests/{rid}"),
                              lambda r: r["lost"], what=f"{rid} lost in the ledger")
            assert row["replica_id"] == victim  # type: ignore[index]
        for rid in kept.ids:  # the ledger is written by a child process: wait for the row
            row = await until(lambda rid=rid: admin.get("r1", f"/admin/requests/{rid}"),
                              lambda r: r is not None, what=f"{rid} in r1's ledger")
            assert not row["lost"], row  # type: ignore[index]
    finally:
        await kept.close()
        await doomed.close()


async def stable_equal_loads(admin: Admin, names: list[str]) -> dict[str, Any] | None:
    """The per-worker loads when every replica shows the same non-empty ones, else None."""
    views = [await loads(admin, n) for n in names]
    first = views[0]
    if total(first) and all(v == first for v in views):
        return first
    return None
