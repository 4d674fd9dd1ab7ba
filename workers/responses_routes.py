"""The simulated engine's ``POST /v1/responses`` (OpenAI's Responses API, streamed and not).

The prompt is the chat template over ``instructions`` + ``input`` (:mod:`tokenization.chat_forms`,
the conversion the router routes by). With ``store`` (the default) the engine keeps the
conversation under the response's id, in its own memory as vLLM does: a request naming it as
``previous_response_id`` continues it (its messages and answer come first), and an id this engine
did not store is a 404, so a follow-up that reaches the wrong engine fails loudly. The answer is
the engine's deterministic text (:mod:`workers.generation`).

Streamed, the events are the Responses API's: ``response.created``, ``response.in_progress``, the
output item and content part added, ``response.output_text.delta`` per token, their ``done``
events and ``response.completed`` with the usage.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from leanhttp.hotpath import LastChunk, LeanStreamingResponse
from tokenization.chat_forms import FormError, responses_messages
from tokenization.model_tokenizer import ChatTemplateFailed
from tokenization.tokens import decode
from workers.engine import RequestHandle
from workers.openai_shapes import error_body
from workers.route_port import EngineRuntime, json_object

DEFAULT_MAX_OUTPUT_TOKENS = 64
_encode = msgspec.json.Encoder().encode


def _error(status: int, message: str, param: str | None = None,
           code: str | None = None) -> JSONResponse:
    body = error_body(message, "invalid_request_error", param)
    body["error"]["code"] = code
    return JSONResponse(body, status_code=status)


def event(kind: str, seq: int, payload: dict[str, Any]) -> bytes:
    return (b"event: " + kind.encode() + b"\ndata: "
            + _encode({"type": kind, "sequence_number": seq, **payload}) + b"\n\n")


class ResponseShape:
    """The response object of one request, as it stands."""

    def __init__(self, body: dict[str, Any], model: str, response_id: str, max_tokens: int,
                 store: bool) -> None:
        self.id = response_id
        self.item_id = "msg_" + uuid.uuid4().hex
        self.base: dict[str, Any] = {
            "id": response_id, "object": "response", "created_at": int(time.time()),
            "model": model, "instructions": body.get("instructions"),
            "previous_response_id": body.get("previous_response_id"),
            "max_output_tokens": max_tokens, "store": store, "parallel_tool_calls": True,
            "tool_choice": "auto", "tools": [], "temperature": 1.0, "top_p": 1.0,
            "text": {"format": {"type": "text"}}, "truncation": "disabled", "metadata": {},
            "error": None, "incomplete_details": None, "usage": None}

    def part(self, text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": []}

    def item(self, text: str | None, status: str) -> dict[str, Any]:
        return {"type": "message", "id": self.item_id, "status": status, "role": "assistant",
                "content": [] if text is None else [self.part(text)]}

    def whole(self, text: str | None, status: str,
              usage: dict[str, Any] | None = None) -> dict[str, Any]:
        output = [] if text is None else [self.item(text, "completed")]
        return {**self.base, "status": status, "output": output, "usage": usage}


def usage_of(handle: RequestHandle) -> dict[str, Any]:
    prompt, out = handle.prompt_tokens, len(handle.output)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens":
                                                             handle.cached_tokens},
            "output_tokens": out, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + out}


def add_responses_route(app: FastAPI, runtime: EngineRuntime) -> None:
    settings = runtime.settings
    # response id -> the conversation it ends (its messages and its answer), as vLLM keeps it.
    stored: dict[str, list[dict[str, Any]]] = {}
    app.state.stored_responses = stored

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        if runtime.draining:
            return _error(503, "worker is shutting down")
        body = await json_object(request)
        if isinstance(body, str):
            return _error(400, body)
        model = body.get("model")
        if model is not None and model != settings.model:
            return _error(404, f"The model `{model}` does not exist.", "model")
        try:
            messages = responses_messages(body)
        except FormError as exc:
            return _error(400, str(exc), exc.param)
        previous = body.get("previous_response_id")
        if previous is not None:
            if previous not in stored:
                return _error(404, f"Response with id '{previous}' not found.",
                              "previous_response_id", "previous_response_not_found")
            history = stored[previous]
            if body.get("instructions") is not None:  # this turn's instructions come first
                history = [m for m in history if m.get("role") != "system"]
                messages = [messages[0], *history, *messages[1:]]
            else:
                messages = [*history, *messages]
        try:
            ids = runtime.codec.encode_chat(messages, body)
        except ChatTemplateFailed as exc:
            return _error(400, str(exc), "input")
        max_tokens = body.get("max_output_tokens") or DEFAULT_MAX_OUTPUT_TOKENS
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            return _error(400, "max_output_tokens must be an integer >= 1", "max_output_tokens")
        store = body.get("store") is not False
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        engine = runtime.pick_engine(None)
        handle = engine.submit(request_id, ids, max_tokens)
        shape = ResponseShape(body, settings.model, "resp_" + uuid.uuid4().hex, max_tokens,
                              store)
        headers = {"x-jetrouter-worker": settings.worker_id}

        def keep(text: str) -> None:
            if store:
                stored[shape.id] = [*messages, {"role": "assistant", "content": text}]

        if body.get("stream") is True:
            return LeanStreamingResponse(_stream(handle, shape, keep),
                                         media_type="text/event-stream", headers=headers)
        async for _ in handle.tokens():
            pass
        text = decode(handle.output)
        keep(text)
        return JSONResponse(shape.whole(text, "completed", usage_of(handle)), headers=headers)


async def _stream(handle: RequestHandle, shape: ResponseShape,
                  keep: Any) -> AsyncIterator[bytes]:
    seq = 0

    def next_event(kind: str, payload: dict[str, Any]) -> bytes:
        nonlocal seq
        seq += 1
        return event(kind, seq - 1, payload)

    where = {"item_id": shape.item_id, "output_index": 0, "content_index": 0}
    try:
        yield next_event("response.created", {"response": shape.whole(None, "in_progress")})
        yield next_event("response.in_progress", {"response": shape.whole(None, "in_progress")})
        yield next_event("response.output_item.added",
                         {"output_index": 0, "item": shape.item(None, "in_progress")})
        yield next_event("response.content_part.added", {**where, "part": shape.part("")})
        async for token in handle.tokens():
            yield next_event("response.output_text.delta",
                             {**where, "delta": decode([token]), "logprobs": []})
        text = decode(handle.output)
        keep(text)
        yield next_event("response.output_text.done", {**where, "text": text, "logprobs": []})
        yield next_event("response.content_part.done", {**where, "part": shape.part(text)})
        yield next_event("response.output_item.done",
                         {"output_index": 0, "item": shape.item(text, "completed")})
        yield LastChunk(next_event("response.completed", {
            "response": shape.whole(text, "completed", usage_of(handle))}))
    finally:
        if not handle.finished:
            handle.abort()
