"""Several simulated engines in one process (`jetrouter worker --engines N`, started by
`LocalCluster(engines_per_process=N)`): to a replica they are N workers, each registered with its
own URL, each served a request routed to it, each one's KV events in the index; a killed host
comes back with all its engines; SIGTERM drains them all and the process exits 0.

Real nats-server, a real replica and real sockets; three engines keep it to seconds.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import httpx
import pytest

from launch.local_cluster import LocalCluster
from tests.waiting import until

pytestmark = pytest.mark.timeout(120)
ENGINES = ("w0", "w1", "w2")


async def test_three_engines_in_one_process_are_three_workers_to_the_router(
        tmp_path: Path) -> None:
    cluster = LocalCluster(replicas=1, workers=3, engines_per_process=3, data_dir=tmp_path,
                           namespace="hosted", worker_args=["--speedup-ratio", "100"])
    async with cluster, httpx.AsyncClient(timeout=20) as h:
        (host,) = [c for c in cluster.children.values() if c.kind != "replica"]
        assert (host.name, host.kind, tuple(host.engines)) == ("w0-w2", "engines", ENGINES)
        assert cluster.worker_urls == list(host.engines.values())
        assert len(set(cluster.worker_urls)) == 3
        described = cluster.describe()["workers"]
        assert [(w["id"], w["url"], w["pid"]) for w in described] == [
            (wid, url, host.pid) for wid, url in host.engines.items()]

        router = cluster.router_urls[0]
        admin = {"authorization": f"Bearer {cluster.admin_token}"}

        async def workers() -> dict[str, dict]:  # type: ignore[type-arg]
            r = await h.get(router + "/admin/workers", headers=admin)
            return {w["worker_id"]: w for w in r.json()["workers"]}

        registered = await until(workers, lambda ws: len(ws) == 3, timeout=30,
                                 what="three workers registered")
        assert {w: registered[w]["url"] for w in ENGINES} == host.engines

        served: set[str] = set()
        prompts = itertools.count()

        async def route_one() -> set[str]:
            # a prompt of its own each time (4 blocks): no cache overlap steers the choice
            n = next(prompts)
            r = await h.post(router + "/v1/completions", json={
                "model": "jetrouter-sim", "prompt": [1000 * n + i for i in range(64)],
                "max_tokens": 1})
            assert r.status_code == 200, r.text
            served.add(r.headers["x-jetrouter-worker"])
            return served

        await until(route_one, lambda s: s == set(ENGINES), timeout=60,
                    what="every hosted engine served a routed request")
        await until(workers, lambda ws: all(ws[w]["cached_blocks"] >= 4 for w in ENGINES),
                    timeout=30, what="every engine's KV events in the index")

        # the process dies: all three go with it, and come back together on the same ports
        cluster.kill(host.name)
        await until(lambda: host.restarts, lambda n: n == 1, timeout=30, what="host restarted")
        await cluster.wait_ready([host.name])
        assert cluster.worker_urls == list(host.engines.values())
    assert host.last_returncode == 0  # SIGTERM drained all three engines
