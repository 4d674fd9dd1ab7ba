"""Replicas take turns at an engine's openings (replicas/core/release_turns.py), end to end: two
replicas with tenants, one slow simulated engine, a queue threshold so low that an engine with a
prompt in prefill takes no other, and a backlog waiting on both replicas. The router stream
shows the engine given one prompt at a time — not one per replica at every opening — and both
replicas' queues served in turn.
"""

from __future__ import annotations

import asyncio

import openai
import pytest

from eventlog.events import PrefillCompleted, RequestFinished, RequestRouted
from launch.local_cluster import LocalCluster
from tests.integration.api.tenant_cluster import (
    queued_tenant_cluster_fixture,
    router_events,
)

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(180)]
MODEL = "jetrouter-sim"
NAMESPACE = "tenturns"
PER_REPLICA = 8


# 1 ms per prompt token: a 200-token prompt keeps the engine's prefill busy for 200 ms, long
# beside the replication lag the turns' grace has to cover.
cluster = queued_tenant_cluster_fixture(NAMESPACE, {"key-a": "a", "key-b": "b"}, replicas=2,
                                        prefill_ms_per_token=1)


async def test_the_engine_gets_one_prompt_per_opening_and_both_queues_are_served(
        cluster: LocalCluster) -> None:
    clients = [openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
               for url, key in zip(cluster.router_urls, ("key-a", "key-b"), strict=True)]
    # Tenant a's backlog waits on r0, tenant b's on r1; distinct prompts, nothing cached.
    calls = [clients[r].completions.create(
        model=MODEL, prompt=[*range(1000 + 5000 * r + 200 * n, 1200 + 5000 * r + 200 * n)],
        max_tokens=2) for n in range(PER_REPLICA) for r in (0, 1)]
    answers = await asyncio.wait_for(asyncio.gather(*calls), 120)
    assert all(a.choices[0].text for a in answers)
    in_prefill: set[str] = set()
    doubled, order = 0, []
    for e in await router_events(cluster, NAMESPACE):
        if isinstance(e, RequestRouted):
            doubled += bool(in_prefill)  # another prompt was still being computed
            in_prefill.add(e.request_id)
            order.append(e.replica_id)
        elif isinstance(e, PrefillCompleted | RequestFinished):
            in_prefill.discard(e.request_id)
    assert len(order) == 2 * PER_REPLICA
    # Without turns both replicas fill the same openings whenever they apply its event at
    # about the same moment (3-7 of 16 decisions here on a busy host). With them the engine
    # gets one at a time: the first two requests (routed at once, before any queue formed)
    # may meet, and a grace that runs out under a load spike may let one more pair through.
    assert doubled <= 2, (doubled, order)
    # Turns alternate: neither replica takes three openings in a row while the other waits.
    assert all(len(set(order[i:i + 3])) == 2 for i in range(len(order) - 2)), order
    print(f"\nreleases by replica: {order}; beside a prompt in prefill: {doubled}")
