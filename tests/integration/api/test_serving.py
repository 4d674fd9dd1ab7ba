"""The serving path end to end: 2 router replicas + 2 simulated workers as real processes,
driven over real sockets (the official openai client and httpx)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import nats
import openai
import pytest
import pytest_asyncio

from api.errors import SERVICE_UNAVAILABLE_BODY
from eventlog.events import RequestFinished
from eventlog.names import ROUTER, Names
from eventlog.reader import StreamReader
from launch.local_cluster import LocalCluster
from tests.integration.registered_cluster import admin, registered_cluster
from tests.waiting import until
from tokenization import tokens
from workers.generation import expected_tokens

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]
MODEL = "jetrouter-sim"


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def cluster(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[LocalCluster]:
    data = tmp_path_factory.mktemp("cluster")
    async with registered_cluster(Path(data), replicas=2, workers=2, namespace="srv",
                                  worker_args=["--num-gpu-blocks", "2048"]) as c:
        yield c




async def worker_load(h: httpx.AsyncClient, url: str, c: LocalCluster) -> dict[str, tuple]:
    r = await h.get(f"{url}/admin/workers", headers=admin(c))
    return {w["worker_id"]: (w["active_prefill_tokens"], w["active_decode_blocks"])
            for w in r.json()["workers"]}


def expected_text(prompt: str | list[int], n: int) -> str:
    ids = tokens.encode(prompt) if isinstance(prompt, str) else prompt
    return tokens.decode(expected_tokens(ids, n))


async def test_openai_client_completions_and_chat_stream_and_not(cluster: LocalCluster) -> None:
    client = openai.AsyncOpenAI(base_url=cluster.router_urls[0] + "/v1", api_key="x")
    text_prompt = "The quick brown fox jumps over the lazy dog. " * 3
    r = await client.completions.create(model=MODEL, prompt=text_prompt, max_tokens=12)
    assert r.choices[0].text == expected_text(text_prompt, 12)
    ids = list(range(40, 90))
    r = await client.completions.create(model=MODEL, prompt=ids, max_tokens=9)
    assert r.choices[0].text == expected_text(ids, 9)
    stream = await client.completions.create(model=MODEL, prompt=text_prompt, max_tokens=10,
                                             stream=True)
    assert "".join([c.choices[0].text async for c in stream if c.choices]) == \
        expected_text(text_prompt, 10)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    chat_ids = tokens.encode(tokens.chat_prompt(messages))
    r2 = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=7)
    assert r2.choices[0].message.content == tokens.decode(expected_tokens(chat_ids, 7))
    stream2 = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=7,
                                                   stream=True)
    parts = [c.choices[0].delta.content or "" async for c in stream2 if c.choices]
    assert "".join(parts) == tokens.decode(expected_tokens(chat_ids, 7))
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    raw = await client.completions.with_raw_response.create(model=MODEL, prompt="x", max_tokens=1)
    assert raw.headers["x-jetrouter-replica"] == "r0"
    assert raw.headers["x-jetrouter-worker"] in ("w0", "w1")


async def test_shared_prefix_sticks_to_its_worker_and_fresh_load_spreads(
        cluster: LocalCluster) -> None:
    client = openai.AsyncOpenAI(base_url=cluster.router_urls[0] + "/v1", api_key="x")
    prefix = list(range(1000, 1000 + 16 * 40))  # 40 blocks shared
    first = await client.completions.with_raw_response.create(
        model=MODEL, prompt=[*prefix, 1, 2, 3], max_tokens=2)
    home = first.headers["x-jetrouter-worker"]
    async with httpx.AsyncClient() as h:  # both replicas have seen the blocks stored
        for url in cluster.router_urls:
            await until(lambda url=url: h.get(f"{url}/admin/workers", headers=admin(cluster)),
                        lambda r: any(w["worker_id"] == home and w["cached_blocks"] >= 40
                                      for w in r.json()["workers"]))
    for i, url in enumerate(cluster.router_urls * 2):
        c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x")
        r = await c.completions.with_raw_response.create(
            model=MODEL, prompt=[*prefix, 7, i], max_tokens=2)
        assert r.headers["x-jetrouter-worker"] == home
    # Equal (empty) caches for two fresh long prompts held open concurrently: they spread.
    async with httpx.AsyncClient(timeout=30) as h:
        async with h.stream("POST", cluster.router_urls[0] + "/v1/completions",
                            json={"model": MODEL, "prompt": list(range(5000, 5800)),
                                  "max_tokens": 1500, "stream": True}) as a:
            wa = a.headers["x-jetrouter-worker"]
            # The other replica decides on what it has applied: wait until it sees wa loaded.
            await until(lambda: worker_load(h, cluster.router_urls[1], cluster),
                        lambda load: load.get(wa, (0, 0)) != (0, 0))
            r = await h.post(cluster.router_urls[1] + "/v1/completions",
                             json={"model": MODEL, "prompt": list(range(9000, 9800)),
                                   "max_tokens": 1})
            assert r.headers["x-jetrouter-worker"] != wa


async def test_load_routed_by_one_replica_shows_on_the_other_and_clears(
        cluster: LocalCluster) -> None:
    a, b = cluster.router_urls
    async with httpx.AsyncClient(timeout=30) as h:
        async with h.stream("POST", a + "/v1/completions",
                            json={"model": MODEL, "prompt": list(range(300, 700)),
                                  "max_tokens": 400, "stream": True}) as resp:
            worker = resp.headers["x-jetrouter-worker"]
            await until(lambda: worker_load(h, b, cluster), lambda load: load[worker][1] > 0)
            async for _ in resp.aiter_bytes():
                pass
        for url in (a, b):
            await until(lambda url=url: worker_load(h, url, cluster),
                        lambda load: all(v == (0, 0) for v in load.values()))


async def test_busy_threshold_set_on_one_replica_rejects_on_the_other(
        cluster: LocalCluster) -> None:
    a, b = cluster.router_urls
    async with httpx.AsyncClient(timeout=30) as h:
        r = await h.post(a + "/busy_threshold",
                         json={"model": MODEL, "active_decode_blocks_threshold": 0.0})
        assert r.status_code == 200, r.text
        assert r.json() == {"model": MODEL, "active_decode_blocks_threshold": 0.0,
                            "active_prefill_tokens_threshold": None}
        await until(lambda: h.get(b + "/busy_threshold"),
                    lambda r: r.json()["thresholds"] == [
                        {"model": MODEL, "active_decode_blocks_threshold": 0.0,
                         "active_prefill_tokens_threshold": None}])
        async with contextlib.AsyncExitStack() as stack:
            streams = []
            for i in range(2):  # one long request per worker makes every worker busy
                streams.append(await stack.enter_async_context(h.stream(
                    "POST", a + "/v1/completions",
                    json={"model": MODEL, "prompt": list(range(i * 999, i * 999 + 64)),
                          "max_tokens": 500, "stream": True})))
            assert [s.status_code for s in streams] == [200, 200]
            assert {s.headers["x-jetrouter-worker"] for s in streams} == {"w0", "w1"}
            await until(lambda: worker_load(h, b, cluster),
                        lambda load: all(v[1] > 0 for v in load.values()))
            before = _counter(await h.get(b + "/metrics"), "jetrouter_rejections_total")
            r = await h.post(b + "/v1/completions", json={"model": MODEL, "prompt": "hi",
                                                          "max_tokens": 1})
            assert r.status_code == 503
            assert r.json() == SERVICE_UNAVAILABLE_BODY
            after = _counter(await h.get(b + "/metrics"), "jetrouter_rejections_total")
            assert after == before + 1
        r = await h.post(a + "/busy_threshold", json={
            "model": MODEL, "active_decode_blocks_threshold": None})
        assert r.json()["active_decode_blocks_threshold"] is None


def _counter(resp: httpx.Response, name: str) -> float:
    total = 0.0
    for line in resp.text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def test_client_disconnect_mid_stream_frees_load_and_records_cancel(
        cluster: LocalCluster) -> None:
    a = cluster.router_urls[0]
    nc = await nats.connect(cluster.nats_url)
    names = Names("srv")
    try:
        async with httpx.AsyncClient(timeout=30) as h:
            async with h.stream("POST", a + "/v1/completions",
                                json={"model": MODEL, "prompt": list(range(20, 400)),
                                      "max_tokens": 1000, "stream": True}) as resp:
                async for _ in resp.aiter_bytes():
                    break  # first chunk seen: drop the connection mid-stream
            for url in cluster.router_urls:
                await until(lambda url=url: worker_load(h, url, cluster),
                            lambda load: all(v == (0, 0) for v in load.values()))
        js = nc.jetstream()
        reader = StreamReader(js, names.stream(ROUTER), start_seq=1)
        outcomes = []

        async def scan() -> None:
            async for _, batch in reader:
                outcomes.extend(e.outcome for e in batch if isinstance(e, RequestFinished))
                if "cancelled" in outcomes:
                    return

        await asyncio.wait_for(scan(), 20)
        await reader.close()
        assert "cancelled" in outcomes
    finally:
        await nc.close()


@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b'{"prompt": "hi"}', 400, "model"),
    ("/v1/completions", b'{"model": "jetrouter-sim", "prompt": "", "max_tokens": 3}', 400,
     "prompt"),
    ("/v1/completions", b'{"model": "jetrouter-sim", "prompt": "hi", "max_tokens": -1}', 400,
     "max_tokens"),
    ("/v1/completions", b'{"model": "jetrouter-sim", "prompt": "hi", "temperature": 9}', 400,
     "temperature"),
    ("/v1/chat/completions", b'{"model": "jetrouter-sim", "messages": []}', 400, "messages"),
    ("/v1/completions", b'{"model": "no-such-model", "prompt": "hi"}', 404, "model"),
])
async def test_bad_requests_get_openai_errors_and_the_replica_keeps_serving(
        cluster: LocalCluster, path: str, body: bytes, status: int, param: str | None) -> None:
    url = cluster.router_urls[1]
    async with httpx.AsyncClient(timeout=30) as h:
        r = await h.post(url + path, content=body, headers={"content-type": "application/json"})
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert set(err) >= {"message", "type", "param", "code"} and err["message"]
        if param:
            assert err["param"] == param
        ok = await h.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi",
                                                         "max_tokens": 1})
        assert ok.status_code == 200


async def test_prompt_over_the_limit_is_413(cluster: LocalCluster) -> None:
    async with httpx.AsyncClient(timeout=30) as h:
        r = await h.post(cluster.router_urls[0] + "/v1/completions",
                         json={"model": MODEL, "prompt": [1] * 131073, "max_tokens": 1})
        assert r.status_code == 413
        assert r.json()["error"]["code"] == "prompt_too_long"


async def test_worker_crash_mid_stream_gives_a_clean_error_and_frees_load(
        cluster: LocalCluster) -> None:
    """Runs last in this module: it kills a worker (the cluster restarts it)."""
    a = cluster.router_urls[0]
    async with httpx.AsyncClient(timeout=30) as h:
        for w in cluster.worker_urls:
            r = await h.post(w + "/fault", json={"action": "crash_after_tokens", "n": 5})
            assert r.status_code == 200
        client = openai.AsyncOpenAI(base_url=a + "/v1", api_key="x", max_retries=0)
        got: list[str] = []
        with pytest.raises(openai.APIError):
            stream = await client.completions.create(model=MODEL, prompt="crash me",
                                                     max_tokens=50, stream=True)
            async for chunk in stream:
                got.extend(c.text for c in chunk.choices)
        assert 0 < len("".join(got)) <= 5 * len(cluster.worker_urls)  # every hop crashed
        for url in cluster.router_urls:
            await until(lambda url=url: worker_load(h, url, cluster),
                        lambda load: all(v == (0, 0) for v in load.values()))
        for w in cluster.worker_urls:  # disarm the worker that did not crash
            with contextlib.suppress(httpx.HTTPError):
                await h.post(w + "/fault", json={"action": "clear"})
