"""/tokenize and /detokenize answered by the router itself when it has a model folder: the ids a
client sees are the ids the router routes by, equal to the engine's own. 2 replicas and 1
simulated engine given the same --model-path, as real processes over real sockets."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from launch.local_cluster import LocalCluster
from tests.integration.registered_cluster import registered_cluster
from tokenization.model_tokenizer import ModelTokenizer

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]
MODEL = "jetrouter-sim"


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def cluster(tmp_path_factory: pytest.TempPathFactory,
                  tiny_model: Path) -> AsyncIterator[LocalCluster]:
    data = tmp_path_factory.mktemp("tok-cluster")
    async with registered_cluster(Path(data), replicas=2, workers=1, namespace="tok",
                                  model_path=tiny_model) as c:
        yield c


async def test_the_router_tokenizes_with_its_own_model_folder(cluster: LocalCluster,
                                                              tiny_model: Path) -> None:
    tok = ModelTokenizer(tiny_model)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    async with httpx.AsyncClient(timeout=30) as h:
        engine = cluster.worker_urls[0]
        for url in cluster.router_urls:
            r = await h.post(url + "/tokenize", json={"model": MODEL, "prompt": "the cat sat"})
            assert r.status_code == 200, r.text
            assert "x-jetrouter-worker" not in r.headers  # no engine was asked
            assert r.json()["tokens"] == tok.encode_prompt("the cat sat")
            theirs = await h.post(engine + "/tokenize", json={"model": MODEL,
                                                              "prompt": "the cat sat"})
            assert r.json()["tokens"] == theirs.json()["tokens"]
            chat = await h.post(url + "/tokenize", json={"messages": messages})
            assert chat.json()["tokens"] == tok.encode_chat(messages, {})
            assert chat.json()["count"] == len(chat.json()["tokens"])
            back = await h.post(url + "/detokenize", json={"tokens": r.json()["tokens"]})
            assert back.json()["prompt"] == tok.decode(r.json()["tokens"])
        bad = await h.post(cluster.router_urls[0] + "/detokenize", json={"tokens": ["x"]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
        unknown = await h.post(cluster.router_urls[1] + "/tokenize",
                               json={"model": "nope", "prompt": "x"})
        assert unknown.status_code == 404
