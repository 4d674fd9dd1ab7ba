"""The API surface beyond one prompt, one choice: ``n > 1``, several prompts on /v1/completions,
embeddings, tokenize/detokenize, the Responses API (stored-response affinity across replicas and
a replica SIGKILL) and Anthropic's Messages. A real nats-server, 2 router replicas and 2
simulated engines as real processes, over real sockets, with the official clients."""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
import pytest_asyncio

from launch.local_cluster import LocalCluster
from tests.integration.registered_cluster import (
    admin,
    registered_cluster,
    unsupervised_engine,
    workers,
)
from tests.waiting import until
from tokenization import tokens
from workers.generation import expected_tokens

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(180)]
MODEL = "jetrouter-sim"
NAMESPACE = "surface"


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def cluster(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[LocalCluster]:
    data = tmp_path_factory.mktemp("surface")
    # An engine is retired only once its load reports stopped AND its /health fails for
    # --worker-timeout: 5 s rather than the default 10 s, so the test that SIGKILLs an engine
    # waits half as long for its retirement; live engines still answer /health and stay.
    async with registered_cluster(Path(data), replicas=2, workers=2, namespace=NAMESPACE,
                                  router_args=["--worker-timeout", "5"],
                                  worker_args=["--num-gpu-blocks", "2048"]) as c:
        yield c


def clients(c: LocalCluster) -> list[openai.AsyncOpenAI]:
    return [openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
            for url in c.router_urls]


def expected_text(prompt: str | list[int], n: int) -> str:
    ids = tokens.encode(prompt) if isinstance(prompt, str) else prompt
    return tokens.decode(expected_tokens(ids, n))


# --- n > 1 ----------------------------------------------------------------------------------


async def test_n_choices_from_one_engine_chat_and_completions(cluster: LocalCluster) -> None:
    for client in clients(cluster):
        r = await client.completions.create(model=MODEL, prompt="tell me", max_tokens=5, n=3)
        assert sorted(c.index for c in r.choices) == [0, 1, 2]
        assert {c.text for c in r.choices} == {expected_text("tell me", 5)}
        assert r.usage is not None and r.usage.completion_tokens == 15
        messages = [{"role": "user", "content": "two answers please"}]
        chat = await client.chat.completions.create(model=MODEL, messages=messages,
                                                    max_tokens=4, n=2)
        want = tokens.decode(expected_tokens(tokens.encode(tokens.chat_prompt(messages)), 4))
        assert [c.index for c in chat.choices] == [0, 1]
        assert all(c.message.content == want for c in chat.choices)


async def test_n_choices_streamed(cluster: LocalCluster) -> None:
    client = clients(cluster)[1]
    texts: dict[int, str] = {}
    stream = await client.completions.create(model=MODEL, prompt="stream me", max_tokens=6, n=2,
                                             stream=True, stream_options={"include_usage": True})
    usage = None
    async for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
        usage = chunk.usage or usage
    assert texts == {0: expected_text("stream me", 6), 1: expected_text("stream me", 6)}
    assert usage is not None and usage.completion_tokens == 12
    deltas: dict[int, str] = {}
    chat = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hey"}], max_tokens=3, n=3,
        stream=True)
    async for chunk in chat:
        for c in chunk.choices:
            deltas[c.index] = deltas.get(c.index, "") + (c.delta.content or "")
    assert sorted(deltas) == [0, 1, 2] and len(set(deltas.values())) == 1


async def test_n_choices_stream_without_usage_still_records_the_engines_counts(
        cluster: LocalCluster) -> None:
    raw = await clients(cluster)[0].completions.with_raw_response.create(
        model=MODEL, prompt="quiet please", max_tokens=3, n=2, stream=True)
    chunks = [c async for c in raw.parse()]
    assert all(c.usage is None for c in chunks)  # not asked for, not sent
    assert sum(len(c.choices) for c in chunks) >= 6
    request_id = raw.headers["x-jetrouter-request-id"]
    async with httpx.AsyncClient(timeout=30) as h:
        row = await until(lambda: h.get(f"{cluster.router_urls[0]}/admin/requests/{request_id}",
                                         headers=admin(cluster)),
                          lambda r: r.status_code == 200 and r.json()["outcome"] == "ok")
    assert row.json()["output_tokens"] == 6  # the engine's usage, both choices


async def test_a_bad_n_is_a_400(cluster: LocalCluster) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        await clients(cluster)[0].completions.create(model=MODEL, prompt="x", max_tokens=2,
                                                     n=0)
    assert info.value.body["param"] == "n"  # type: ignore[index]


# --- several prompts on /v1/completions -----------------------------------------------------


async def test_batched_prompts_are_routed_apart_and_merged(cluster: LocalCluster) -> None:
    prompts = ["first prompt", "the second one", "and a third"]
    for client in clients(cluster):
        raw = await client.completions.with_raw_response.create(
            model=MODEL, prompt=prompts, max_tokens=4, n=2)
        r = raw.parse()
        assert len(raw.headers["x-jetrouter-request-id"].split(",")) == 3
        assert [c.index for c in r.choices] == list(range(6))
        for c in r.choices:
            assert c.text == expected_text(prompts[c.index // 2], 4)
        assert r.usage is not None and r.usage.completion_tokens == 24
        assert r.usage.prompt_tokens == sum(len(tokens.encode(p)) for p in prompts)
    ids = [[5, 6, 7, 8], [9, 10, 11]]
    r = await clients(cluster)[0].completions.create(model=MODEL, prompt=ids, max_tokens=3)
    assert [c.text for c in r.choices] == [expected_text(p, 3) for p in ids]


async def test_batched_prompts_streamed(cluster: LocalCluster) -> None:
    prompts = ["alpha beta", "gamma delta"]
    stream = await clients(cluster)[1].completions.create(
        model=MODEL, prompt=prompts, max_tokens=5, stream=True,
        stream_options={"include_usage": True})
    texts: dict[int, str] = {}
    ids: set[str] = set()
    usage = None
    async for chunk in stream:
        ids.add(chunk.id)
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
        usage = chunk.usage or usage
    assert texts == {0: expected_text(prompts[0], 5), 1: expected_text(prompts[1], 5)}
    assert len(ids) == 1
    assert usage is not None and usage.completion_tokens == 10


async def test_a_bad_prompt_in_a_batch_refuses_the_whole_request(cluster: LocalCluster) -> None:
    with pytest.raises(openai.BadRequestError):
        await clients(cluster)[0].completions.create(model=MODEL, prompt=["fine", ""],
                                                     max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        await clients(cluster)[1].completions.create(model="nope", prompt=["a", "b"],
                                                     max_tokens=2)


# --- embeddings -------------------------------------------------------------------------------


async def test_embeddings_through_both_replicas(cluster: LocalCluster) -> None:
    texts = ["an apple a day", "keeps the doctor away", "an apple a day"]
    results = []
    for client in clients(cluster):
        raw = await client.embeddings.with_raw_response.create(model=MODEL, input=texts)
        r = raw.parse()
        assert raw.headers["x-jetrouter-worker"] in await _worker_ids(cluster)
        assert [d.index for d in r.data] == [0, 1, 2]
        assert r.usage.prompt_tokens == sum(len(tokens.encode(t)) for t in texts)
        vectors = [d.embedding for d in r.data]
        assert vectors[0] == vectors[2] != vectors[1]  # deterministic per input
        assert abs(sum(v * v for v in vectors[0]) - 1.0) < 1e-4
        results.append(vectors)
    assert results[0] == results[1]  # whichever engine answered
    one = await clients(cluster)[0].embeddings.create(model=MODEL, input=[1, 2, 3],
                                                      encoding_format="float", dimensions=8)
    assert len(one.data) == 1 and len(one.data[0].embedding) == 8


async def _worker_ids(c: LocalCluster) -> set[str]:
    async with httpx.AsyncClient() as h:
        return set(await workers(h, c, c.router_urls[0]))


async def test_embeddings_do_not_chase_cached_blocks_and_free_their_load(
        cluster: LocalCluster) -> None:
    lure = list(range(300, 300 + 16 * 100))
    async with httpx.AsyncClient(timeout=30) as h:
        ws = await workers(h, cluster, cluster.router_urls[0])
        holder = sorted(ws)[0]
        r = await h.post(ws[holder]["url"] + "/v1/completions",
                         json={"model": MODEL, "prompt": lure, "max_tokens": 1})
        assert r.status_code == 200
        for url in cluster.router_urls:
            await until(lambda url=url: workers(h, cluster, url),
                        lambda ws: ws[holder]["cached_blocks"] >= 100)
        # A chat with that prefix goes where it is cached; an embedding of it does not care.
        for client in clients(cluster):
            raw = await client.completions.with_raw_response.create(
                model=MODEL, prompt=[*lure, 1], max_tokens=1)
            assert raw.headers["x-jetrouter-worker"] == holder
            raw = await client.embeddings.with_raw_response.create(model=MODEL, input=lure)
            assert raw.headers["x-jetrouter-worker"] != holder
        for url in cluster.router_urls:  # every decision's load is freed everywhere
            await until(lambda url=url: workers(h, cluster, url),
                        lambda ws: all(w["active_prefill_tokens"] == 0 for w in ws.values()))


async def test_embeddings_errors(cluster: LocalCluster) -> None:
    client = clients(cluster)[1]
    with pytest.raises(openai.NotFoundError):
        await client.embeddings.create(model="no-such-model", input="x")
    with pytest.raises(openai.BadRequestError) as info:
        await client.embeddings.create(model=MODEL, input=[])
    assert info.value.body["param"] == "input"  # type: ignore[index]


# --- tokenize / detokenize (forwarded: this cluster has no --model-path) ------------------------


async def test_tokenize_and_detokenize_forwarded_to_an_engine(cluster: LocalCluster) -> None:
    async with httpx.AsyncClient(timeout=30) as h:
        for url in cluster.router_urls:
            r = await h.post(url + "/tokenize", json={"model": MODEL, "prompt": "héllo"})
            assert r.status_code == 200, r.text
            assert r.json()["tokens"] == tokens.encode("héllo")
            assert r.json()["count"] == len(tokens.encode("héllo"))
            assert r.headers["x-jetrouter-worker"]  # an engine answered
            chat = await h.post(url + "/tokenize", json={
                "model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
            assert chat.json()["tokens"] == tokens.encode(
                tokens.chat_prompt([{"role": "user", "content": "hi"}]))
            back = await h.post(url + "/detokenize",
                                json={"model": MODEL, "tokens": r.json()["tokens"]})
            assert back.json() == {"prompt": "héllo"}
        missing = await h.post(cluster.router_urls[0] + "/tokenize",
                               json={"model": "nope", "prompt": "x"})
        assert missing.status_code == 404 and missing.json()["error"]["code"] == \
            "model_not_found"


# --- Anthropic Messages ------------------------------------------------------------------------


def anthropic_clients(c: LocalCluster) -> list[anthropic.AsyncAnthropic]:
    return [anthropic.AsyncAnthropic(base_url=url, api_key="x", max_retries=0)
            for url in c.router_urls]


async def test_messages_stream_and_not_through_both_replicas(cluster: LocalCluster) -> None:
    chat = [{"role": "system", "content": "be kind"}, {"role": "user", "content": "hi there"}]
    for client in anthropic_clients(cluster):
        m = await client.messages.create(model=MODEL, max_tokens=6, system="be kind",
                                         messages=[{"role": "user", "content": "hi there"}])
        assert m.content[0].type == "text" and m.content[0].text == chat_text(chat, 6)
        assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 6
        async with client.messages.stream(
                model=MODEL, max_tokens=4, system=[{"type": "text", "text": "be kind"}],
                messages=[{"role": "user", "content": [{"type": "text",
                                                        "text": "hi there"}]}]) as stream:
            text = "".join([t async for t in stream.text_stream])
            final = await stream.get_final_message()
        assert text == chat_text(chat, 4) and final.usage.output_tokens == 4
        count = await client.messages.count_tokens(
            model=MODEL, system="be kind", messages=[{"role": "user", "content": "hi there"}])
        assert count.input_tokens == len(tokens.encode(tokens.chat_prompt(chat)))


async def test_messages_are_routed_by_their_cached_prefix(cluster: LocalCluster) -> None:
    text = lure_text(41)
    async with httpx.AsyncClient(timeout=30) as h:
        holder = sorted(await workers(h, cluster, cluster.router_urls[0]))[1]
    await cache_chat_on(cluster, holder, text)
    for client in anthropic_clients(cluster):
        raw = await client.messages.with_raw_response.create(
            model=MODEL, max_tokens=2, messages=[{"role": "user", "content": text + " more"}])
        assert raw.headers["x-jetrouter-worker"] == holder


async def test_messages_errors_are_in_anthropics_shape(cluster: LocalCluster) -> None:
    client = anthropic_clients(cluster)[0]
    with pytest.raises(anthropic.BadRequestError) as info:
        await client.messages.create(model=MODEL, max_tokens=2, messages=[])
    assert info.value.body["type"] == "error"  # type: ignore[index]
    assert info.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    with pytest.raises(anthropic.NotFoundError) as missing:
        await client.messages.create(model="nope", max_tokens=2,
                                     messages=[{"role": "user", "content": "x"}])
    assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    async with httpx.AsyncClient(timeout=30) as h:
        r = await h.post(cluster.router_urls[1] + "/v1/messages", content=b"{not json")
        assert r.status_code == 400 and r.json()["type"] == "error"
        r = await h.post(cluster.router_urls[1] + "/v1/messages",
                         json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]


# --- the Responses API ------------------------------------------------------------------------


def chat_text(messages: list[dict[str, str]], n: int) -> str:
    return tokens.decode(expected_tokens(tokens.encode(tokens.chat_prompt(messages)), n))


def lure_text(start: int, blocks: int = 40) -> str:
    return "".join(chr(33 + (start + i) % 90) for i in range(16 * blocks))


async def cache_chat_on(c: LocalCluster, engine: str, text: str) -> None:
    """Put a user turn of ``text`` in ``engine``'s cache (sent to it directly), known to both
    replicas: KV routing would send a conversation starting with it there."""
    async with httpx.AsyncClient(timeout=30) as h:
        ws = await workers(h, c, c.router_urls[0])
        r = await h.post(ws[engine]["url"] + "/v1/chat/completions",
                         json={"model": MODEL, "max_tokens": 1,
                               "messages": [{"role": "user", "content": text}]})
        assert r.status_code == 200
        want = len(text) // 16 - 1
        for url in c.router_urls:
            await until(lambda url=url: workers(h, c, url),
                        lambda ws: ws[engine]["cached_blocks"] >= want)


async def lure_on_other_engine(c: LocalCluster, avoid: str, start: int) -> str:
    async with httpx.AsyncClient(timeout=30) as h:
        other = next(w for w in sorted(await workers(h, c, c.router_urls[0])) if w != avoid)
    text = lure_text(start)
    await cache_chat_on(c, other, text)
    return text


async def test_responses_stream_and_not_through_both_replicas(cluster: LocalCluster) -> None:
    messages = [{"role": "system", "content": "be terse"}, {"role": "user", "content": "hello"}]
    for client in clients(cluster):
        r = await client.responses.create(model=MODEL, instructions="be terse", input="hello",
                                          max_output_tokens=6)
        assert r.output_text == chat_text(messages, 6)
        assert r.usage is not None and r.usage.output_tokens == 6
        assert r.id.startswith("resp_")
        stream = await client.responses.create(model=MODEL, instructions="be terse",
                                               input="hello", max_output_tokens=5, stream=True)
        deltas, done = [], None
        async for ev in stream:
            if ev.type == "response.output_text.delta":
                deltas.append(ev.delta)
            elif ev.type == "response.completed":
                done = ev.response
        assert "".join(deltas) == chat_text(messages, 5)
        assert done is not None and done.output_text == "".join(deltas)


async def test_a_follow_up_lands_on_the_storing_engine_from_either_replica(
        cluster: LocalCluster) -> None:
    c0, c1 = clients(cluster)
    first = await c0.responses.with_raw_response.create(model=MODEL, input="remember 42",
                                                         max_output_tokens=3)
    home, first_id = first.headers["x-jetrouter-worker"], first.parse().id
    lure = await lure_on_other_engine(cluster, home, 7)
    previous = first_id
    for i, client in enumerate([c1, c0, c1]):
        stream = i == 2
        raw = await client.responses.with_raw_response.create(
            model=MODEL, input=f"{lure} what was it? {i}", previous_response_id=previous,
            max_output_tokens=3, stream=stream)
        assert raw.headers["x-jetrouter-worker"] == home
        if stream:
            events = [ev async for ev in raw.parse()]
            assert events[-1].type == "response.completed"
            previous = events[-1].response.id
        else:
            previous = raw.parse().id
    # Without previous_response_id the same prompt goes where its blocks are.
    raw = await c0.responses.with_raw_response.create(model=MODEL, input=f"{lure} fresh",
                                                       max_output_tokens=2)
    assert raw.headers["x-jetrouter-worker"] != home


async def test_unknown_and_unstored_previous_responses_are_404(cluster: LocalCluster) -> None:
    c0, c1 = clients(cluster)
    with pytest.raises(openai.NotFoundError) as info:
        await c0.responses.create(model=MODEL, input="x", previous_response_id="resp_nope")
    assert info.value.body["code"] == "previous_response_not_found"  # type: ignore[index]
    unstored = await c0.responses.create(model=MODEL, input="forget me", store=False,
                                         max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        await c1.responses.create(model=MODEL, input="y", previous_response_id=unstored.id)
    with pytest.raises(openai.BadRequestError):
        await c1.responses.create(model=MODEL, input=[])


async def test_a_follow_up_whose_engine_left_gets_a_clear_error(cluster: LocalCluster,
                                                                tmp_path: Path) -> None:
    """An engine outside the cluster's supervision (so it stays gone once stopped)."""
    urls = cluster.router_urls
    async with unsupervised_engine(cluster, "wr", tmp_path, "--num-gpu-blocks", "2048") as proc:
        async with httpx.AsyncClient(timeout=30) as h:
            for url in urls:
                await until(lambda url=url: workers(h, cluster, url), lambda ws: "wr" in ws)
            prompt = lure_text(5, blocks=60)
            await cache_chat_on(cluster, "wr", prompt)
            first = await clients(cluster)[0].responses.with_raw_response.create(
                model=MODEL, input=prompt, max_output_tokens=2)
            assert first.headers["x-jetrouter-worker"] == "wr"
            proc.send_signal(signal.SIGTERM)  # graceful: WorkerRetired first
            await proc.wait()
            for url in urls:
                await until(lambda url=url: workers(h, cluster, url), lambda ws: "wr" not in ws)
            for client in clients(cluster):
                with pytest.raises(openai.NotFoundError) as info:
                    await client.responses.create(model=MODEL, input="and then?",
                                                  previous_response_id=first.parse().id)
                err = info.value.body
                assert err["code"] == "previous_response_engine_gone"  # type: ignore[index]
                assert "wr" in err["message"]  # type: ignore[index]


async def test_an_engine_that_fails_before_answering_is_replaced(cluster: LocalCluster,
                                                               tmp_path: Path) -> None:
    """A verbatim-forwarded request (here an embedding) whose engine is dead but not yet
    retired moves to another engine before anything reached the client."""
    urls = cluster.router_urls
    async with unsupervised_engine(cluster, "wd", tmp_path, "--num-gpu-blocks", "2048") as proc:
        async with httpx.AsyncClient(timeout=30) as h:
            for url in urls:
                await until(lambda url=url: workers(h, cluster, url), lambda ws: "wd" in ws)
            proc.send_signal(signal.SIGKILL)  # no WorkerRetired: still registered for a while
            await proc.wait()
            # Its cache is the emptiest, so a load-balanced request with no load around picks it.
            raw = await clients(cluster)[0].embeddings.with_raw_response.create(
                model=MODEL, input="who is there?")
            assert raw.headers["x-jetrouter-worker"] != "wd"
            assert raw.headers["x-jetrouter-migrations"] == "1"
            assert len(raw.parse().data) == 1
            for url in urls:  # retired by the leader; the next tests see two engines again
                await until(lambda url=url: workers(h, cluster, url),
                            lambda ws: "wd" not in ws, timeout=90)


async def test_z_a_follow_up_survives_a_sigkill_of_the_replica_that_routed_it(
        cluster: LocalCluster) -> None:
    """Runs last (kills a replica; the cluster restarts it)."""
    c0, c1 = clients(cluster)
    first = await c0.responses.with_raw_response.create(model=MODEL, input="keep this",
                                                         max_output_tokens=2)
    home, first_id = first.headers["x-jetrouter-worker"], first.parse().id
    lure = await lure_on_other_engine(cluster, home, 23)
    pid = cluster.kill("r0", signal.SIGKILL)
    raw = await c1.responses.with_raw_response.create(
        model=MODEL, input=f"{lure} next", previous_response_id=first_id, max_output_tokens=2)
    assert raw.headers["x-jetrouter-worker"] == home
    second_id = raw.parse().id
    await until(lambda: cluster.processes.get("r0"), lambda p: p not in (None, pid),
                timeout=60, what="r0 to be restarted")
    await cluster.wait_ready(["r0"], timeout=90)
    async with httpx.AsyncClient(timeout=30) as h:
        state = (await h.get(cluster.router_urls[0] + "/admin/state",
                             headers=admin(cluster))).json()
        assert state["stored_responses"] >= 2
    for previous in (first_id, second_id):  # the restarted replica knows both from the stream
        raw = await c0.responses.with_raw_response.create(
            model=MODEL, input=f"{lure} again", previous_response_id=previous,
            max_output_tokens=2)
        assert raw.headers["x-jetrouter-worker"] == home
