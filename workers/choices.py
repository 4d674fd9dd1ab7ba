"""Several choices of one prompt (``n > 1``) on the simulated engine, and the token feeds of the
routes that generate text in other shapes (Responses, Anthropic Messages).

Each choice is its own engine request on the same prompt, so the second and later ones find the
prompt's blocks in the prefix cache, as a real engine's parallel sampling shares them. Streamed,
the choices' chunks interleave as the engine produces their tokens, each with its ``index``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from fastapi.responses import JSONResponse, Response

from leanhttp.hotpath import LastChunk, LeanStreamingResponse
from tokenization.tokens import decode
from workers.engine import Engine, RequestHandle
from workers.openai_shapes import ParsedRequest, ResponseShaper, usage

_encode = msgspec.json.Encoder().encode
MAX_CHOICES = 128


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + _encode(payload) + b"\n\n"


async def interleaved(handles: list[RequestHandle]) -> AsyncIterator[tuple[int, int]]:
    """(choice index, token) as the engine produces them, across every handle; aborts what is
    unfinished when the consumer stops early."""
    queue: asyncio.Queue[tuple[int, int | None]] = asyncio.Queue()

    async def pump(i: int, handle: RequestHandle) -> None:
        try:
            async for token in handle.tokens():
                await queue.put((i, token))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, h)) for i, h in enumerate(handles)]
    running = len(tasks)
    try:
        while running:
            i, token = await queue.get()
            if token is None:
                running -= 1
            else:
                yield i, token
    finally:
        for t in tasks:
            t.cancel()
        for h in handles:
            if not h.finished:
                h.abort()


def submit_choices(engine: Engine, request_id: str, parsed: ParsedRequest,
                   n: int) -> list[RequestHandle]:
    return [engine.submit(f"{request_id}-{i}", parsed.prompt_ids, parsed.max_tokens)
            for i in range(n)]


def _total_usage(handles: list[RequestHandle]) -> dict[str, Any]:
    return usage(handles[0].prompt_tokens, sum(len(h.output) for h in handles),
                 handles[0].cached_tokens)


async def serve_choices(engine: Engine, request_id: str, parsed: ParsedRequest, n: int,
                        shaper: ResponseShaper, headers: dict[str, str]) -> Response:
    handles = submit_choices(engine, request_id, parsed, n)
    if parsed.stream:
        return LeanStreamingResponse(_stream(handles, shaper, parsed.include_usage),
                                     media_type="text/event-stream", headers=headers)
    async for _ in interleaved(handles):
        pass
    choices = []
    for i, h in enumerate(handles):
        choice = shaper.full(h.output, "length", {})["choices"][0]
        choices.append({**choice, "index": i})
    body = shaper.full([], "length", _total_usage(handles))
    body["choices"] = choices
    return JSONResponse(body, headers=headers)


def _indexed(chunk: dict[str, Any], index: int) -> dict[str, Any]:
    chunk["choices"][0]["index"] = index
    return chunk


async def _stream(handles: list[RequestHandle], shaper: ResponseShaper,
                  include_usage: bool) -> AsyncIterator[bytes]:
    if shaper.chat:
        for i in range(len(handles)):
            yield sse(_indexed(shaper.chunk("", first=True), i))
    async for i, token in interleaved(handles):
        yield sse(_indexed(shaper.chunk(decode([token])), i))
    for i in range(len(handles)):
        yield sse(_indexed(shaper.chunk(None if shaper.chat else "", "length"), i))
    if include_usage:
        yield sse(shaper.usage_chunk(_total_usage(handles)))
    yield LastChunk(b"data: [DONE]\n\n")
