"""Identical prompts in flight together, through two replicas, streamed: every stream ends
with ``[DONE]`` and no error.

A prompt that is fully cached and already running on an engine adds no prefill tokens and no
new decode blocks when routed there again, so several such decisions sit in a replica's
optimistic overlay at once with sums of zero. Retries, shared system prompts and load tests all
send such prompts; this drives them the way they do: 2 replicas, many concurrent streaming
clients drawing from a few token-id prompts.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from launch.local_cluster import LocalCluster
from tests.integration.registered_cluster import admin, registered_cluster
from tests.waiting import until

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(240)]
MODEL = "jetrouter-sim"
CLIENTS_PER_REPLICA = 32
REQUESTS_PER_CLIENT = 4
PROMPTS = [[7000 + 100 * p + i for i in range(48)] for p in range(4)]  # 3 blocks each


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def cluster(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[LocalCluster]:
    data = tmp_path_factory.mktemp("identical")
    async with registered_cluster(Path(data), replicas=2, workers=2, namespace="same",
                                  worker_args=["--speedup-ratio", "2"]) as c:
        yield c


async def one_client(h: httpx.AsyncClient, url: str, rng: random.Random) -> list[str]:
    """Streams REQUESTS_PER_CLIENT completions; returns a line per stream that went wrong."""
    wrong: list[str] = []
    for _ in range(REQUESTS_PER_CLIENT):
        prompt = rng.choice(PROMPTS)
        try:
            async with h.stream("POST", f"{url}/v1/completions", json={
                    "model": MODEL, "prompt": prompt, "max_tokens": 32,
                    "stream": True}) as response:
                body = (await response.aread()).decode()
        except httpx.HTTPError as exc:  # a cut body raises here
            wrong.append(f"{url}: {type(exc).__name__}: {exc}")
            continue
        events = [e.removeprefix("data: ") for e in body.split("\n\n") if e]
        if response.status_code != 200 or not events or events[-1] != "[DONE]" \
                or any('"error"' in e for e in events):
            wrong.append(f"{url}: HTTP {response.status_code}: {body[-300:]!r}")
    return wrong


async def test_identical_streamed_prompts_in_flight_together_all_end_with_done(
        cluster: LocalCluster) -> None:
    limits = httpx.Limits(max_connections=4 * CLIENTS_PER_REPLICA)
    async with httpx.AsyncClient(timeout=60, limits=limits) as h, contextlib.AsyncExitStack() \
            as holders:
        # One long stream per prompt keeps it running on its engine, so once both replicas
        # applied it, each identical request routed there is fully cached and already active.
        for prompt in PROMPTS:
            holder = await holders.enter_async_context(h.stream(
                "POST", f"{cluster.router_urls[0]}/v1/completions",
                json={"model": MODEL, "prompt": prompt, "max_tokens": 3000, "stream": True}))
            assert holder.status_code == 200, await holder.aread()
        for url in cluster.router_urls:
            await until(lambda url=url: h.get(f"{url}/admin/workers", headers=admin(cluster)),
                        lambda r: sum(w["active_decode_blocks"] for w in r.json()["workers"])
                        >= 3 * len(PROMPTS), what=f"{url}: the long streams applied")
        results = await asyncio.gather(*(
            one_client(h, url, random.Random(f"{url}-{n}"))
            for url in cluster.router_urls for n in range(CLIENTS_PER_REPLICA)))
        wrong = [line for lines in results for line in lines]
        total = len(cluster.router_urls) * CLIENTS_PER_REPLICA * REQUESTS_PER_CLIENT
        assert not wrong, f"{len(wrong)} of {total} streams went wrong: {wrong[:5]}"
        await holders.aclose()  # the long streams end as cancelled requests
        # Every decision routed here came back from the stream or ended: nothing lingers.
        for url in cluster.router_urls:
            await until(lambda url=url: h.get(f"{url}/admin/workers", headers=admin(cluster)),
                        lambda r: all(w["active_prefill_tokens"] == 0
                                      and w["active_decode_blocks"] == 0
                                      for w in r.json()["workers"]),
                        timeout=30, what=f"{url}: no load left once every stream ended")
    for log in (cluster.data_dir / "logs").glob("r*.log"):
        assert "Traceback" not in log.read_text(errors="replace"), f"{log} has a traceback"
