"""A decision records a bounded number of cost rows (`--decision-candidates`), end to end: 2
router replicas and 36 simulated engines in one process (more than the 32 rows from which a
decision runs over candidate columns), as real processes. Requests routed through either replica
leave both replicas with the same state (equal digests at equal positions), and each replica's
ledger, and `jetrouter admin request` on it, show 4 rows per decision: the chosen engine's and
the cheapest others', cheapest first."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio

from cluster.admin_cli import show_request
from launch.local_cluster import LocalCluster
from tests.integration.registered_cluster import registered_cluster
from tests.waiting import until

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(180)]
MODEL = "jetrouter-sim"
ENGINES = 36
ROWS = 4


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def cluster(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[LocalCluster]:
    data = tmp_path_factory.mktemp("cluster")
    async with registered_cluster(Path(data), replicas=2, workers=ENGINES,
                                  engines_per_process=ENGINES, namespace="dc",
                                  router_args=["--decision-candidates", str(ROWS)]) as c:
        yield c


async def _get(h: httpx.AsyncClient, c: LocalCluster, url: str, path: str) -> Any:
    r = await h.get(url + path, headers={"authorization": f"Bearer {c.admin_token}"})
    return r.json() if r.status_code == 200 else None


async def test_both_replicas_agree_and_record_the_chosen_and_cheapest_rows(
        cluster: LocalCluster) -> None:
    a, b = cluster.router_urls
    routed: list[str] = []
    async with httpx.AsyncClient(timeout=60) as h:
        for i in range(6):
            prompt = [7] * 32 + list(range(i * 100, i * 100 + 40))  # a shared 2-block prefix
            r = await h.post((a, b)[i % 2] + "/v1/completions",
                             json={"model": MODEL, "prompt": prompt, "max_tokens": 2})
            assert r.status_code == 200, r.text
            routed.append(r.json()["id"].removeprefix("cmpl-"))

        async def both() -> tuple[Any, Any]:
            return (await _get(h, cluster, a, "/admin/state"),
                    await _get(h, cluster, b, "/admin/state"))

        sa, sb = await until(both, lambda p: p[0]["positions"] == p[1]["positions"]
                             and p[0]["active_requests"] == p[1]["active_requests"] == 0,
                             what="both replicas at the same positions")
        assert sa["digests"] == sb["digests"]

        for url in (a, b):  # each replica's own ledger
            for request_id in routed:
                data = await until(
                    lambda url=url, rid=request_id: _get(h, cluster, url, f"/admin/requests/{rid}"),
                    lambda d: d is not None and d.get("finished_ts") is not None,
                    what=f"{request_id} in the ledger of {url}")
                rows = data["candidates"]
                assert len(rows) == ROWS, rows
                chosen = [r for r in rows if (r["worker"], r["dp_rank"])
                          == (data["worker_id"], data["dp_rank"])]
                assert len(chosen) == 1
                costs = [r["cost"] for r in rows]
                assert costs == sorted(costs)
                assert len({r["worker"] for r in rows}) == ROWS
                assert f"candidates ({ROWS}, * = chosen)" in show_request(data)
