"""One model folder on both sides, end to end: 2 replicas + 2 simulated engines as real
processes given the same `--model-path` (a tokenizer trained offline, workers/tinymodel.py).

What it proves: the engine's own token ids for a chat request hash to exactly the blocks the
router recorded in its decision; a second request sharing a prefix, sent through the *other*
replica, lands on the engine holding that prefix, which reports `cached_tokens` > 0; and every
decision's ledger row carries the predicted reuse beside the engine-reported one. An engine
started with another block size is refused: logged, listed with its reason, never routed to.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio

from eventlog.events import RequestRouted
from eventlog.hashing import prompt_hashes
from eventlog.names import ROUTER, Names
from eventlog.reader import StreamReader
from launch.local_cluster import LocalCluster
from tests.integration.registered_cluster import (
    admin,
    registered_cluster,
    unsupervised_engine,
    workers,
)
from tests.waiting import until
from tokenization.model_tokenizer import ModelTokenizer
from workers.tinymodel import WORDS

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]
MODEL = "jetrouter-sim"
BLOCK = 16
NAMESPACE = "mdl"


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def cluster(tmp_path_factory: pytest.TempPathFactory,
                  tiny_model: Path) -> AsyncIterator[LocalCluster]:
    data = tmp_path_factory.mktemp("model-cluster")
    async with registered_cluster(Path(data), replicas=2, workers=2, namespace=NAMESPACE,
                                  model_path=tiny_model,
                                  router_args=["--kv-cache-block-size", str(BLOCK)],
                                  worker_args=["--num-gpu-blocks", "2048",
                                               "--kv-cache-block-size", str(BLOCK)]) as c:
        yield c


async def ledger_row(h: httpx.AsyncClient, c: LocalCluster, url: str,
                     request_id: str) -> dict[str, Any] | None:
    r = await h.get(f"{url}/admin/requests/{request_id}", headers=admin(c))
    return r.json() if r.status_code == 200 else None


def text(n_words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


async def routed_event(c: LocalCluster, request_id: str) -> RequestRouted:
    import nats

    nc = await nats.connect(c.nats_url)
    try:
        reader = StreamReader(nc.jetstream(), Names(NAMESPACE).stream(ROUTER), start_seq=1)
        try:
            async def scan() -> RequestRouted:
                async for _, batch in reader:
                    for e in batch:
                        if isinstance(e, RequestRouted) and e.request_id == request_id:
                            return e
                raise AssertionError("stream ended")

            return await asyncio.wait_for(scan(), 30)
        finally:
            await reader.close()
    finally:
        await nc.close()


async def wait_indexed(h: httpx.AsyncClient, c: LocalCluster, worker_id: str) -> None:
    """Every replica has applied the engine's KV events for what it cached so far."""
    for url in c.router_urls:
        await until(lambda url=url: workers(h, c, url),
                    lambda ws: ws[worker_id]["cached_blocks"] > 0, timeout=30)


async def test_shared_prefix_through_the_other_replica_is_predicted_and_reused(
        cluster: LocalCluster) -> None:
    prefix = text(160, seed=1)  # ~160 tokens: ten 16-token blocks
    first = {"model": MODEL, "prompt": prefix + " first question", "max_tokens": 4}
    second = {"model": MODEL, "prompt": prefix + " another question here", "max_tokens": 4}
    a, b = cluster.router_urls
    async with httpx.AsyncClient(timeout=30) as h:
        r1 = await h.post(f"{a}/v1/completions", json=first)
        assert r1.status_code == 200, r1.text
        worker = r1.headers["x-jetrouter-worker"]
        assert r1.headers["x-jetrouter-predicted-cached-tokens"] == "0"
        assert r1.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        await wait_indexed(h, cluster, worker)

        r2 = await h.post(f"{b}/v1/completions", json=second)
        assert r2.status_code == 200, r2.text
        assert r2.headers["x-jetrouter-worker"] == worker
        cached = r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        predicted = int(r2.headers["x-jetrouter-predicted-cached-tokens"])
        tok = ModelTokenizer(cluster_model(cluster))
        shared = common_prefix(tok.encode_prompt(first["prompt"]),
                               tok.encode_prompt(second["prompt"]))
        assert cached > 0 and cached == predicted == shared // BLOCK * BLOCK

        # Every replica's ledger has the row with both figures (projections are replicated).
        rid = r2.headers["x-jetrouter-request-id"]
        for url in cluster.router_urls:
            row = await until(lambda url=url: ledger_row(h, cluster, url, rid),
                              lambda row: row is not None and row["cached_tokens"] is not None)
            assert row["predicted_tokens"] == predicted and row["cached_tokens"] == cached
        row1 = await until(lambda: ledger_row(h, cluster, a, r1.headers["x-jetrouter-request-id"]),
                           lambda row: row is not None and row["cached_tokens"] is not None)
        assert (row1["predicted_tokens"], row1["cached_tokens"]) == (0, 0)

        metrics = (await h.get(f"{b}/metrics")).text
        assert "jetrouter_kv_prediction_error_tokens_count" in metrics


async def test_chat_hashes_like_the_engine_and_the_next_turn_reuses_it(
        cluster: LocalCluster) -> None:
    tok = ModelTokenizer(cluster_model(cluster))
    messages = [{"role": "system", "content": text(120, seed=2)},
                {"role": "user", "content": "which engine holds this conversation?"}]
    a, b = cluster.router_urls
    async with httpx.AsyncClient(timeout=30) as h:
        # Streaming, without asking for usage: the engine echoes the ids it computed (vLLM's
        # return_token_ids) and the client sees no usage chunk.
        body = {"model": MODEL, "messages": messages, "max_tokens": 4, "stream": True,
                "return_token_ids": True}
        engine_ids: list[int] | None = None
        usage_seen = False
        async with h.stream("POST", f"{a}/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            rid = r.headers["x-jetrouter-request-id"]
            worker = r.headers["x-jetrouter-worker"]
            async for line in r.aiter_lines():
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                usage_seen |= "usage" in chunk
                for choice in chunk.get("choices") or ():
                    if "prompt_token_ids" in choice:
                        engine_ids = choice["prompt_token_ids"]
        assert not usage_seen
        assert engine_ids == tok.encode_chat(messages)
        routed = await routed_event(cluster, rid)
        assert routed.isl_tokens == len(engine_ids)
        assert routed.block_seq_hashes == prompt_hashes(engine_ids, BLOCK)
        # The router still asked the engine for usage: the row has the engine's figure.
        row = await until(lambda: ledger_row(h, cluster, a, rid),
                          lambda row: row is not None and row["cached_tokens"] is not None)
        assert row["cached_tokens"] == 0
        await wait_indexed(h, cluster, worker)

        turn2 = [*messages, {"role": "assistant", "content": "the first one"},
                 {"role": "user", "content": "and the next turn?"}]
        r2 = await h.post(f"{b}/v1/chat/completions",
                          json={"model": MODEL, "messages": turn2, "max_tokens": 4})
        assert r2.status_code == 200, r2.text
        assert r2.headers["x-jetrouter-worker"] == worker
        cached = r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= 6 * BLOCK  # the system prompt's blocks at least
        assert int(r2.headers["x-jetrouter-predicted-cached-tokens"]) == cached


async def test_a_worker_with_another_block_size_is_refused_visibly(
        cluster: LocalCluster, tmp_path: Path) -> None:
    async with unsupervised_engine(cluster, "wbad", tmp_path,
                                   "--kv-cache-block-size", str(2 * BLOCK),
                                   "--model-path", str(cluster_model(cluster))):
        async with httpx.AsyncClient(timeout=30) as h:
            for url in cluster.router_urls:
                ws = await until(lambda url=url: workers(h, cluster, url),
                                 lambda ws: "wbad" in ws, timeout=60)
                assert ws["wbad"]["status"] == "refused"
                assert ws["wbad"]["reason"] == (
                    f"block size {2 * BLOCK} differs from the router's --kv-cache-block-size "
                    f"{BLOCK}")
                assert all(w["status"] == "ok" for k, w in ws.items() if k != "wbad")
            for i in range(6):  # never routed to, whichever replica decides
                r = await h.post(f"{cluster.router_urls[i % 2]}/v1/completions",
                                 json={"model": MODEL, "prompt": text(40, seed=10 + i),
                                       "max_tokens": 2})
                assert r.status_code == 200 and r.headers["x-jetrouter-worker"] != "wbad"
        replica_log = cluster.data_dir / "logs" / "r0.log"
        await until(lambda: replica_log.read_text(), lambda t: "worker wbad" in t)
        line = next(x for x in replica_log.read_text().splitlines() if "worker wbad" in x)
        assert "refused: block size 32 differs from the router's --kv-cache-block-size 16" in line


def cluster_model(cluster: LocalCluster) -> Path:
    args = cluster.router_args
    return Path(args[args.index("--model-path") + 1])


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
