"""Disaggregated prefill/decode serving end to end: 2 router replicas, 2 prefill and 2 decode
simulated engines as real processes (`jetrouter up --prefill-workers 2 --decode-workers 2`).

Each request gets a prefill decision and a decode decision, both on the router stream, so the
*other* replica's ledger shows the pair with their cost terms. When every prefill engine is down,
requests fall back to aggregated serving on a decode engine. The last test crashes the prefill
engines (no restarts in this cluster), so it runs last.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio

from launch.local_cluster import LocalCluster
from tests.integration.registered_cluster import admin, registered_cluster, workers
from tests.waiting import until

pytestmark = [pytest.mark.timeout(180)]
cluster_test = pytest.mark.asyncio(loop_scope="module")
MODEL = "jetrouter-sim"
PREFIX = list(range(1000, 1000 + 8 * 16))  # 8 blocks


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def cluster(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[LocalCluster]:
    data = tmp_path_factory.mktemp("disagg")
    async with registered_cluster(Path(data), replicas=2, workers=0, prefill_workers=2,
                                  decode_workers=2, namespace="dis", restart=False,
                                  router_args=["--canary-interval", "0",
                                               "--worker-timeout", "2"],
                                  worker_args=["--num-gpu-blocks", "1024"]) as c:
        yield c


async def ledger(h: httpx.AsyncClient, c: LocalCluster, url: str, request_id: str
                 ) -> dict[str, Any]:
    """The ledger entry once the request has finished (its prefill hop, if any, ended before
    its decode decision was made, so it is in by then)."""
    async def get() -> dict[str, Any] | None:
        r = await h.get(f"{url}/admin/requests/{request_id}", headers=admin(c))
        return r.json() if r.status_code == 200 else None

    return await until(get, lambda d: d is not None and d["outcome"] is not None
                       and all(x["outcome"] for x in d["hops"]), what="ledger rows")


async def complete(h: httpx.AsyncClient, url: str, prompt: list[int], n: int = 8
                   ) -> httpx.Response:
    r = await h.post(f"{url}/v1/completions",
                     json={"model": MODEL, "prompt": prompt, "max_tokens": n})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == n
    return r


async def disaggregated(h: httpx.AsyncClient, url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in (await h.get(f"{url}/metrics")).text.splitlines():
        if line.startswith("jetrouter_disaggregated_requests_total{"):
            outcome = line.split('outcome="', 1)[1].split('"', 1)[0]
            out[outcome] = float(line.rsplit(" ", 1)[1])
    return out


@cluster_test
async def test_prefill_then_decode_decision_replicated_to_the_other_replica(
        cluster: LocalCluster) -> None:
    r0, r1 = cluster.router_urls
    async with httpx.AsyncClient(timeout=30) as h:
        roles = {w: d["role"] for w, d in (await workers(h, cluster, r1)).items()}
        assert roles == {"p0": "prefill", "p1": "prefill", "d0": "decode", "d1": "decode"}
        r = await complete(h, r0, [*PREFIX, 1, 2, 3])
        assert r.headers["x-jetrouter-worker"].startswith("d")
        rid = r.headers["x-jetrouter-request-id"]
        # The second replica's ledger, fed by the router stream alone, shows both decisions.
        entry = await ledger(h, cluster, r1, rid)
        pre, dec = entry["hops"]
        assert (pre["phase"], pre["request_id"], pre["outcome"]) == ("prefill", rid + "~prefill",
                                                                     "ok")
        assert (dec["phase"], dec["request_id"], dec["outcome"]) == ("decode", rid, "ok")
        assert pre["worker_id"].startswith("p") and dec["worker_id"] == \
            r.headers["x-jetrouter-worker"]
        # Each decision weighed only the engines of its phase, with their cost terms.
        assert {c["worker"] for c in pre["candidates"]} == {"p0", "p1"}
        assert {c["worker"] for c in dec["candidates"]} == {"d0", "d1"}
        assert all(c["decode_blocks"] == 0 for c in pre["candidates"])  # no active blocks
        home = pre["worker_id"]

        # The prefill decision is KV-aware: once the replica sees the prefix cached on the
        # prefill engine that computed it, the same prefix goes back there, from either replica.
        await until(lambda: workers(h, cluster, r1), lambda ws: ws[home]["cached_blocks"] >= 8,
                    what="prefix cached on the prefill engine")
        again = await complete(h, r1, [*PREFIX, 4, 5, 6])
        entry = await ledger(h, cluster, r0, again.headers["x-jetrouter-request-id"])
        pre = entry["hops"][0]
        assert pre["worker_id"] == home and pre["overlap_blocks"] >= 8
        # Every hop ended: no load is left on any engine, on either replica.
        for url in (r0, r1):
            await until(lambda u=url: workers(h, cluster, u),
                        lambda ws: all(w["active_prefill_tokens"] == 0
                                       and w["active_decode_blocks"] == 0 for w in ws.values()),
                        what="load freed")
        assert (await disaggregated(h, r0)).get("disaggregated", 0) >= 1


@cluster_test
async def test_fallback_to_aggregated_when_every_prefill_engine_is_down(
        cluster: LocalCluster) -> None:
    r0, _ = cluster.router_urls
    async with httpx.AsyncClient(timeout=30) as h:
        for name in ("p0", "p1"):
            with pytest.raises(httpx.HTTPError):  # the engine exits while answering
                await h.post(cluster.children[name].url + "/fault", json={"action": "crash"})
        r = await complete(h, r0, [*PREFIX, 7, 8, 9])
        assert r.headers["x-jetrouter-worker"].startswith("d")
        entry = await ledger(h, cluster, r0, r.headers["x-jetrouter-request-id"])
        main = entry["hops"][-1]
        assert main["phase"] == "aggregated" and main["outcome"] == "ok"
        # Either the prefill hop was tried and failed, or no prefill engine was left to try.
        assert all(x["outcome"] == "error" for x in entry["hops"] if x["phase"] == "prefill")
        fell_back = await disaggregated(h, r0)
        assert fell_back.get("prefill_failed", 0) + fell_back.get("no_prefill_engine", 0) >= 1
        # Once liveness retires both prefill engines the model is served aggregated outright.
        await until(lambda: workers(h, cluster, r0), lambda ws: set(ws) == {"d0", "d1"},
                    what="prefill engines retired")
        r = await complete(h, r0, [*PREFIX, 10, 11])
        entry = await ledger(h, cluster, r0, r.headers["x-jetrouter-request-id"])
        assert len(entry["hops"]) == 1 and entry["hops"][0]["phase"] == "aggregated"
        assert entry["hops"][0]["worker_id"].startswith("d")
