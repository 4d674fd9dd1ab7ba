"""The simulated engine's Anthropic routes: ``POST /v1/messages`` (streamed and not) and
``POST /v1/messages/count_tokens``.

The prompt is the chat template over ``system`` + ``messages`` (:mod:`tokenization.chat_forms`, the
conversion the router routes by); the answer is the engine's deterministic text, stopped by
``max_tokens``. Streamed, the events are Anthropic's: ``message_start``,
``content_block_start``, ``ping``, a ``content_block_delta`` per token, ``content_block_stop``,
``message_delta`` (stop reason and output tokens) and ``message_stop``. Errors are in Anthropic's
shape.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from leanhttp.hotpath import LastChunk, LeanStreamingResponse
from tokenization.chat_forms import FormError, anthropic_messages
from tokenization.model_tokenizer import ChatTemplateFailed
from tokenization.tokens import decode
from workers.engine import RequestHandle
from workers.route_port import EngineRuntime, json_object

_encode = msgspec.json.Encoder().encode
_KINDS = {400: "invalid_request_error", 404: "not_found_error", 503: "overloaded_error"}


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"type": "error", "error": {"type": _KINDS.get(status, "api_error"),
                                                    "message": message}}, status_code=status)


def event(kind: str, payload: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + _encode({"type": kind, **payload}) + b"\n\n"


def add_messages_routes(app: FastAPI, runtime: EngineRuntime) -> None:
    settings = runtime.settings

    async def parsed(request: Request) -> tuple[dict[str, Any], list[int]] | JSONResponse:
        body = await json_object(request)
        if isinstance(body, str):
            return _error(400, body)
        model = body.get("model")
        if model != settings.model:
            return _error(404, f"model: {model}")
        try:
            ids = runtime.codec.encode_chat(anthropic_messages(body), body)
        except (FormError, ChatTemplateFailed) as exc:
            return _error(400, str(exc))
        return body, ids

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        got = await parsed(request)
        if isinstance(got, JSONResponse):
            return got
        return JSONResponse({"input_tokens": len(got[1])},
                            headers={"x-jetrouter-worker": settings.worker_id})

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        if runtime.draining:
            return _error(503, "worker is shutting down")
        got = await parsed(request)
        if isinstance(got, JSONResponse):
            return got
        body, ids = got
        max_tokens = body.get("max_tokens")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            return _error(400, "max_tokens: Field required (an integer >= 1)")
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        handle = runtime.pick_engine(None).submit(request_id, ids, max_tokens)
        message = {"id": "msg_" + uuid.uuid4().hex, "type": "message", "role": "assistant",
                   "model": settings.model, "content": [], "stop_reason": None,
                   "stop_sequence": None}
        headers = {"x-jetrouter-worker": settings.worker_id}
        if body.get("stream") is True:
            return LeanStreamingResponse(_stream(handle, message), headers=headers,
                                         media_type="text/event-stream")
        async for _ in handle.tokens():
            pass
        return JSONResponse({**message, "content": [{"type": "text",
                                                     "text": decode(handle.output)}],
                             "stop_reason": "max_tokens", "usage": _usage(handle)},
                            headers=headers)


def _usage(handle: RequestHandle) -> dict[str, Any]:
    return {"input_tokens": handle.prompt_tokens - handle.cached_tokens,
            "cache_read_input_tokens": handle.cached_tokens,
            "cache_creation_input_tokens": 0, "output_tokens": len(handle.output)}


async def _stream(handle: RequestHandle, message: dict[str, Any]) -> AsyncIterator[bytes]:
    try:
        start = {**message, "usage": {"input_tokens": handle.prompt_tokens, "output_tokens": 0}}
        yield event("message_start", {"message": start})
        yield event("content_block_start",
                    {"index": 0, "content_block": {"type": "text", "text": ""}})
        yield event("ping", {})
        async for token in handle.tokens():
            yield event("content_block_delta", {"index": 0, "delta": {
                "type": "text_delta", "text": decode([token])}})
        yield event("content_block_stop", {"index": 0})
        yield event("message_delta", {"delta": {"stop_reason": "max_tokens",
                                                "stop_sequence": None},
                                      "usage": _usage(handle)})
        yield LastChunk(event("message_stop", {}))
    finally:
        if not handle.finished:
            handle.abort()
