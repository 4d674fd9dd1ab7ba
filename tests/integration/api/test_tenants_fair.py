"""Fair sharing of the router queue between tenants, end to end: one replica and one slow
simulated engine as real processes, a queue threshold so low that a request waits while any
prompt is being computed, and the order of decisions read back from the router stream.

A tenant that queued a backlog first does not make a later tenant wait behind all of it: the
later tenant is lifted to the backlogged tenant's counter (VTC's newcomer lift), not above it,
so its request leaves at the latest one release after it arrived.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from launch.local_cluster import LocalCluster
from tests.integration.api.tenant_cluster import (
    decisions,
    queue_depth,
    queued_tenant_cluster_fixture,
)
from tests.waiting import until

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(180)]
MODEL = "jetrouter-sim"
NAMESPACE = "tenfair"


# 5 ms per prompt token: a 200-token prompt keeps the engine's prefill busy for a second.
cluster = queued_tenant_cluster_fixture(NAMESPACE, {"key-flood": "flood", "key-victim": "victim"},
                                        replicas=1, prefill_ms_per_token=5)


async def test_a_later_tenant_is_not_queued_behind_another_tenants_backlog(
        cluster: LocalCluster) -> None:
    url = cluster.router_urls[0]
    flood = openai.AsyncOpenAI(base_url=url + "/v1", api_key="key-flood", max_retries=0)
    victim = openai.AsyncOpenAI(base_url=url + "/v1", api_key="key-victim", max_retries=0)
    prompt = list(range(1000, 1200))  # 200 tokens
    async with httpx.AsyncClient() as h:
        backlog = [asyncio.create_task(flood.completions.create(
            model=MODEL, prompt=[*prompt, n], max_tokens=2)) for n in range(6)]
        # One flood request computing its prompt, five waiting in the router queue.
        await until(lambda: queue_depth(h, url), lambda d: d == 5, what="flood backlog queued")
        late = asyncio.create_task(victim.completions.create(
            model=MODEL, prompt=[*prompt, 99], max_tokens=2))
        answers = await asyncio.wait_for(asyncio.gather(*backlog, late), 120)
    assert all(a.choices[0].text for a in answers)
    order = [e.tenant for e in await decisions(cluster, NAMESPACE)
             if e.tenant in ("flood", "victim")]
    assert sorted(order) == ["flood"] * 6 + ["victim"]
    # FCFS would release the victim's request last, after the whole backlog. Fair sharing
    # lifts the newcomer to the flood's counter: at the next opening the tie goes to the queue
    # that formed first, and the victim leaves at the one after (the request already computing
    # when it arrived aside).
    assert order.index("victim") <= 2, order
    print(f"\nrelease order: {json.dumps(order)}")
