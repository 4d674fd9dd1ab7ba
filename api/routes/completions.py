"""``POST /v1/completions`` and ``POST /v1/chat/completions``: the hot path.

Plain Starlette handlers (FastAPI's dependency solving costs more than these need: they read the
raw body themselves), installed in front of the middleware stack by :func:`api.app.create_app`
(leanhttp/hotpath.py). They parse the body and hand it to the conductor; several prompts in one
completions request go to :func:`api.routes.batch.serve_batch`.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from fastapi import Request
from fastapi.responses import Response

from api.forward.conductor import Conductor
from api.openai_schema import parse_request
from api.routes.batch import serve_batch
from leanhttp.hotpath import read_body

Handler = Callable[[Request], Awaitable[Response]]


def completions_handlers(conductor: Conductor) -> dict[str, Handler]:
    """The hot routes' handlers by path."""

    async def completions(request: Request) -> Response:
        return await serve(conductor, "completions", request)

    async def chat_completions(request: Request) -> Response:
        return await serve(conductor, "chat", request)

    return {"/v1/completions": completions, "/v1/chat/completions": chat_completions}


async def serve(conductor: Conductor, endpoint: str, request: Request) -> Response:
    received, started = time.time(), time.perf_counter()
    raw = await read_body(request)
    refused = await conductor.admit(request)
    if refused is not None:
        return refused
    parsed = parse_request(endpoint, raw, conductor.tokenizer,
                           max_prompt_tokens=conductor.cfg.max_prompt_tokens,
                           priority_header=request.headers.get("x-priority"), allow_batch=True)
    if parsed.batch is not None:  # several prompts: one routed request each
        return await serve_batch(conductor, parsed, request, received, started)
    return await conductor.serve(endpoint, parsed, raw, request, received, started)
