"""``POST /v1/embeddings``: routed by load to an engine serving the model, forwarded verbatim.

A pooling request computes its inputs and generates nothing, and what it computes is not reused
by a later request the way a chat's prefix is: there is no KV reuse to predict, so the decision
gives the overlap no weight (``overlap_weight=0``) and the engine with the least load in flight
wins. The decision is still an event like any other, so every replica counts the request's
prompt tokens as that engine's load until it finishes. A batch of inputs is one request (the
engine batches them itself), charged with all of their tokens.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from api.errors import ApiError
from api.forward.conductor import PRIORITY_LEVEL, Conductor
from api.openai_schema import MAX_TOKEN_ID
from api.tokenizer import encode_prompt
from replicas.core.shedding import PriorityTier
from replicas.runtime.replica import RouteRequest

MAX_INPUTS = 2048  # OpenAI's limit on inputs in one embeddings request
PATH = "/v1/embeddings"


def _ids(value: list[Any], param: str) -> list[int]:
    if not value or not all(isinstance(t, int) and not isinstance(t, bool)
                            and 0 <= t < MAX_TOKEN_ID for t in value):
        raise ApiError(400, f"Invalid '{param}': expected a non-empty array of token ids in "
                       f"[0, {MAX_TOKEN_ID}).", param=param)
    return value


def input_ids(conductor: Conductor, body: dict[str, Any]) -> list[list[int]]:
    """Each input's token ids, as the engine tokenizes it (special tokens added to text)."""
    value = body.get("input")
    if value is None:
        raise ApiError(400, "'input' is a required property.", param="input")
    if isinstance(value, str):
        value = [value]
    elif isinstance(value, list) and value and isinstance(value[0], int):
        value = [value]  # one input given as token ids
    if not isinstance(value, list) or not value:
        raise ApiError(400, "Invalid 'input': expected a string, an array of strings, or "
                       "token ids.", param="input")
    if len(value) > MAX_INPUTS:
        raise ApiError(400, f"Invalid 'input': at most {MAX_INPUTS} inputs per request.",
                       param="input")
    out: list[list[int]] = []
    for i, item in enumerate(value):
        if isinstance(item, str):
            if not item:
                raise ApiError(400, f"Invalid 'input[{i}]': empty string.", param="input")
            out.append(encode_prompt(conductor.tokenizer, item, body))
        elif isinstance(item, list):
            out.append(_ids(item, f"input[{i}]"))
        else:
            raise ApiError(400, f"Invalid 'input[{i}]': expected a string or token ids.",
                           param="input")
        if len(out[-1]) > conductor.cfg.max_prompt_tokens:
            raise ApiError(413, f"This model's maximum input length is "
                           f"{conductor.cfg.max_prompt_tokens} tokens; input {i} has "
                           f"{len(out[-1])}.", param="input", code="prompt_too_long")
    return out


def embeddings_routes(conductor: Conductor) -> APIRouter:
    router = APIRouter()

    @router.post(PATH)
    async def embeddings(request: Request) -> Response:
        opened = await conductor.opened_for_model(request)
        if isinstance(opened, Response):
            return opened
        raw, body, model = opened
        ids = input_ids(conductor, body)
        req = RouteRequest(request_id=conductor.new_request_id(), model=model,
                           token_ids=[t for one in ids for t in one], expected_osl=1,
                           priority=PRIORITY_LEVEL[PriorityTier.STANDARD], overlap_weight=0.0)
        return await conductor.relay("embeddings", req, PATH, raw, stream=False)

    return router
