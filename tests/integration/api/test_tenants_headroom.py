"""Headroom for tenants under their share (replicas/core/tenant_headroom.py), end to end: two
replicas with tenants, two slow simulated engines, a queue threshold so low that an engine with
a prompt in prefill takes no other, and a flood backlogged on both replicas. Alone, the flood
computes prompts on both engines. Once the victim is active and under its share, the flood
keeps to one engine and leaves the other free, and the victim's next request starts on the
free one while the flood waits — read back from the router stream.
"""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from eventlog.events import PrefillCompleted, RequestFinished, RequestRouted
from launch.local_cluster import LocalCluster
from tests.integration.api.tenant_cluster import (
    queue_depth,
    queued_tenant_cluster_fixture,
    router_events,
)
from tests.waiting import until

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(180)]
MODEL = "jetrouter-sim"
NAMESPACE = "tenroom"
PER_REPLICA = 10


# 1 ms per prompt token: a 200-token prompt keeps an engine's prefill busy for 200 ms; the
# decode steps of the linear model take 8 ms a token. --tenant-headroom is left at its default,
# which holds one of two engines.
cluster = queued_tenant_cluster_fixture(NAMESPACE, {"key-flood": "flood", "key-victim": "victim"},
                                        replicas=2, workers=2, prefill_ms_per_token=1)


def _prompt(n: int) -> list[int]:
    return [*range(1000 + 200 * n, 1200 + 200 * n)]  # distinct prompts: nothing cached


async def test_the_victims_request_starts_at_once_on_the_engine_the_flood_leaves_free(
        cluster: LocalCluster) -> None:
    r0, r1 = cluster.router_urls
    admin = {"authorization": f"Bearer {cluster.admin_token}"}
    flood = [openai.AsyncOpenAI(base_url=url + "/v1", api_key="key-flood", max_retries=0)
             for url in (r0, r1)]
    victim = [openai.AsyncOpenAI(base_url=url + "/v1", api_key="key-victim", max_retries=0)
              for url in (r0, r1)]
    async with httpx.AsyncClient() as h:
        # Weight 4: the victim's first request reserves 500 tokens (prompt + max_tokens), so
        # it is under its share, per weight, after the flood's first 202-token request since.
        r = await h.put(f"{r0}/admin/tenants/victim", json={"weight": 4.0}, headers=admin)
        r.raise_for_status()
        for url in (r0, r1):
            await until(lambda u=url: h.get(f"{u}/admin/tenants/victim", headers=admin),
                        lambda r: r.json()["configured"], what="the victim's weight applied")
        backlog = [asyncio.create_task(flood[r].completions.create(
            model=MODEL, prompt=_prompt(2 * n + r), max_tokens=2))
            for n in range(PER_REPLICA) for r in (0, 1)]
        for url in (r0, r1):
            await until(lambda u=url: queue_depth(h, u), lambda d: d >= 3,
                        what="the flood backlogged on both replicas")

        async def flood_admitted() -> int:
            r = await h.get(f"{r0}/admin/tenants/flood", headers=admin)
            return int(r.json()["usage"]["requests_last_minute"])

        # The victim's first request waits for an engine like anyone's (no capacity is held
        # for a tenant that is not active yet); it stays in flight, decoding, long after.
        first_token = asyncio.Event()

        async def long_answer() -> str:
            text = ""
            async for chunk in await victim[0].completions.create(
                    model=MODEL, prompt=_prompt(100), max_tokens=300, stream=True):
                first_token.set()
                text += chunk.choices[0].text
            return text

        v1 = asyncio.create_task(long_answer())
        await asyncio.wait_for(first_token.wait(), 60)
        # The flood goes on being served after the victim's first request: the victim is now
        # the tenant under its share.
        seen = await flood_admitted()
        await until(flood_admitted, lambda n: n >= seen + 4, what="the flood served on")
        v2 = await asyncio.wait_for(victim[1].completions.create(
            model=MODEL, prompt=_prompt(101), max_tokens=2), 60)
        assert v2.choices[0].text
        assert await asyncio.wait_for(v1, 60)
        assert all(a.choices[0].text for a in await asyncio.wait_for(asyncio.gather(*backlog),
                                                                     120))
    events = await router_events(cluster, NAMESPACE)
    tenant_of: dict[str, str] = {}
    in_prefill: dict[str, str] = {}  # request id -> engine
    flood_on_both_alone = False
    v1_prefilled = v2_routed = False
    flood_after_v1: list[int] = []  # per flood decision after v1's first token: engines it held
    v2_engine_busy: int | None = None
    flood_after_v2 = 0
    flood_beside_v2 = 0  # flood decisions while the victim's second prompt was computed
    v2_id = ""
    for e in events:
        if isinstance(e, RequestRouted):
            tenant_of[e.request_id] = e.tenant
            if e.tenant == "victim" and v1_prefilled and not v2_routed:
                v2_routed, v2_id = True, e.request_id
                v2_engine_busy = sum(1 for w in in_prefill.values() if w == e.worker_id)
            in_prefill[e.request_id] = e.worker_id
            flood_engines = len({w for r, w in in_prefill.items() if tenant_of[r] == "flood"})
            if e.tenant == "flood":
                if "victim" not in tenant_of.values():
                    flood_on_both_alone |= flood_engines == 2
                elif v1_prefilled and not v2_routed:
                    flood_after_v1.append(flood_engines)
                elif v2_routed:
                    flood_after_v2 += 1
                    flood_beside_v2 += v2_id in in_prefill
        elif isinstance(e, PrefillCompleted | RequestFinished):
            if e.request_id in in_prefill and tenant_of[e.request_id] == "victim":
                v1_prefilled = True
            in_prefill.pop(e.request_id, None)
    print(f"\nflood on both engines alone: {flood_on_both_alone}; engines the flood computed "
          f"on at its decisions between the victim's requests: {flood_after_v1}; the victim's "
          f"second request beside {v2_engine_busy} prompt(s); flood decisions after it: "
          f"{flood_after_v2}, {flood_beside_v2} of them beside it")
    # Alone, the flood has both engines: nothing is held for nobody.
    assert flood_on_both_alone
    # The flood was served 4 times between the victim's first token and its second request
    # (the client waited for it; a decision or so of those may precede the first token's
    # event on the stream). The first of those may still meet a replica that has not applied
    # the flood's service since the victim came; from the second on the flood keeps to one
    # engine: the other stays free for the victim, its own first request decoding there or
    # not.
    assert len(flood_after_v1) >= 3, flood_after_v1
    assert flood_after_v1[1:] == [1] * (len(flood_after_v1) - 1), flood_after_v1
    # The victim's second request went to an engine computing no prompt, while the flood
    # still had requests waiting.
    assert v2_engine_busy == 0
    assert flood_after_v2 >= 1
    # What the victim computes counts against what is held: while its prompt is computed, the
    # flood takes the other engine when it frees (its prompt there started before the
    # victim's and ends first).
    assert flood_beside_v2 >= 1
