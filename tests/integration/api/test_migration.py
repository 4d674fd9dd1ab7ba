"""Request migration end to end (``api/forward/``): 1 router replica + 3 simulated engines as real
processes; faults injected with the engines' ``/fault``; clients are the official openai client
and httpx over real sockets.

Each fault test first pins its prompt to one engine: a warm-up request caches an 8-block prefix on
some engine ("home"), and once the replica has seen those blocks the real request (same prefix)
is routed there by KV overlap. The fault is then armed on home only.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import nats
import openai
import pytest
import pytest_asyncio

from api.forward import Forwarder
from api.forward.continuation import Continuation, Hop
from api.forward.engine import HopFailed, SseSplitter
from api.metrics import RouterMetrics
from api.openai_schema import parse_request
from api.tokenizer import ByteTokenizer
from eventlog.events import RequestFinished
from eventlog.names import ROUTER, Names
from eventlog.reader import StreamReader
from launch.local_cluster import LocalCluster
from tests.waiting import until
from tokenization import tokens
from workers.generation import expected_tokens

pytestmark = [pytest.mark.timeout(120)]
cluster_test = pytest.mark.asyncio(loop_scope="module")
MODEL = "jetrouter-sim"
NS = "mig"
PREFIX_BLOCKS = 8


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def cluster(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[LocalCluster]:
    data = tmp_path_factory.mktemp("migration")
    with pytest.MonkeyPatch.context() as mp:
        # Read by the Forwarder (and, once `serve` has the flags, by the CLI as well).
        mp.setenv("JETROUTER_STREAM_IDLE_TIMEOUT", "1")
        mp.setenv("JETROUTER_MIGRATION_LIMIT", "2")
        # Canaries off: the failures injected here would otherwise (rightly) mark engines
        # unhealthy through passive reports and change which engines later tests can use.
        async with LocalCluster(replicas=1, workers=3, data_dir=Path(data), namespace=NS,
                                router_args=["--canary-interval", "0"],
                                worker_args=["--num-gpu-blocks", "2048"]) as c:
            async with httpx.AsyncClient() as h:
                await until(lambda: workers(h, c), lambda ws: len(ws) == 3)
            yield c


# --- helpers ---------------------------------------------------------------------------------




def admin(c: LocalCluster) -> dict[str, str]:
    return {"authorization": f"Bearer {c.admin_token}"}


async def workers(h: httpx.AsyncClient, c: LocalCluster) -> dict[str, dict[str, Any]]:
    r = await h.get(f"{c.router_urls[0]}/admin/workers", headers=admin(c))
    return {w["worker_id"]: w for w in r.json()["workers"]}


def worker_url(c: LocalCluster, worker_id: str) -> str:
    return c.children[worker_id].url


async def fault(h: httpx.AsyncClient, c: LocalCluster, worker_id: str, **body: Any) -> None:
    r = await h.post(worker_url(c, worker_id) + "/fault", json=body)
    assert r.status_code == 200, r.text


async def migrations(h: httpx.AsyncClient, c: LocalCluster) -> dict[str, float]:
    text = (await h.get(c.router_urls[0] + "/metrics")).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("jetrouter_migrations_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            out[reason] = float(line.rsplit(" ", 1)[1])
    return out


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


async def load_freed(h: httpx.AsyncClient, c: LocalCluster) -> None:
    await until(lambda: workers(h, c),
                lambda ws: all(w["active_prefill_tokens"] == 0 and w["active_decode_blocks"] == 0
                               for w in ws.values()))


async def pin(h: httpx.AsyncClient, c: LocalCluster, prefix: list[int]) -> str:
    """Cache `prefix` on some engine and wait until the replica knows it; returns that engine."""
    before = await workers(h, c)
    r = await h.post(c.router_urls[0] + "/v1/completions",
                     json={"model": MODEL, "prompt": [*prefix, 7], "max_tokens": 1})
    assert r.status_code == 200, r.text
    home = r.headers["x-jetrouter-worker"]
    want = before[home]["cached_blocks"] + PREFIX_BLOCKS
    await until(lambda: workers(h, c), lambda ws: ws[home]["cached_blocks"] >= want)
    return home


async def healthy_again(h: httpx.AsyncClient, c: LocalCluster, worker_id: str) -> None:
    """A crashed engine is restarted by the cluster: wait for it before the next test."""
    await until(lambda: h.get(worker_url(c, worker_id) + "/health"),
                lambda r: r.status_code == 200, timeout=30, tolerate=(httpx.HTTPError,))
    await until(lambda: workers(h, c), lambda ws: worker_id in ws)


async def refused(url: str) -> bool:
    """True once nothing listens at ``url``'s port any more."""
    parsed = httpx.URL(url)
    try:
        _, writer = await asyncio.open_connection(parsed.host, parsed.port)
    except ConnectionRefusedError:
        return True
    writer.close()
    return False


async def finished_outcomes(c: LocalCluster, base_id: str) -> dict[str, str]:
    """request id -> outcome of every RequestFinished for `base_id` and its hops."""
    nc = await nats.connect(c.nats_url)
    out: dict[str, str] = {}
    try:
        reader = StreamReader(nc.jetstream(), Names(NS).stream(ROUTER), start_seq=1)

        async def scan() -> None:
            async for _, batch in reader:
                for e in batch:
                    if isinstance(e, RequestFinished) and e.request_id.split("~")[0] == base_id:
                        out[e.request_id] = e.outcome
                if reader.pending == 0:
                    return

        await asyncio.wait_for(scan(), 20)
        await reader.close()
    finally:
        await nc.close()
    return out


def expected_text(ids: list[int], n: int) -> str:
    return tokens.decode(expected_tokens(ids, n))


def oai(c: LocalCluster) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=c.router_urls[0] + "/v1", api_key="x", max_retries=0)


# --- the engine crashes mid-stream ---------------------------------------------------------------


@cluster_test
async def test_completion_stream_continues_on_another_engine_after_a_crash(
        cluster: LocalCluster) -> None:
    prefix = [1000 + i for i in range(16 * PREFIX_BLOCKS)]
    prompt = [*prefix, 11, 12, 13]
    async with httpx.AsyncClient(timeout=30) as h:
        home = await pin(h, cluster, prefix)
        before = await migrations(h, cluster)
        await fault(h, cluster, home, action="crash_after_tokens", n=5)
        stream = await oai(cluster).completions.create(
            model=MODEL, prompt=prompt, max_tokens=40, stream=True,
            stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == expected_text(prompt, 40)
        assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        usage = chunks[-1].usage
        assert usage is not None and usage.completion_tokens == 40
        assert usage.prompt_tokens == len(prompt)
        assert delta(await migrations(h, cluster), before) == {"stream_error": 1.0}
        base_id = chunks[0].id.removeprefix("cmpl-")
        outcomes = await until(lambda: finished_outcomes(cluster, base_id), lambda o: len(o) == 2)
        assert outcomes == {base_id: "migrated", f"{base_id}~1": "ok"}
        await load_freed(h, cluster)
        await healthy_again(h, cluster, home)


@cluster_test
async def test_chat_stream_continues_on_another_engine_after_a_crash(
        cluster: LocalCluster) -> None:
    system = "You are the migration test. " * 8  # > 8 blocks shared with the warm-up
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "go on"}]
    prompt = tokens.encode(tokens.chat_prompt(messages))
    async with httpx.AsyncClient(timeout=30) as h:
        home = await pin(h, cluster, prompt[: 16 * PREFIX_BLOCKS])
        await fault(h, cluster, home, action="crash_after_tokens", n=7)
        stream = await oai(cluster).chat.completions.create(
            model=MODEL, messages=messages, max_tokens=30, stream=True)  # type: ignore[arg-type]
        chunks = [chunk async for chunk in stream]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == expected_text(prompt, 30)
        assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
        assert {c.object for c in chunks} == {"chat.completion.chunk"}
        assert chunks[0].choices[0].delta.role == "assistant"
        assert sum(1 for c in chunks if c.choices and c.choices[0].delta.role) == 1
        await load_freed(h, cluster)
        await healthy_again(h, cluster, home)


@cluster_test
async def test_non_streaming_request_is_retried_and_answered_whole(
        cluster: LocalCluster) -> None:
    prefix = [3000 + i for i in range(16 * PREFIX_BLOCKS)]
    prompt = [*prefix, 5]
    async with httpx.AsyncClient(timeout=30) as h:
        home = await pin(h, cluster, prefix)
        before = await migrations(h, cluster)
        await fault(h, cluster, home, action="crash_after_tokens", n=4)
        r = await oai(cluster).completions.create(model=MODEL, prompt=prompt, max_tokens=25)
        assert r.choices[0].text == expected_text(prompt, 25)
        assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
        assert r.usage is not None and r.usage.completion_tokens == 25
        assert sum(delta(await migrations(h, cluster), before).values()) == 1
        await load_freed(h, cluster)
        await healthy_again(h, cluster, home)


@cluster_test
async def test_refused_connection_migrates_before_the_stream_starts(
        cluster: LocalCluster) -> None:
    prefix = [4000 + i for i in range(16 * PREFIX_BLOCKS)]
    prompt = [*prefix, 9]
    async with httpx.AsyncClient(timeout=30) as h:
        home = await pin(h, cluster, prefix)
        before = await migrations(h, cluster)
        with pytest.raises(httpx.HTTPError):  # the engine dies at once (its reply never comes)
            await h.post(worker_url(cluster, home) + "/fault", json={"action": "crash"})
        try:
            # The client's connection can be reset a moment before the dying process's listening
            # socket is closed (on a busy machine, long enough for a connect to get through):
            # wait until the port refuses. The cluster restarts it after >= 0.5 s.
            await until(lambda: refused(worker_url(cluster, home)), timeout=10)
            r = await h.post(cluster.router_urls[0] + "/v1/completions",
                             json={"model": MODEL, "prompt": prompt, "max_tokens": 12})
            assert r.status_code == 200, r.text
            assert r.headers["x-jetrouter-worker"] != home
            assert r.headers["x-jetrouter-migrations"] == "1"
            assert r.json()["choices"][0]["text"] == expected_text(prompt, 12)
            assert delta(await migrations(h, cluster), before) == {"connect_error": 1.0}
            await load_freed(h, cluster)
        finally:  # the next tests need all three engines, whatever happened here
            await healthy_again(h, cluster, home)


# --- the engine hangs ---------------------------------------------------------------------------


@cluster_test
async def test_engine_hanging_mid_stream_is_left_after_the_idle_timeout(
        cluster: LocalCluster) -> None:
    prefix = [5000 + i for i in range(16 * PREFIX_BLOCKS)]
    prompt = [*prefix, 1, 2]
    async with httpx.AsyncClient(timeout=30) as h:
        home = await pin(h, cluster, prefix)
        before = await migrations(h, cluster)
        stream = await oai(cluster).completions.create(model=MODEL, prompt=prompt,
                                                       max_tokens=150, stream=True)
        parts: list[str] = []
        try:
            async for chunk in stream:
                parts.extend(c.text for c in chunk.choices)
                if len(parts) == 5:  # ~8 ms per token: 145 tokens are still to come
                    await fault(h, cluster, home, action="hang")
        finally:
            await fault(h, cluster, home, action="clear")
        assert "".join(parts) == expected_text(prompt, 150)
        assert delta(await migrations(h, cluster), before) == {"idle_timeout": 1.0}
        await load_freed(h, cluster)


# --- not migrated / given up ------------------------------------------------------------------


@cluster_test
async def test_a_4xx_from_the_engine_is_passed_on_not_migrated(cluster: LocalCluster) -> None:
    async with httpx.AsyncClient(timeout=30) as h:
        before = await migrations(h, cluster)
        for stream in (False, True):  # prompt + max_tokens can never fit in the engine's cache
            r = await h.post(cluster.router_urls[0] + "/v1/completions",
                             json={"model": MODEL, "prompt": "too long an answer",
                                   "max_tokens": 10_000_000, "stream": stream})
            assert r.status_code == 400, r.text
            assert "exceeds the KV cache" in r.json()["error"]["message"]
        assert delta(await migrations(h, cluster), before) == {}
        await load_freed(h, cluster)


@cluster_test
async def test_migration_limit_reached_ends_the_stream_with_a_clean_error(
        cluster: LocalCluster) -> None:
    ids = [n for n, ch in cluster.children.items() if ch.kind == "worker"]
    async with httpx.AsyncClient(timeout=30) as h:
        before = await migrations(h, cluster)
        for w in ids:
            await fault(h, cluster, w, action="hang")
        try:
            async with h.stream("POST", cluster.router_urls[0] + "/v1/completions",
                                json={"model": MODEL, "prompt": "nobody answers",
                                      "max_tokens": 20, "stream": True}) as r:
                assert r.status_code == 200
                body = (await r.aread()).decode()
        finally:
            for w in ids:
                await fault(h, cluster, w, action="clear")
        events = [e for e in body.split("\n\n") if e]
        assert events[-1] == "data: [DONE]"
        assert len(events) == 2 and '"error"' in events[0]
        assert "migration limit (2)" in events[0]
        assert delta(await migrations(h, cluster), before) == {"idle_timeout": 2.0}
        await load_freed(h, cluster)


# --- the pure bookkeeping (no processes) -------------------------------------------------------


def _continuation(body: bytes, endpoint: str = "chat") -> Continuation:
    parsed = parse_request(endpoint, body, ByteTokenizer(), max_prompt_tokens=1000)
    return Continuation(parsed, body, ByteTokenizer().encode)


def _hop(c: Continuation, verbatim: bool) -> Hop:
    hop = Hop(routed=None, verbatim=verbatim)  # type: ignore[arg-type]
    c.hops.append(hop)
    return hop


def test_a_chat_request_continues_as_a_token_id_completion_in_the_chat_shape() -> None:
    body = (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10,'
            b' "stream": true, "temperature": 0.5, "tools": []}')
    c = _continuation(body)
    # Verbatim, except that usage is asked for: its cached_tokens is recorded per request.
    assert c.plan().verbatim and json.loads(c.plan().body) == {
        **json.loads(body), "stream_options": {"include_usage": True}}
    asked = body[:-1] + b', "stream_options": {"include_usage": true}}'
    assert _continuation(asked).plan().body == asked  # already asked for: sent untouched
    first = _hop(c, True)
    raw = (b'data: {"id":"chatcmpl-a","object":"chat.completion.chunk","created":7,"model":"m",'
           b'"choices":[{"index":0,"delta":{"role":"assistant","content":"ab"}}]}\n\n')
    out, token = c.on_event(first, raw, raw[6:-2])
    assert out == raw and token
    plan = c.plan()
    assert not plan.verbatim and plan.path == "/v1/completions"
    sent = msgspec.json.decode(plan.body)
    assert sent["prompt"] == [*c.parsed.prompt_ids, ord("a"), ord("b")]
    assert sent["max_tokens"] == 8 and sent["temperature"] == 0.5 and "tools" not in sent
    second = _hop(c, False)
    up = b'{"id":"cmpl-z","object":"text_completion","created":9,"choices":[{"text":"c"}]}'
    out, token = c.on_event(second, b"", up)
    assert token and out is not None
    chunk = msgspec.json.decode(out[6:])
    assert (chunk["id"], chunk["created"], chunk["object"]) == ("chatcmpl-a", 7,
                                                               "chat.completion.chunk")
    assert chunk["choices"][0]["delta"] == {"content": "c"}
    with pytest.raises(HopFailed):
        c.on_event(second, b"", b'{"error": {"message": "boom"}}')


def test_tail_reports_usage_over_every_hop_and_closes_a_spent_budget() -> None:
    body = b'{"model": "m", "prompt": "xyz", "max_tokens": 2, "stream": true, ' \
           b'"stream_options": {"include_usage": true}}'
    c = _continuation(body, "completions")
    for i, verbatim in enumerate((True, False)):
        hop = _hop(c, verbatim)
        c.on_event(hop, b"data: x\n\n", b'{"id":"cmpl-q","created":1,"choices":[{"text":"%d"}]}'
                   % i)
    assert c.complete and c.finish_reason is None  # the budget is spent, no finish chunk came
    events = [e for e in c.tail().split(b"\n\n") if e]
    assert b'"finish_reason":"length"' in events[0]
    assert b'"completion_tokens":2' in events[1] and b'"prompt_tokens":3' in events[1]
    assert events[2] == b"data: [DONE]"


def test_sse_splitter_only_yields_whole_events() -> None:
    s = SseSplitter()
    assert s.feed(b"data: {\"a\":1}\n\ndata: {\"b\"") == [(b"data: {\"a\":1}\n\n", b"{\"a\":1}")]
    assert s.feed(b":2}\r\n\r\n") == [(b"data: {\"b\":2}\n\n", b"{\"b\":2}")]


async def test_forwarder_settings_come_from_the_environment_and_hooks_may_be_async(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JETROUTER_STREAM_IDLE_TIMEOUT", "1.5")
    monkeypatch.setenv("JETROUTER_MIGRATION_LIMIT", "5")
    seen: list[tuple[str, str]] = []

    async def hook(worker_id: str, reason: str) -> None:
        seen.append((worker_id, reason))

    fw = Forwarder(None, RouterMetrics(), on_worker_failure=hook)  # type: ignore[arg-type]
    assert (fw.stream_idle_timeout, fw.migration_limit) == (1.5, 5)
    assert Forwarder(None, RouterMetrics(),  # type: ignore[arg-type]
                     migration_limit=0).migration_limit == 0
    fw.report_failure("w9", "idle_timeout")
    await asyncio.wait_for(asyncio.gather(*fw._reports), 5)
    assert seen == [("w9", "idle_timeout")]
