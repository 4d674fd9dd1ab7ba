"""The simulated engine's routes that generate nothing: ``/v1/embeddings``, ``/tokenize`` and
``/detokenize``, in vLLM's shapes.

An embedding is a deterministic fake: a unit vector drawn from a hash of the input's token ids,
so the same input gives the same vector on every engine (what a test of routing can check) and
different inputs differ. ``encoding_format: "base64"`` (the official client's default) packs the
floats as little-endian float32, as OpenAI does.
"""

from __future__ import annotations

import base64
import hashlib
import math
import struct
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tokenization.model_tokenizer import ChatTemplateFailed
from tokenization.tokens import MAX_TOKEN_ID
from workers.openai_shapes import error_body
from workers.route_port import EngineRuntime, json_object

DIMENSIONS = 32
MAX_DIMENSIONS = 4096


def fake_embedding(ids: list[int], dimensions: int = DIMENSIONS) -> list[float]:
    seed = hashlib.sha256(struct.pack(f"<{len(ids)}Q", *ids)).digest()
    values: list[float] = []
    block = 0
    while len(values) < dimensions:
        digest = hashlib.sha256(seed + block.to_bytes(4, "little")).digest()
        values.extend((b - 127.5) / 127.5 for b in digest)
        block += 1
    vector = values[:dimensions]
    norm = math.sqrt(sum(v * v for v in vector)) or 1.0
    return [v / norm for v in vector]


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    kind = "NotFoundError" if status == 404 else "invalid_request_error"
    return JSONResponse(error_body(message, kind, param, status), status_code=status)


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_TOKEN_ID for t in value)


async def _body(request: Request) -> dict[str, Any] | JSONResponse:
    body = await json_object(request)
    return _error(400, body) if isinstance(body, str) else body


def add_pooling_routes(app: FastAPI, runtime: EngineRuntime) -> None:
    settings = runtime.settings
    codec = runtime.codec

    def wrong_model(body: dict[str, Any]) -> JSONResponse | None:
        model = body.get("model")
        if model is not None and model != settings.model:
            return _error(404, f"The model `{model}` does not exist.", "model")
        return None

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        body = await _body(request)
        if isinstance(body, JSONResponse):
            return body
        if (refused := wrong_model(body)) is not None:
            return refused
        value = body.get("input")
        inputs = [value] if isinstance(value, str) or _is_ids(value) else value
        if not isinstance(inputs, list) or not inputs:
            return _error(400, "input must be a string, token ids, or a list of those", "input")
        dims = body.get("dimensions", DIMENSIONS)
        if not isinstance(dims, int) or isinstance(dims, bool) or \
                not 1 <= dims <= MAX_DIMENSIONS:
            return _error(400, f"dimensions must be an integer in [1, {MAX_DIMENSIONS}]",
                          "dimensions")
        b64 = body.get("encoding_format") == "base64"
        data: list[dict[str, Any]] = []
        total = 0
        for i, item in enumerate(inputs):
            if isinstance(item, str) and item:
                ids = codec.encode_prompt(item, True)
            elif _is_ids(item):
                ids = list(item)
            else:
                return _error(400, f"input[{i}] must be a non-empty string or token ids",
                              "input")
            total += len(ids)
            vector = fake_embedding(ids, dims)
            embedding: Any = (base64.b64encode(struct.pack(f"<{dims}f", *vector)).decode()
                              if b64 else vector)
            data.append({"object": "embedding", "index": i, "embedding": embedding})
        return JSONResponse({"object": "list", "data": data, "model": settings.model,
                             "usage": {"prompt_tokens": total, "total_tokens": total}},
                            headers={"x-jetrouter-worker": settings.worker_id})

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        body = await _body(request)
        if isinstance(body, JSONResponse):
            return body
        if (refused := wrong_model(body)) is not None:
            return refused
        if "messages" in body:
            messages = body["messages"]
            if not isinstance(messages, list) or not messages:
                return _error(400, "messages must be a non-empty list", "messages")
            try:
                ids = codec.encode_chat(messages, body)
            except ChatTemplateFailed as exc:
                return _error(400, str(exc), "messages")
        elif isinstance(body.get("prompt"), str):
            add = body.get("add_special_tokens")
            ids = codec.encode_prompt(body["prompt"], add if isinstance(add, bool) else True)
        else:
            return _error(400, "prompt must be a string (or give messages)", "prompt")
        return JSONResponse({"count": len(ids), "max_model_len": 2**31 - 1, "tokens": ids,
                             "token_strs": None},
                            headers={"x-jetrouter-worker": settings.worker_id})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        body = await _body(request)
        if isinstance(body, JSONResponse):
            return body
        if (refused := wrong_model(body)) is not None:
            return refused
        ids = body.get("tokens")
        if not isinstance(ids, list) or not (ids == [] or _is_ids(ids)):
            return _error(400, "tokens must be a list of token ids", "tokens")
        return JSONResponse({"prompt": codec.decode(ids)},
                            headers={"x-jetrouter-worker": settings.worker_id})
