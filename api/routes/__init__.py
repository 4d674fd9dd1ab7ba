"""The replica's inference routes beyond chat and completions' hot path, one module each, all
built on :class:`api.routes.gateway.Gateway` (admission, routing, forwarding)."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter

from api.routes.embeddings import embeddings_routes
from api.routes.gateway import Gateway
from api.routes.messages import messages_routes
from api.routes.responses import responses_routes
from api.routes.tokenize import tokenize_routes

# Each builds an APIRouter of its routes from the app's gateway (api/app.py includes them).
API_ROUTES: tuple[Callable[[Gateway], APIRouter], ...] = (
    embeddings_routes, tokenize_routes, responses_routes, messages_routes)
