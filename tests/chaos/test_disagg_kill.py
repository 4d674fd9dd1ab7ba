"""SIGKILL of a router replica in the middle of disaggregated requests: its decisions on both the
prefill engine and the decode engine stop counting as load on the surviving replica (ReplicaLost
frees every request the dead replica owned, whichever phase it was in), and the engines
themselves drop the orphaned work. Real processes: nats-server, 2 replicas, 1 prefill engine,
1 decode engine."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from launch.local_cluster import LocalCluster
from tests.chaos.conftest import MODEL, Admin, until

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(150)]
cluster_test = pytest.mark.asyncio(loop_scope="module")
TIMEOUT = 2.0  # --replica-timeout
PROMPT = list(range(2000, 2000 + 6 * 16))


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def admin(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Admin]:
    data = Path(tmp_path_factory.mktemp("disagg-kill"))
    async with LocalCluster(
            replicas=2, workers=0, prefill_workers=1, decode_workers=1, data_dir=data,
            namespace="dkl", restart=False,
            router_args=["--replica-timeout", str(TIMEOUT), "--heartbeat-interval", "0.25",
                         "--lease-ttl", "2", "--canary-interval", "0"],
            # Slow decode: a 1500-token stream stays open for many seconds.
            worker_args=["--speedup-ratio", "0.25"]) as cluster:
        async with httpx.AsyncClient() as h:
            a = Admin(cluster, h)
            for name in ("r0", "r1"):
                await until(lambda name=name: loads(a, name), lambda ls: set(ls) == {"p0", "d0"},
                            what=f"{name} sees both engines")
            yield a


async def loads(admin: Admin, replica: str) -> dict[str, tuple[int, int]]:
    ws = (await admin.get(replica, "/admin/workers"))["workers"]
    return {w["worker_id"]: (w["active_prefill_tokens"], w["active_decode_blocks"]) for w in ws}


async def stream(h: httpx.AsyncClient, url: str, prompt: list[int], first: asyncio.Event,
                 ids: list[str]) -> None:
    """A streaming completion that runs until cancelled (or its replica dies)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1500, "stream": True}
    with contextlib.suppress(httpx.HTTPError):
        async with h.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            ids.append(r.headers.get("x-jetrouter-request-id", ""))
            async for _ in r.aiter_bytes():
                first.set()


@cluster_test
async def test_replica_sigkill_mid_disaggregated_requests_frees_both_engines(
        admin: Admin) -> None:
    c = admin.c
    r0 = c.children["r0"].url
    async with httpx.AsyncClient() as h:
        # Request A reaches its decode phase: its prefill hop is over, d0 streams.
        decoding, ids = asyncio.Event(), []
        a = asyncio.create_task(stream(h, r0, [*PROMPT, 1], decoding, ids))
        await asyncio.wait_for(decoding.wait(), 60)
        # Request B stays in its prefill phase: p0 is made very slow first.
        r = await h.post(c.children["p0"].url + "/fault", json={"action": "slow", "factor": 400})
        assert r.status_code == 200
        b = asyncio.create_task(stream(h, r0, [*PROMPT, 2], asyncio.Event(), []))
        try:
            await until(lambda: loads(admin, "r1"),
                        lambda ls: ls["p0"][0] > 0 and ls["d0"][1] > 0,
                        what="r1 sees A decoding on d0 and B prefilling on p0")
            c.kill("r0")
            # The leader declares r0 lost after --replica-timeout: both engines' load is freed.
            await until(lambda: loads(admin, "r1"),
                        lambda ls: ls == {"p0": (0, 0), "d0": (0, 0)}, timeout=60,
                        what="load of the killed replica freed on both engines")
            # The decode engine lost its client and dropped request A.
            await until(lambda: h.get(c.children["d0"].url + "/health"),
                        lambda r: r.json()["load"][0]["num_running"] == 0, timeout=30,
                        what="d0 aborted the orphaned stream")
            # The ledger is a projection (written by the replica's projector child a moment
            # after the state applies ReplicaLost): wait for it to show the lost decode hop.
            await until(lambda: admin.get("r1", f"/admin/requests/{ids[0]}"),
                        lambda e: [(x["phase"], x["lost"]) for x in e.get("hops", [])] == [
                            ("prefill", False), ("decode", True)], timeout=30,
                        what="r1's ledger shows the prefill hop and the lost decode hop")
        finally:
            for task in (a, b):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await h.post(c.children["p0"].url + "/fault", json={"action": "clear"})
