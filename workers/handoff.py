"""The simulated engine's side of disaggregated serving: the KV hand-off.

A prefill engine answers ``POST /v1/prefill`` (a completions-shaped body whose ``prompt`` is the
token ids the router routed by): it computes the prompt like any request with one output token,
keeps the prompt's blocks in its prefix cache (published as usual, so the router's index sees
them), and answers with a *transfer handle*::

    {"kv_transfer": {"handle": "<worker>/<request>", "worker_id": ..., "block_size": 16,
                     "prompt_tokens": n, "block_hashes": [tokens_hash, ...]},
     "usage": {...}}

The router passes the handle on to the decode engine inside the request body
(``"jetrouter": {"kv_transfer": {...}}``). The decode engine checks the handle's block hashes
against its own hashing of the prompt, treats the leading blocks that agree as computed, and pays
the transfer cost for those it did not already hold (``workers/scheduler.py``). A handle that
does not fit the prompt (another block size, another prompt) transfers nothing: the engine
computes the prompt itself, which is slower, never wrong.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from eventlog.hashing import tokens_hashes
from eventlog.names import TRANSFER_KEY
from workers.openai_shapes import BadRequest, error_body, parse_request, usage


def transferred_tokens(ext: dict[str, Any], prompt: list[int], block_size: int) -> int:
    """Prompt tokens covered by the transfer handle in a request's ``jetrouter`` extension:
    the leading whole blocks whose hashes agree with this engine's own hashing of ``prompt``."""
    handle = ext.get(TRANSFER_KEY)
    if not isinstance(handle, dict) or handle.get("block_size") != block_size:
        return 0
    theirs = handle.get("block_hashes")
    if not isinstance(theirs, list):
        return 0
    ours = tokens_hashes(prompt[:len(prompt) // block_size * block_size], block_size)
    n = 0
    for mine, other in zip(ours, theirs, strict=False):
        if mine != other:
            break
        n += 1
    return n * block_size


def add_prefill_route(app: FastAPI, runtime: Any) -> None:
    """``POST /v1/prefill`` on a worker app (``runtime`` is its ``WorkerRuntime``)."""
    settings = runtime.settings

    @app.post("/v1/prefill")
    async def prefill(request: Request) -> Response:
        if runtime.draining:
            return JSONResponse(error_body("worker is shutting down", "service_unavailable",
                                           None, 503), status_code=503)
        try:
            body = json.loads(await request.body())
            parsed = parse_request(body, chat=False, default_max_tokens=1,
                                   header_request_id=request.headers.get("x-request-id"),
                                   codec=runtime.codec)
        except (ValueError, RecursionError, BadRequest) as exc:
            param = exc.param if isinstance(exc, BadRequest) else None
            return JSONResponse(error_body(str(exc), "invalid_request_error", param, 400),
                                status_code=400)
        if parsed.model is not None and parsed.model != settings.model:
            return JSONResponse(error_body(f"The model `{parsed.model}` does not exist.",
                                           "NotFoundError", "model", 404), status_code=404)
        ext = body.get("jetrouter") if isinstance(body.get("jetrouter"), dict) else {}
        rank = ext.get("dp_rank")
        engine = runtime.pick_engine(rank if isinstance(rank, int) else None)
        request_id = parsed.request_id or uuid.uuid4().hex
        try:
            handle = engine.submit(request_id, parsed.prompt_ids, 1)
        except ValueError as exc:
            return JSONResponse(error_body(str(exc), "invalid_request_error", "prompt", 400),
                                status_code=400)
        runtime.metrics.in_flight.inc()
        try:
            async for _ in handle.tokens():
                pass
        finally:
            runtime.metrics.in_flight.dec()
            if not handle.finished:
                handle.abort()  # the router went away: free the blocks
        bs = settings.engine.block_size
        prompt = parsed.prompt_ids
        runtime.metrics.count("prefill", "ok")
        return JSONResponse({
            TRANSFER_KEY: {
                "handle": f"{settings.worker_id}/{request_id}",
                "worker_id": settings.worker_id,
                "block_size": bs,
                "prompt_tokens": len(prompt),
                "block_hashes": tokens_hashes(prompt[:len(prompt) // bs * bs], bs),
            },
            "usage": usage(handle.prompt_tokens, 0, handle.cached_tokens),
        }, headers={"x-jetrouter-worker": settings.worker_id,
                    "x-jetrouter-dp-rank": str(engine.dp_rank)})
