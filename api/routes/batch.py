"""A completions request with several prompts: one routed request per prompt, answers merged.

Each prompt is its own routing decision (prompts rarely share a prefix, so each goes where its
own blocks are cached or the load is lowest), validated before any is routed. The client gets one
answer as OpenAI and vLLM give it: choice ``index`` is ``prompt_index * n + choice_index``, one
``id``, usage summed over the prompts; a stream interleaves the prompts' chunks as they come and
ends with one usage chunk (when asked for) and one ``[DONE]``. If any prompt's request is refused
(busy, unknown model, an engine's 4xx), the client gets that answer and the others are cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

import msgspec
from fastapi import Request
from fastapi.responses import Response
from starlette.types import Receive, Scope, Send

from api.forward.conductor import Conductor
from api.forward.engine import DONE_EVENT, SseSplitter, sse_data
from api.openai_schema import ParsedRequest, parse_request
from leanhttp.hotpath import LeanStreamingResponse

_decode = msgspec.json.Decoder()
USAGE_FIELDS = ("prompt_tokens", "completion_tokens", "total_tokens")


async def abandon(resp: Response) -> None:
    """Cancel a streaming answer that will not be sent: its hop ends now, not when collected."""
    run = getattr(resp, "run", None) or getattr(resp, "forward", None)
    if run is not None:
        await run.abandon()


def summed_usage(usages: Sequence[dict[str, Any]]) -> dict[str, Any]:
    total: dict[str, Any] = {k: sum(int(u.get(k) or 0) for u in usages) for k in USAGE_FIELDS}
    cached = [u.get("prompt_tokens_details", {}) for u in usages]
    if cached and all(isinstance(c, dict) and isinstance(c.get("cached_tokens"), int)
                      for c in cached):
        total["prompt_tokens_details"] = {"cached_tokens": sum(c["cached_tokens"]
                                                               for c in cached)}
    return total


def _reindex(choices: Any, prompt_index: int, n: int) -> list[dict[str, Any]]:
    out = []
    for c in choices if isinstance(choices, list) else []:
        if isinstance(c, dict):
            index = c.get("index")
            out.append({**c, "index": prompt_index * n + (index if isinstance(index, int)
                                                          else 0)})
    return out


async def serve_batch(conductor: Conductor, parsed: ParsedRequest, request: Request,
                      received: float, started: float) -> Response:
    assert parsed.batch is not None
    subs: list[tuple[ParsedRequest, bytes]] = []
    for prompt in parsed.batch:
        raw = msgspec.json.encode({**parsed.body, "prompt": prompt})
        subs.append((parse_request("completions", raw, conductor.tokenizer,
                                   max_prompt_tokens=conductor.cfg.max_prompt_tokens,
                                   priority_header=request.headers.get("x-priority")), raw))
    outcomes = await asyncio.gather(*(
        conductor.serve("completions", sub, raw, request, received, started)
        for sub, raw in subs), return_exceptions=True)
    answers = [a for a in outcomes if isinstance(a, Response)]
    failed = next((a for a in outcomes if not isinstance(a, Response)), None)
    refused = next((a for a in answers if a.status_code != 200), None)
    if failed is not None or refused is not None:
        for a in answers:  # their hops end now instead of holding load until they expire
            await abandon(a)
        if failed is not None:
            raise failed
        assert refused is not None
        return refused
    workers = ",".join(a.headers.get("x-jetrouter-worker", "") for a in answers)
    request_ids = ",".join(a.headers.get("x-jetrouter-request-id", "") for a in answers)
    headers = {**conductor.headers(), "x-jetrouter-worker": workers,
               "x-jetrouter-request-id": request_ids}
    if parsed.stream:
        return BatchStream(answers, parsed.n, parsed.include_usage, headers)
    docs = [_decode.decode(a.body) for a in answers]
    choices = [c for i, d in enumerate(docs) for c in _reindex(d.get("choices"), i, parsed.n)]
    merged = {**docs[0], "choices": sorted(choices, key=lambda c: c["index"]),
              "usage": summed_usage([d["usage"] for d in docs
                                     if isinstance(d.get("usage"), dict)])}
    return Response(msgspec.json.encode(merged), media_type="application/json",
                    headers=headers)


class BatchStream(LeanStreamingResponse):
    """The prompts' streams interleaved into one; every one of them is closed with it."""

    def __init__(self, answers: list[Response], n: int, include_usage: bool,
                 headers: dict[str, str]) -> None:
        super().__init__(self._merged(), media_type="text/event-stream", headers=headers)
        self.answers = answers
        self.n = n
        self.include_usage = include_usage

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for a in self.answers:
                await abandon(a)

    async def _merged(self) -> AsyncIterator[bytes]:
        queue: asyncio.Queue[tuple[int, bytes | None, bytes | None]] = asyncio.Queue()

        async def pump(i: int, answer: Response) -> None:
            splitter = SseSplitter()
            try:
                async for chunk in answer.body_iterator:  # type: ignore[attr-defined]
                    data = chunk if isinstance(chunk, bytes) else str(chunk).encode()
                    for raw, payload in splitter.feed(data):
                        await queue.put((i, raw, payload))
            finally:
                await queue.put((i, None, None))

        tasks = [asyncio.create_task(pump(i, a)) for i, a in enumerate(self.answers)]
        usages: list[dict[str, Any]] = []
        envelope: dict[str, Any] = {}
        running = len(tasks)
        try:
            while running:
                i, raw, payload = await queue.get()
                if raw is None:
                    running -= 1
                    continue
                if payload is None or payload == b"[DONE]":
                    continue
                try:
                    obj = _decode.decode(payload)
                except msgspec.DecodeError:
                    continue
                if not isinstance(obj, dict) or "error" in obj:
                    yield raw  # a prompt's stream failed: the client is told as it was
                    continue
                if not envelope:
                    envelope = {k: obj[k] for k in ("id", "object", "created", "model")
                                if k in obj}
                choices = obj.get("choices")
                if not choices:
                    if isinstance(obj.get("usage"), dict):
                        usages.append(obj["usage"])
                    continue
                yield sse_data({**obj, **envelope, "choices": _reindex(choices, i, self.n)})
            if self.include_usage and usages:
                yield sse_data({**envelope, "choices": [], "usage": summed_usage(usages)})
            yield DONE_EVENT
        finally:
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
