"""Output-block tracking and the linear prefill load model end to end: 2 router replicas started
with `--router-track-output-blocks --router-prefill-load-model linear` and a simulated worker, as
real processes. A request streamed through one replica shows its output blocks on the other, and
both replicas end with the same state (equal digests at equal positions)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio

from launch.local_cluster import LocalCluster
from tests.waiting import until

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(180)]
MODEL = "jetrouter-sim"
PROMPT = list(range(1000, 1064))  # 4 blocks of 16


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def cluster(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[LocalCluster]:
    data = tmp_path_factory.mktemp("cluster")
    async with LocalCluster(replicas=2, workers=1, data_dir=Path(data), namespace="lm",
                            router_args=["--router-track-output-blocks",
                                         "--router-prefill-load-model", "linear"],
                            worker_args=["--num-gpu-blocks", "2048"]) as c:
        async with httpx.AsyncClient() as h:
            for url in c.router_urls:
                await until(lambda url=url: _workers(h, url, c), lambda ws: len(ws) == 1)
        yield c


async def _workers(h: httpx.AsyncClient, url: str, c: LocalCluster) -> list[dict[str, Any]]:
    r = await h.get(f"{url}/admin/workers", headers=_admin(c))
    return r.json()["workers"]


async def _state(h: httpx.AsyncClient, url: str, c: LocalCluster) -> dict[str, Any]:
    return (await h.get(f"{url}/admin/state", headers=_admin(c))).json()


def _admin(c: LocalCluster) -> dict[str, str]:
    return {"authorization": f"Bearer {c.admin_token}"}


def _applied(metrics: str, event_type: str, status: str = "ok") -> float:
    total = 0.0
    for line in metrics.splitlines():
        if line.startswith("jetrouter_events_applied_total{") and \
                f'event_type="{event_type}"' in line and f'status="{status}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


async def test_output_blocks_show_on_the_other_replica_and_both_agree(
        cluster: LocalCluster) -> None:
    a, b = cluster.router_urls
    async with httpx.AsyncClient(timeout=60) as h:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 300, "stream": True,
                "nvext": {"agent_hints": {"osl": 300}}}
        async with h.stream("POST", a + "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            # Replica b never saw the request: the output blocks reach it as events.
            # 4 prompt blocks, then each output block weighted by what is left of the osl.
            await until(lambda: _workers(h, b, cluster),
                        lambda ws: ws[0]["active_decode_blocks"] > 4.5,
                        what="output blocks counted on the other replica")
            async for _ in resp.aiter_bytes():
                pass
        for url in (a, b):
            await until(lambda url=url: _workers(h, url, cluster),
                        lambda ws: ws[0]["active_decode_blocks"] == 0
                        and ws[0]["active_prefill_tokens"] == 0)
        # A few more, so the worker's prefill throughput is learned from several completions.
        for i in range(3):
            r = await h.post((a, b)[i % 2] + "/v1/completions",
                             json={"model": MODEL, "prompt": list(range(i * 500, i * 500 + 200)),
                                   "max_tokens": 40})
            assert r.status_code == 200, r.text

        async def both() -> tuple[dict[str, Any], dict[str, Any]]:
            return await _state(h, a, cluster), await _state(h, b, cluster)

        sa, sb = await until(both, lambda p: p[0]["positions"] == p[1]["positions"]
                             and p[0]["active_requests"] == p[1]["active_requests"] == 0,
                             what="both replicas at the same positions")
        assert sa["digests"] == sb["digests"]
        for url in (a, b):
            metrics = (await h.get(url + "/metrics")).text
            assert _applied(metrics, "OutputProgress") >= 1
