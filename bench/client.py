"""Open-loop replay of a trace against router base URLs, recording per-request latencies.

Requests are sent at their trace timestamps divided by ``speedup`` (open loop: a slow server does
not slow the arrivals), at most ``concurrency`` at once (later arrivals wait for a slot, and that
wait is recorded apart from the latencies). Each request streams ``/v1/completions`` with a
token-id prompt and asks for the usage chunk, whose ``prompt_tokens_details.cached_tokens`` is the
engine's own count of prefix-cache hits. URLs are used round-robin; a connection that fails before
any response (refused, reset, closed) fails over to the next URL, so a run survives a dead replica.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

import httpx

from bench.trace import (
    DEFAULT_BLOCK_TOKENS,
    DEFAULT_VOCAB_SIZE,
    TEXT_ID_SPACE,
    PromptBuilder,
    TraceRecord,
    words_of,
)
from errors.root import JetrouterError

OK, FAILED, REJECTED = "ok", "failed", "rejected"
DEFAULT_MODEL = "jetrouter-sim"
WORKER_HEADER = "x-jetrouter-worker"
REPLICA_HEADER = "x-jetrouter-replica"
PREDICTED_HEADER = "x-jetrouter-predicted-cached-tokens"
# Errors raised before a response exists: the request never reached a live server (or the server
# died before answering), so sending it elsewhere cannot double-serve it. Timeouts are excluded:
# a slow server may still be working on the request.
_FAILOVER_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError,
                    httpx.ReadError, httpx.WriteError)


@dataclass(slots=True)
class BenchOptions:
    concurrency: int = 128
    speedup: float = 1.0
    max_output_tokens: int | None = 128
    trace_block_tokens: int = DEFAULT_BLOCK_TOKENS
    vocab_size: int = DEFAULT_VOCAB_SIZE
    model: str | None = None            # None: ask the first URL's /v1/models
    request_timeout_s: float = 300.0
    connect_timeout_s: float = 5.0
    ignore_eos: bool = False            # vLLM extension; lets real engines honour output_length
    # Send text (one word per trace token) instead of token ids, so the tokenizers of the
    # router and the engines decide the ids, as with real clients.
    text_prompts: bool = False
    progress: bool = True
    label: str = "run"


@dataclass(slots=True)
class RequestRecord:
    index: int
    outcome: str = FAILED
    status: int | None = None
    scheduled_s: float = 0.0            # arrival time relative to the run start
    queued_s: float = 0.0               # waited for a concurrency slot
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float | None = None
    output_tokens: int = 0
    prompt_tokens: int | None = None    # from usage
    cached_tokens: int | None = None    # usage.prompt_tokens_details.cached_tokens
    predicted_tokens: int | None = None  # the router's predicted reuse (response header)
    sent_prompt_tokens: int = 0
    worker: str | None = None
    replica: str | None = None
    url: str | None = None
    failovers: int = 0
    error: str | None = None


@dataclass(slots=True)
class RunResult:
    label: str
    urls: list[str]
    records: list[RequestRecord]
    started_at: float                   # wall clock, epoch seconds
    duration_s: float                   # first arrival to last completion
    options: BenchOptions
    model: str = DEFAULT_MODEL
    extra: dict[str, Any] = field(default_factory=dict)   # e.g. router mode, cluster shape


def normalise_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if url.endswith("/v1"):
        url = url[:-3]
    if "://" not in url:
        url = "http://" + url
    return url


class Progress:
    """One status line on stderr, rewritten in place with a carriage return."""

    def __init__(self, label: str, total: int, stream: TextIO | None = None,
                 enabled: bool = True) -> None:
        self.label, self.total, self.enabled = label, total, enabled
        self.stream = stream or sys.stderr
        self.counts = {OK: 0, FAILED: 0, REJECTED: 0}
        self.in_flight = 0
        self._t0 = time.monotonic()
        self._last = 0.0
        # Rewriting one line is for terminals; a log file gets a line every few seconds only.
        self._interval = 0.2 if getattr(self.stream, "isatty", lambda: False)() else 5.0

    def done(self, outcome: str) -> None:
        self.counts[outcome] += 1
        self.render()

    def render(self, force: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled or (not force and now - self._last < self._interval):
            return
        self._last = now
        finished = sum(self.counts.values())
        width = 24
        filled = width * finished // self.total if self.total else width
        bar = "#" * filled + "." * (width - filled)
        self.stream.write(f"\r[{self.label}] [{bar}] {finished}/{self.total} "
                          f"ok={self.counts[OK]} rejected={self.counts[REJECTED]} "
                          f"failed={self.counts[FAILED]} in-flight={self.in_flight} "
                          f"{now - self._t0:6.1f}s ")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.render(force=True)
            self.stream.write("\n")
            self.stream.flush()


async def discover_model(client: httpx.AsyncClient, urls: Sequence[str]) -> str:
    """The first model any URL lists, else the simulated engine's default name."""
    for url in urls:
        try:
            resp = await client.get(url + "/v1/models")
            data = resp.json().get("data") or []
            if resp.status_code == 200 and data and data[0].get("id"):
                return str(data[0]["id"])
        except (httpx.HTTPError, ValueError, AttributeError):
            continue
    return DEFAULT_MODEL


def _error_text(body: bytes) -> str:
    try:
        err = json.loads(body).get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])[:200]
    except (ValueError, AttributeError):
        pass
    return body[:200].decode("utf-8", errors="replace")


class _Replayer:
    def __init__(self, client: httpx.AsyncClient, urls: list[str], model: str,
                 options: BenchOptions, builder: PromptBuilder, progress: Progress) -> None:
        self.client, self.urls, self.model = client, urls, model
        self.options, self.builder, self.progress = options, builder, progress
        self._next_url = 0
        self._slots = asyncio.Semaphore(max(1, options.concurrency))
        self.words: tuple[str, ...] = ()
        if options.text_prompts:
            from workers.tinymodel import WORDS  # the words the tiny tokenizer was trained on

            self.words = tuple(WORDS)

    def _body(self, record: TraceRecord, prompt: list[int] | str) -> dict[str, Any]:
        max_tokens = max(1, record.output_length)
        if self.options.max_output_tokens is not None:
            max_tokens = min(max_tokens, max(1, self.options.max_output_tokens))
        body: dict[str, Any] = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                                "stream": True, "stream_options": {"include_usage": True}}
        if self.options.ignore_eos:
            body["ignore_eos"] = True
        return body

    async def replay(self, index: int, record: TraceRecord, t0: float, base_ms: float) -> \
            RequestRecord:
        loop = asyncio.get_running_loop()
        scheduled = (record.timestamp_ms - base_ms) / 1000.0 / self.options.speedup
        delay = t0 + scheduled - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)  # the open-loop arrival schedule itself
        result = RequestRecord(index=index, scheduled_s=scheduled)
        prompt = self.builder.prompt(record, filler_key=index)
        result.sent_prompt_tokens = len(prompt)
        body = self._body(record, words_of(prompt, self.words) if self.words else prompt)
        arrived = loop.time()
        async with self._slots:
            result.queued_s = loop.time() - arrived
            self.progress.in_flight += 1
            try:
                await self._send(result, body)
            finally:
                self.progress.in_flight -= 1
        self.progress.done(result.outcome)
        return result

    async def _send(self, result: RequestRecord, body: dict[str, Any]) -> None:
        start_index = self._next_url
        self._next_url = (self._next_url + 1) % len(self.urls)
        headers = {"x-request-id": f"bench-{self.options.label}-{result.index}"}
        for attempt in range(len(self.urls)):
            url = self.urls[(start_index + attempt) % len(self.urls)]
            result.url = url
            try:
                await self._stream(url, result, body, headers)
                return
            except _FailoverBeforeResponse as exc:
                if attempt < len(self.urls) - 1:
                    result.failovers += 1
                result.error = f"{url}: {exc.__cause__!r}"
            except (httpx.HTTPError, ValueError) as exc:  # mid-stream break or bad JSON
                result.outcome, result.error = FAILED, f"{url}: {exc!r}"
                return
        result.outcome = FAILED

    async def _stream(self, url: str, result: RequestRecord, body: dict[str, Any],
                      headers: dict[str, str]) -> None:
        loop = asyncio.get_running_loop()
        sent = loop.time()
        stream = self.client.stream("POST", url + "/v1/completions", json=body, headers=headers)
        try:
            resp = await stream.__aenter__()
        except _FAILOVER_ERRORS as exc:
            raise _FailoverBeforeResponse() from exc
        try:
            result.status = resp.status_code
            result.worker = resp.headers.get(WORKER_HEADER)
            result.replica = resp.headers.get(REPLICA_HEADER)
            predicted = resp.headers.get(PREDICTED_HEADER)
            result.predicted_tokens = int(predicted) if predicted and predicted.isdigit() \
                else None
            if resp.status_code != 200:
                result.outcome = REJECTED if resp.status_code == 503 else FAILED
                result.error = f"HTTP {resp.status_code}: {_error_text(await resp.aread())}"
                return
            await self._read_events(resp, result, sent)
        finally:
            await stream.__aexit__(None, None, None)

    async def _read_events(self, resp: httpx.Response, result: RequestRecord,
                           sent: float) -> None:
        loop = asyncio.get_running_loop()
        last_token: float | None = None
        chunks = 0
        completion_tokens: int | None = None
        done = False
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            now = loop.time()
            chunk = json.loads(data)
            if chunk.get("error"):
                result.outcome, result.error = FAILED, f"stream error: {chunk['error']}"
                return
            if any(c.get("text") for c in chunk.get("choices") or ()):
                chunks += 1
                if last_token is None:
                    result.ttft_s = now - sent
                else:
                    result.itl_s.append(now - last_token)
                last_token = now
            usage = chunk.get("usage")
            if usage:
                completion_tokens = usage.get("completion_tokens")
                result.prompt_tokens = usage.get("prompt_tokens")
                details = usage.get("prompt_tokens_details") or {}
                result.cached_tokens = details.get("cached_tokens")
        result.e2e_s = loop.time() - sent
        result.output_tokens = completion_tokens if completion_tokens is not None else chunks
        if done:
            result.outcome, result.error = OK, None
        else:
            result.outcome, result.error = FAILED, "stream ended without [DONE]"


class _FailoverBeforeResponse(JetrouterError):
    """The request got no response from this URL; try the next one."""


async def run_trace_bench(urls: Sequence[str], requests: Sequence[TraceRecord],
                          options: BenchOptions | None = None) -> RunResult:
    """Replay ``requests`` (timestamps relative to the first) against router base URLs."""
    options = options or BenchOptions()
    if not urls:
        raise ValueError("need at least one URL")
    if options.speedup <= 0:
        raise ValueError("speedup must be > 0")
    base_urls = [normalise_url(u) for u in urls]
    builder = PromptBuilder(options.trace_block_tokens,
                            TEXT_ID_SPACE if options.text_prompts else options.vocab_size)
    progress = Progress(options.label, len(requests), enabled=options.progress)
    timeout = httpx.Timeout(options.request_timeout_s, connect=options.connect_timeout_s,
                            pool=None)
    limits = httpx.Limits(max_connections=options.concurrency + 8,
                          max_keepalive_connections=options.concurrency + 8)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        model = options.model or await discover_model(client, base_urls)
        replayer = _Replayer(client, base_urls, model, options, builder, progress)
        loop = asyncio.get_running_loop()
        started_at, t0 = time.time(), loop.time()
        base_ms = requests[0].timestamp_ms if requests else 0.0
        tasks = [asyncio.create_task(replayer.replay(i, r, t0, base_ms))
                 for i, r in enumerate(requests)]
        try:
            records = list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()
            progress.close()
        duration = loop.time() - t0
    return RunResult(label=options.label, urls=base_urls, records=records,
                     started_at=started_at, duration_s=duration, options=options, model=model)
