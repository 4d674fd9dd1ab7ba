"""``POST /v1/responses`` (OpenAI's Responses API, streamed and not), with stored-response
affinity.

Routing: the prompt's token ids are what the engine computes, the model's chat template over
``instructions`` + ``input`` (:mod:`tokenization.chat_forms`), so the decision is KV-aware like a
chat's. The request is forwarded verbatim and the answer relayed verbatim
(:mod:`api.forward.passthrough`).

Affinity: with ``store`` (the default) the engine keeps the response, and a follow-up naming it
as ``previous_response_id`` can only be answered there. So once the engine has named the
response (the non-streamed body's ``id``, or the first streamed event, ``response.created``),
its id and engine are appended to the router stream as ``ResponseStored`` *before* the client is
sent the id: a follow-up that reaches any replica after that finds it (a replica that has not
applied it yet reads the router stream to its end first, :meth:`Replica.stored_response`).
A follow-up is pinned to that engine and never moved to another: an unknown id is OpenAI's 404,
an engine retired since is a 404 that says so, an engine marked unhealthy a 503 to retry.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import Response

from api.errors import ApiError, error_response
from api.forward.conductor import PRIORITY_LEVEL, Conductor
from api.forward.passthrough import Passthrough
from api.openai_schema import MAX_TOKEN_COUNT
from api.tokenizer import encode_chat
from replicas.core.shedding import PriorityTier
from replicas.runtime.replica import Lookup, RouteRequest
from tokenization.chat_forms import FormError, responses_messages
from tokenization.model_tokenizer import ChatTemplateFailed

log = logging.getLogger("jetrouter.responses")

PATH = "/v1/responses"
DEFAULT_EXPECTED_OSL = 128
_decode = msgspec.json.Decoder()


def _flag(body: dict[str, Any], key: str, default: bool) -> bool:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(400, f"Invalid type for '{key}': expected a boolean.", param=key)
    return value


def _expected_osl(body: dict[str, Any]) -> int:
    value = body.get("max_output_tokens")
    if value is None:
        return DEFAULT_EXPECTED_OSL
    if not isinstance(value, int) or isinstance(value, bool) or \
            not 1 <= value <= MAX_TOKEN_COUNT:
        raise ApiError(400, f"Invalid 'max_output_tokens': expected an integer in "
                       f"[1, {MAX_TOKEN_COUNT}].", param="max_output_tokens")
    return value


def prompt_ids(conductor: Conductor, body: dict[str, Any]) -> list[int]:
    try:
        ids = encode_chat(conductor.tokenizer, responses_messages(body), body)
    except FormError as exc:
        raise ApiError(400, f"Invalid request: {exc}", param=exc.param) from None
    except ChatTemplateFailed as exc:
        raise ApiError(400, f"Invalid 'input': {exc}", param="input") from None
    if len(ids) > conductor.cfg.max_prompt_tokens:
        raise ApiError(413, f"This model's maximum prompt length is "
                       f"{conductor.cfg.max_prompt_tokens} tokens. However, your prompt has "
                       f"{len(ids)} tokens.", param="input", code="prompt_too_long")
    return ids


async def previous_engine(conductor: Conductor, body: dict[str, Any]
                          ) -> tuple[str, int] | Response | None:
    """The engine a follow-up must go to (None: not a follow-up), or the client's error."""
    previous = body.get("previous_response_id")
    if previous is None:
        return None
    if not isinstance(previous, str) or not previous:
        raise ApiError(400, "Invalid 'previous_response_id': expected a non-empty string.",
                       param="previous_response_id")
    worker, found = await conductor.replica.stored_response(previous)
    if found == Lookup.FOUND and worker is not None:
        return worker
    headers = conductor.headers()
    if found == Lookup.UNKNOWN:
        return error_response(404, f"Previous response with id '{previous}' not found.",
                              param="previous_response_id",
                              code="previous_response_not_found", headers=headers)
    assert worker is not None
    if found == Lookup.ENGINE_GONE:
        return error_response(
            404, f"Previous response with id '{previous}' is no longer available: the engine "
            f"that stored it ({worker[0]}) has left the fleet, and with it the responses it "
            "stored. Start a new conversation (send the full input).",
            param="previous_response_id", code="previous_response_engine_gone",
            headers=headers)
    return error_response(
        503, f"The engine that stored response '{previous}' ({worker[0]}) is marked unhealthy; "
        "no other engine holds the response. Retry later.", type="service_unavailable",
        param="previous_response_id", headers={**headers, "retry-after": "5"})


class Recorder:
    """Appends ``ResponseStored`` for the response the engine names, once, before the client
    is sent its id."""

    def __init__(self, conductor: Conductor, store: bool) -> None:
        self.conductor = conductor
        self.store = store
        self.forward: Passthrough | None = None
        self.recorded: str | None = None

    def watch(self, forward: Passthrough) -> None:
        self.forward = forward  # its current hop names the engine that stored the response

    async def record(self, response_id: object) -> None:
        if not self.store or self.recorded is not None or self.forward is None:
            return
        if not isinstance(response_id, str) or not response_id:
            return
        self.recorded = response_id
        try:
            await self.conductor.replica.store_response(response_id, self.forward.routed,
                                                      self.conductor.cfg.response_ttl_secs)
        except Exception as exc:  # the answer still goes out; a follow-up will get a 404
            log.warning("response %s: its engine could not be recorded: %s", response_id, exc)

    async def on_body(self, data: bytes) -> bytes:
        try:
            doc = _decode.decode(data)
        except msgspec.DecodeError:
            return data
        if isinstance(doc, dict):
            await self.record(doc.get("id"))
        return data

    async def on_event(self, raw: bytes, payload: bytes | None) -> bytes:
        if self.recorded is None and payload is not None and b"response" in payload:
            try:
                doc = _decode.decode(payload)
            except msgspec.DecodeError:
                return raw
            inner = doc.get("response") if isinstance(doc, dict) else None
            if isinstance(inner, dict):
                await self.record(inner.get("id"))
        return raw


def responses_routes(conductor: Conductor) -> APIRouter:
    router = APIRouter()

    @router.post(PATH)
    async def responses(request: Request) -> Response:
        opened = await conductor.opened_for_model(request)
        if isinstance(opened, Response):
            return opened
        raw, body, model = opened
        stream = _flag(body, "stream", False)
        store = _flag(body, "store", True)
        expected_osl = _expected_osl(body)
        ids = prompt_ids(conductor, body)
        pinned = await previous_engine(conductor, body)
        if isinstance(pinned, Response):
            return pinned
        req = RouteRequest(request_id=conductor.new_request_id(), model=model, token_ids=ids,
                           expected_osl=expected_osl,
                           priority=PRIORITY_LEVEL[PriorityTier.STANDARD], pinned=pinned)
        recorder = Recorder(conductor, store)
        return await conductor.relay("responses", req, PATH, raw, stream=stream,
                                     watch=recorder.watch, on_event=recorder.on_event,
                                     on_body=recorder.on_body)

    return router
