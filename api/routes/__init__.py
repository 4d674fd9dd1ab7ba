"""The replica's inference routes, one module each: thin HTTP adapters that parse their route's
body and hand the request to :class:`api.forward.conductor.Conductor` (admission, routing,
forwarding). Chat and completions' hot path is :mod:`api.routes.completions`; the others are
FastAPI routers built here."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter

from api.forward.conductor import Conductor
from api.routes.embeddings import embeddings_routes
from api.routes.messages import messages_routes
from api.routes.models import models_routes
from api.routes.responses import responses_routes
from api.routes.tokenize import tokenize_routes

# Each builds an APIRouter of its routes from the app's conductor (api/app.py includes them).
API_ROUTES: tuple[Callable[[Conductor], APIRouter], ...] = (
    models_routes, embeddings_routes, tokenize_routes, responses_routes, messages_routes)
