"""A flood that starts next to a steady tenant does not take every opening of the router queue
until its own service catches up with the steady tenant's: the newcomer is lifted (VTC), end to
end on two replicas and one slow simulated engine as real processes, the order of decisions
read back from the router stream.

The steady tenant's service reaches the replica that queues through the stream alone (it was
served through the other replica), so the lift is worked out from the replicated book.
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
NAMESPACE = "tennew"


# 1 ms per prompt token: the steady tenant's 2000-token warm-up takes about 2 s.
cluster = queued_tenant_cluster_fixture(NAMESPACE, {"key-steady": "steady", "key-flood": "flood"},
                                        replicas=2, prefill_ms_per_token=1)


async def test_a_new_flood_does_not_take_every_opening_from_a_steady_tenant(
        cluster: LocalCluster) -> None:
    r0, r1 = cluster.router_urls
    admin = {"authorization": f"Bearer {cluster.admin_token}"}
    # The steady tenant is served 5 x 2002 tokens through r0 (one 2000-token prompt, cached
    # after its first computation, so the warm-up takes about 2 s).
    steady0 = openai.AsyncOpenAI(base_url=r0 + "/v1", api_key="key-steady", max_retries=0)
    warm = list(range(3000, 5000))
    for _ in range(5):
        await asyncio.wait_for(steady0.completions.create(model=MODEL, prompt=warm,
                                                          max_tokens=2), 60)
    flood = openai.AsyncOpenAI(base_url=r1 + "/v1", api_key="key-flood", max_retries=0)
    steady1 = openai.AsyncOpenAI(base_url=r1 + "/v1", api_key="key-steady", max_retries=0)
    async with httpx.AsyncClient() as h:
        await until(lambda: h.get(f"{r1}/admin/tenants/steady", headers=admin),
                    lambda r: r.json()["usage"]["requests_last_minute"] == 5,
                    what="r1 applied the steady tenant's service")
        backlog = [asyncio.create_task(flood.completions.create(
            model=MODEL, prompt=[*range(1000 + 300 * n, 1200 + 300 * n)], max_tokens=2))
            for n in range(6)]
        # One flood request computing its prompt, five waiting in r1's queue.
        await until(lambda: queue_depth(h, r1), lambda d: d == 5, what="flood backlog queued")
        late = asyncio.create_task(steady1.completions.create(
            model=MODEL, prompt=[*range(20000, 20200)], max_tokens=2))
        answers = await asyncio.wait_for(asyncio.gather(*backlog, late), 120)
    assert all(a.choices[0].text for a in answers)
    order = [e.tenant for e in await decisions(cluster, NAMESPACE)][5:]  # after the warm-up
    assert sorted(order) == ["flood"] * 6 + ["steady"]
    # Unlifted, the flood's counter (its tokens in the window) would stay under the steady
    # tenant's 10,010 for all six requests, and the steady request would leave last. Lifted to
    # the steady tenant's counter when it arrived, the flood is ahead of it from its first
    # release on: the steady request leaves at the next opening (a release under way aside).
    assert order.index("steady") <= 2, order
    print(f"\nrelease order: {json.dumps(order)}")
