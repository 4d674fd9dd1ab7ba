"""The simulated worker over real HTTP (a child process, no NATS), driven with the openai client."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.waiting import until
from tokenization.tokens import chat_prompt, decode, encode
from workers.faults import CRASH_EXIT_CODE
from workers.generation import expected_tokens
from workers.procs import WorkerProcess

FAST = ["--speedup-ratio", "20", "--num-gpu-blocks", "512"]


@pytest.fixture(scope="module")
def worker() -> Iterator[WorkerProcess]:
    with WorkerProcess([*FAST, "--worker-id", "http-w"]) as proc:
        yield proc


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=20)


def expected_text(prompt: str | list[int], n: int) -> str:
    ids = encode(prompt) if isinstance(prompt, str) else prompt
    return decode(expected_tokens(ids, n))


async def test_completion_text_usage_and_prefix_cache(worker: WorkerProcess) -> None:
    prompt = "The simulated engine caches every full block of this prompt. " * 3
    c = client(worker.url)
    first = await c.completions.create(model="jetrouter-sim", prompt=prompt, max_tokens=12)
    assert first.choices[0].text == expected_text(prompt, 12)
    assert first.choices[0].finish_reason == "length"
    assert first.usage is not None
    assert (first.usage.prompt_tokens, first.usage.completion_tokens) == (len(prompt), 12)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = await c.completions.create(model="jetrouter-sim", prompt=prompt, max_tokens=12)
    assert again.choices[0].text == first.choices[0].text
    assert again.usage.prompt_tokens_details.cached_tokens == len(prompt) // 16 * 16


async def test_streaming_completion_with_usage(worker: WorkerProcess) -> None:
    prompt = "stream me some tokens"
    stream = await client(worker.url).completions.create(
        model="jetrouter-sim", prompt=prompt, max_tokens=9, stream=True,
        stream_options={"include_usage": True})
    texts, usage, finish = [], None, None
    async for chunk in stream:
        if chunk.choices:
            texts.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage
    assert "".join(texts) == expected_text(prompt, 9)
    assert finish == "length"
    assert usage is not None and usage.completion_tokens == 9
    assert usage.prompt_tokens == len(prompt)


async def test_token_id_prompts_including_large_ids(worker: WorkerProcess) -> None:
    ids = [1, 70000, 2**32 - 1, *range(40)]
    c = client(worker.url)
    out = await c.completions.create(model="jetrouter-sim", prompt=ids, max_tokens=7)
    assert out.choices[0].text == expected_text(ids, 7)
    wrapped = await c.completions.create(model="jetrouter-sim", prompt=[ids], max_tokens=7)
    assert wrapped.choices[0].text == out.choices[0].text


async def test_chat_stream_and_non_stream(worker: WorkerProcess) -> None:
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Say something."}]
    c = client(worker.url)
    want = expected_text(chat_prompt(messages), 11)
    full = await c.chat.completions.create(model="jetrouter-sim", messages=messages,
                                           max_tokens=11)
    assert full.choices[0].message.content == want
    assert full.usage is not None and full.usage.prompt_tokens == len(chat_prompt(messages))
    stream = await c.chat.completions.create(model="jetrouter-sim", messages=messages,
                                             max_tokens=11, stream=True)
    parts = [ch.choices[0].delta.content or "" async for ch in stream if ch.choices]
    assert "".join(parts) == want


async def test_models_health_metrics_and_errors(worker: WorkerProcess) -> None:
    async with httpx.AsyncClient(base_url=worker.url) as http:
        models = (await http.get("/v1/models")).json()
        assert [m["id"] for m in models["data"]] == ["jetrouter-sim"]
        health = await http.get("/health")
        assert health.status_code == 200 and health.json()["worker_id"] == "http-w"
        bad = await http.post("/v1/completions", json={"prompt": 5})
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
        too_big = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 10**6})
        assert too_big.status_code == 400
        wrong_model = await http.post("/v1/completions", json={"prompt": "x", "model": "nope"})
        assert wrong_model.status_code == 404
        ok = await http.post("/v1/completions", json={"prompt": "metrics please"},
                             headers={"x-request-id": "corr-1"})
        assert ok.json()["id"] == "cmpl-corr-1" and ok.headers["x-request-id"] == "corr-1"
        text = (await http.get("/metrics")).text
        assert 'jetrouter_worker_requests_total{endpoint="completions",outcome="ok"}' in text
        assert "jetrouter_worker_prompt_tokens_total" in text
        assert "jetrouter_worker_kv_usage" in text


async def _load(http: httpx.AsyncClient) -> dict:  # type: ignore[type-arg]
    return (await http.get("/health")).json()["load"][0]


async def test_client_disconnect_aborts_and_frees_blocks(worker: WorkerProcess) -> None:
    async with httpx.AsyncClient(base_url=worker.url, timeout=20) as http:
        body = {"prompt": "a long generation " * 20, "max_tokens": 5000, "stream": True}
        async with http.stream("POST", "/v1/completions", json=body) as resp:
            lines = resp.aiter_lines()
            while not (await anext(lines)).startswith("data: "):
                pass
            assert (await _load(http))["num_running"] == 1
        # Leaving the block closed the connection: the worker must drop the request.

        async def freed() -> bool:
            load = await _load(http)
            return load["num_running"] == 0 and load["active_decode_blocks"] == 0
        await until(freed, what="the request dropped")
        # The same for a non-streaming request.
        task = asyncio.create_task(http.post("/v1/completions",
                                             json={**body, "stream": False}))

        async def running() -> bool:
            return (await _load(http))["num_running"] == 1
        await until(running, what="the request running")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await until(freed, what="the request dropped")


async def _fault(url: str, **body: object) -> dict:  # type: ignore[type-arg]
    async with httpx.AsyncClient(base_url=url) as http:
        resp = await http.post("/fault", json=body)
        resp.raise_for_status()
        return resp.json()


async def test_wrong_output_is_deterministic_and_clears(worker: WorkerProcess) -> None:
    c = client(worker.url)
    prompt = "check my output"
    await _fault(worker.url, action="wrong_output")
    try:
        a = await c.completions.create(model="jetrouter-sim", prompt=prompt, max_tokens=8)
        b = await c.completions.create(model="jetrouter-sim", prompt=prompt, max_tokens=8)
        assert a.choices[0].text == b.choices[0].text != expected_text(prompt, 8)
    finally:
        await _fault(worker.url, action="clear")
    good = await c.completions.create(model="jetrouter-sim", prompt=prompt, max_tokens=8)
    assert good.choices[0].text == expected_text(prompt, 8)


async def test_hang_stops_tokens_until_cleared(worker: WorkerProcess) -> None:
    c = client(worker.url)
    prompt = "hang in there"
    state = await _fault(worker.url, action="hang")
    assert state["hang"] is True
    try:
        task = asyncio.create_task(
            c.completions.create(model="jetrouter-sim", prompt=prompt, max_tokens=20))
        async with httpx.AsyncClient(base_url=worker.url) as http:
            async def queued() -> bool:
                load = await _load(http)
                return load["num_waiting"] + load["num_running"] == 1
            await until(queued, what="the request queued")
        done, _ = await asyncio.wait({task}, timeout=1.0)
        assert not done, "a hung worker answered"
    finally:
        await _fault(worker.url, action="clear")
    out = await asyncio.wait_for(task, 10)  # the same connection, still open, now completes
    assert out.choices[0].text == expected_text(prompt, 20)


async def test_slow_multiplies_step_time() -> None:
    # speedup 1, 20 ms steps: 10 tokens take >= 0.2 s normally, >= 1 s at factor 5 (sleep-bound
    # lower limits, not performance figures).
    with WorkerProcess(["--perf-model", "linear", "--decode-ms-base", "20",
                        "--prefill-ms-per-token", "0"]) as proc:
        await _fault(proc.url, action="slow", factor=5)
        c = client(proc.url)
        start = time.monotonic()
        out = await c.completions.create(model="jetrouter-sim", prompt="slowly", max_tokens=10)
        assert time.monotonic() - start >= 10 * 0.020 * 5 * 0.95
        assert out.choices[0].text == expected_text("slowly", 10)


async def test_crash_exits_at_once() -> None:
    with WorkerProcess(FAST) as proc:
        with pytest.raises(httpx.TransportError):
            await _fault(proc.url, action="crash")
        assert proc.wait(10) == CRASH_EXIT_CODE


async def test_crash_after_tokens_streams_exactly_n_then_dies() -> None:
    with WorkerProcess(FAST) as proc:
        await _fault(proc.url, action="crash_after_tokens", n=3)
        prompt = "about to crash"
        got: list[str] = []
        with pytest.raises((openai.APIConnectionError, httpx.TransportError)):
            stream = await client(proc.url).completions.create(
                model="jetrouter-sim", prompt=prompt, max_tokens=50, stream=True)
            async for chunk in stream:
                got.append(chunk.choices[0].text)
        assert "".join(got) == expected_text(prompt, 3)
        assert proc.wait(10) == CRASH_EXIT_CODE


async def test_sigterm_finishes_in_flight_then_exits_zero() -> None:
    with WorkerProcess(["--perf-model", "linear", "--decode-ms-base", "10"]) as proc:
        c = client(proc.url)
        prompt = "finish me"
        stream = await c.completions.create(model="jetrouter-sim", prompt=prompt,
                                            max_tokens=60, stream=True)
        chunks = aiter(stream)
        got = [(await anext(chunks)).choices[0].text]
        proc.terminate()
        async for chunk in chunks:
            if chunk.choices:
                got.append(chunk.choices[0].text)
        assert "".join(got) == expected_text(prompt, 60)
        assert proc.wait(20) == 0


def _streamed_ok(text: str) -> float:
    key = 'jetrouter_worker_requests_total{endpoint="completions",outcome="ok"} '
    line = next((ln for ln in text.splitlines() if ln.startswith(key)), key + "0")
    return float(line[len(key):])


async def test_a_finished_stream_ends_with_done_and_counts_as_ok(worker: WorkerProcess) -> None:
    """The stream's last line ends the chunked body in the same write; the code after it (the
    outcome count) still runs."""
    async with httpx.AsyncClient(base_url=worker.url) as http:
        before = _streamed_ok((await http.get("/metrics")).text)
        async with http.stream("POST", "/v1/completions",
                               json={"prompt": "count me", "max_tokens": 3,
                                     "stream": True}) as r:
            body = b"".join([part async for part in r.aiter_bytes()])
        assert r.status_code == 200
        assert body.count(b"data: ") == 5 and body.endswith(b"data: [DONE]\n\n")
        after = _streamed_ok((await http.get("/metrics")).text)
        assert after == before + 1
