"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's request and answer shapes).

With a model folder (``--model-path``) the router answers itself, with the tokenizer it routes
by: the ids a client sees are the ids the router hashes into KV blocks, computed by the same code
as the engines' (``tokenization.model_tokenizer``). Without one, the router's byte ids would be a
guess about a real engine's tokenizer, so the request is forwarded to an engine serving the model
(no routing decision: nothing is generated and no load is charged) and its answer passed on.
"""

from __future__ import annotations

from typing import Any

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import Response

from api.errors import ApiError
from api.forward.conductor import Conductor, model_of
from api.openai_schema import MAX_TOKEN_ID
from api.tokenizer import encode_chat, encode_prompt
from tokenization.model_tokenizer import ChatTemplateFailed

_json_type = "application/json"


def tokenize_locally(conductor: Conductor, body: dict[str, Any]) -> dict[str, Any]:
    if "messages" in body:
        messages = body["messages"]
        if not isinstance(messages, list) or not messages or \
                not all(isinstance(m, dict) for m in messages):
            raise ApiError(400, "Invalid 'messages': expected a non-empty array of objects.",
                           param="messages")
        try:
            ids = encode_chat(conductor.tokenizer, messages, body)
        except ChatTemplateFailed as exc:
            raise ApiError(400, f"Invalid 'messages': {exc}", param="messages") from None
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise ApiError(400, "Invalid 'prompt': expected a string (or give 'messages').",
                           param="prompt")
        ids = encode_prompt(conductor.tokenizer, prompt, body)
    return {"count": len(ids), "max_model_len": conductor.cfg.max_prompt_tokens,
            "tokens": ids, "token_strs": None}


def detokenize_locally(conductor: Conductor, body: dict[str, Any]) -> dict[str, Any]:
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < MAX_TOKEN_ID
            for t in ids):
        raise ApiError(400, "Invalid 'tokens': expected an array of token ids.", param="tokens")
    decode = getattr(conductor.tokenizer, "decode", None)
    if decode is None:
        raise ApiError(501, "this router's tokenizer cannot decode")
    return {"prompt": decode(ids)}


def tokenize_routes(conductor: Conductor) -> APIRouter:
    router = APIRouter()

    async def answer(path: str, request: Request) -> Response:
        opened = await conductor.opened(request)
        if isinstance(opened, Response):
            return opened
        raw, body = opened
        model = model_of(body, required=False)
        if not conductor.cfg.has_model_path:
            return await conductor.unrouted(path, raw, model)
        if model is not None and model not in conductor.replica.models():
            raise ApiError(404, f"The model `{model}` does not exist.", param="model",
                           code="model_not_found")
        doc = tokenize_locally(conductor, body) if path == "/tokenize" \
            else detokenize_locally(conductor, body)
        return Response(msgspec.json.encode(doc), media_type=_json_type,
                        headers=conductor.headers())

    @router.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await answer("/tokenize", request)

    @router.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await answer("/detokenize", request)

    return router
