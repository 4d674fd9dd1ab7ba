"""Anthropic's ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

Messages are routed like a chat: the prompt's token ids are the chat template over ``system`` +
``messages`` (:mod:`tokenization.chat_forms`, the conversion the simulated engine uses too), so the
decision is KV-aware; the request and the answer (a message, or Anthropic's stream of
``message_start`` ... ``message_stop`` events) pass through verbatim.

Every error a client of this route gets is in Anthropic's shape,
``{"type": "error", "error": {"type": ..., "message": ...}}``, whoever produced it: the router's
own refusals (bad input, busy, no decision recorded) are converted from OpenAI's shape here, and
an engine's OpenAI-shaped error is converted on the way through.

``count_tokens`` is answered by the router's tokenizer with ``--model-path`` (the ids it routes
by), else by an engine serving the model, as ``/tokenize`` is (:mod:`api.routes.tokenize`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import Response

from api.errors import ApiError
from api.forward.conductor import PRIORITY_LEVEL, Conductor, model_of, request_object
from api.openai_schema import MAX_TOKEN_COUNT
from api.tokenizer import encode_chat
from leanhttp.hotpath import read_body
from replicas.core.shedding import PriorityTier
from replicas.runtime.replica import RouteRequest
from tokenization.chat_forms import FormError, anthropic_messages
from tokenization.model_tokenizer import ChatTemplateFailed

PATH = "/v1/messages"
COUNT_PATH = "/v1/messages/count_tokens"
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}
_decode = msgspec.json.Decoder()
_NOT_AN_OBJECT = "the request body must be a JSON object"


def anthropic_error_body(status: int, message: str) -> bytes:
    kind = ERROR_TYPES.get(status, "api_error")
    return msgspec.json.encode({"type": "error", "error": {"type": kind, "message": message}})


def anthropic_error_shape(status: int, message: str) -> tuple[bytes, str]:
    return anthropic_error_body(status, message), "application/json"


def as_anthropic(resp: Response) -> Response:
    """``resp`` with an error body in Anthropic's shape (a success is returned as it is)."""
    if resp.status_code < 400:
        return resp
    try:
        doc = _decode.decode(resp.body)
    except msgspec.DecodeError:
        doc = None
    if isinstance(doc, dict) and doc.get("type") == "error":
        return resp
    message = ""
    if isinstance(doc, dict):
        err = doc.get("error")
        message = err.get("message", "") if isinstance(err, dict) else str(err or "")
        message = message or str(doc.get("message", ""))
    if not message:
        message = bytes(resp.body[:200]).decode("utf-8", "replace") or f"HTTP {resp.status_code}"
    headers = {k: v for k, v in resp.headers.items()
               if k not in ("content-length", "content-type")}
    return Response(anthropic_error_body(resp.status_code, message),
                    status_code=resp.status_code, media_type="application/json",
                    headers=headers)


async def in_anthropic_shape(conductor: Conductor,
                             answer: Callable[[bytes, dict[str, Any], str], Awaitable[Response]],
                             request: Request) -> Response:
    """``answer`` to a request this replica takes (its raw body, the body's JSON object and the
    model it names), its errors (raised or returned) in Anthropic's shape."""
    raw = await read_body(request)
    try:
        refused = await conductor.admit(request)
        if refused is not None:
            return as_anthropic(refused)
        body = request_object(raw, not_an_object=_NOT_AN_OBJECT)
        model = model_of(body)
        assert model is not None
        return as_anthropic(await answer(raw, body, model))
    except ApiError as exc:
        return as_anthropic(exc.response())


def prompt_ids(conductor: Conductor, body: dict[str, Any]) -> list[int]:
    try:
        ids = encode_chat(conductor.tokenizer, anthropic_messages(body), body)
    except FormError as exc:
        raise ApiError(400, str(exc), param=exc.param) from None
    except ChatTemplateFailed as exc:
        raise ApiError(400, f"messages: {exc}", param="messages") from None
    if len(ids) > conductor.cfg.max_prompt_tokens:
        raise ApiError(413, f"prompt is too long: {len(ids)} tokens > "
                       f"{conductor.cfg.max_prompt_tokens} maximum", param="messages")
    return ids


def _max_tokens(body: dict[str, Any]) -> int:
    value = body.get("max_tokens")
    if not isinstance(value, int) or isinstance(value, bool) or \
            not 1 <= value <= MAX_TOKEN_COUNT:
        raise ApiError(400, "max_tokens: Field required (an integer >= 1)", param="max_tokens")
    return value


def messages_routes(conductor: Conductor) -> APIRouter:
    router = APIRouter()

    async def create(raw: bytes, body: dict[str, Any], model: str) -> Response:
        expected_osl = _max_tokens(body)
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise ApiError(400, "stream: Input should be a valid boolean", param="stream")
        ids = prompt_ids(conductor, body)
        req = RouteRequest(request_id=conductor.new_request_id(), model=model, token_ids=ids,
                           expected_osl=expected_osl,
                           priority=PRIORITY_LEVEL[PriorityTier.STANDARD])
        return await conductor.relay("messages", req, PATH, raw, stream=stream,
                                     error_shape=anthropic_error_shape)

    async def count(raw: bytes, body: dict[str, Any], model: str) -> Response:
        if not conductor.cfg.has_model_path:
            return await conductor.unrouted(COUNT_PATH, raw, model)
        if model not in conductor.replica.models():
            raise ApiError(404, f"model: {model}", param="model")
        return Response(msgspec.json.encode({"input_tokens": len(prompt_ids(conductor, body))}),
                        media_type="application/json", headers=conductor.headers())

    @router.post(PATH)
    async def messages(request: Request) -> Response:
        return await in_anthropic_shape(conductor, create, request)

    @router.post(COUNT_PATH)
    async def count_tokens(request: Request) -> Response:
        return await in_anthropic_shape(conductor, count, request)

    return router
