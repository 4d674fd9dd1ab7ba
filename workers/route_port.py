"""What the simulated engine's extra routes (pooling, Responses, Messages) need of its runtime:
a view of :class:`workers.server.WorkerRuntime`, so those modules do not import the server that
imports them; and the request-body check they share."""

from __future__ import annotations

import json
from typing import Any, Protocol

from fastapi import Request

from tokenization.model_tokenizer import Codec
from workers.engine import Engine


class RouteSettings(Protocol):
    @property
    def worker_id(self) -> str: ...
    @property
    def model(self) -> str: ...


class EngineRuntime(Protocol):
    @property
    def settings(self) -> RouteSettings: ...
    @property
    def codec(self) -> Codec: ...
    @property
    def draining(self) -> bool: ...

    def pick_engine(self, dp_rank: int | None) -> Engine: ...


async def json_object(request: Request) -> dict[str, Any] | str:
    """The request's body as a JSON object, or why it is not one (each route answers that in
    its own error shape: OpenAI's or Anthropic's)."""
    try:
        body = json.loads(await request.body())
    except (ValueError, RecursionError):
        return "request body is not valid JSON"
    if not isinstance(body, dict):
        return "request body must be a JSON object"
    return body
