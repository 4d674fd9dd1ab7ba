"""Opt-in (``-m vllm``): cache isolation between tenants against a real vLLM.

An isolated tenant's prompts reach the engine with the router's ``cache_salt`` (the client's own
is replaced) and the router hashes them under the same salt, so: another tenant's identical
prompt is not served from the isolated tenant's blocks (vLLM's own ``cached_tokens`` says 0),
and the isolated tenant's repeat is predicted exactly as vLLM reuses it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio

from tests.vllm.tiny_cluster import started, tiny_cluster, token_ids
from tests.waiting import until

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800),
              pytest.mark.asyncio(loop_scope="module")]

MODEL = "tiny"
BLOCK = 32
PREDICTED_HEADER = "x-jetrouter-predicted-cached-tokens"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def tenant_cluster(vllm_model: Path, vllm_dir: Path) -> AsyncIterator[Any]:
    keys = vllm_dir / "keys.json"
    keys.write_text(json.dumps({"key-iso": "iso", "key-other": "other"}))
    async with started(tiny_cluster(vllm_model, vllm_dir / "tenants", engines=1, replicas=1,
                                    router_args=["--api-keys-file", str(keys)])) as cluster:
        yield cluster


async def _complete(h: httpx.AsyncClient, url: str, key: str, prompt: list[int],
                    **extra: Any) -> httpx.Response:
    r = await h.post(url + "/v1/completions", headers={"authorization": f"Bearer {key}"},
                     json={"model": MODEL, "prompt": prompt, "max_tokens": 2, **extra})
    assert r.status_code == 200, r.text
    return r


def _cached(r: httpx.Response) -> int:
    return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


async def _indexed(cluster: Any) -> int:
    return sum(int(w["cached_blocks"]) for w in await cluster.workers(0))


async def test_isolated_tenant_cache_is_apart_and_predicted_exactly(tenant_cluster: Any) -> None:
    cluster = tenant_cluster
    url = cluster.router_urls[0]
    prompt = token_ids(41, 6 * BLOCK)
    async with httpx.AsyncClient(timeout=120.0) as h:
        r = await h.put(f"{url}/admin/tenants/iso", json={"isolated": True},
                        headers=cluster.admin_headers())
        assert r.status_code == 200, r.text
        before = await _indexed(cluster)
        first = await _complete(h, url, "key-iso", prompt, cache_salt="client-chosen")
        assert _cached(first) == 0
        await until(lambda: _indexed(cluster), lambda n: n >= before + 6, interval=0.2,
                    what="the isolated tenant's blocks indexed")
        other = await _complete(h, url, "key-other", prompt)
        assert _cached(other) == 0  # vLLM did not serve it from the isolated tenant's blocks
        repeat = await _complete(h, url, "key-iso", prompt)
        assert _cached(repeat) >= 5 * BLOCK
        if PREDICTED_HEADER in repeat.headers:
            # vLLM recomputes the last token of a fully cached block-aligned prompt, so it
            # reports one block fewer than the router predicts (decision 0019); otherwise equal.
            assert int(repeat.headers[PREDICTED_HEADER]) - _cached(repeat) in (0, BLOCK)
