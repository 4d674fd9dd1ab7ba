"""The replica's inference routes beyond chat and completions' hot path, one module each, all
built on :class:`api.routes.gateway.Gateway` (admission, routing, forwarding)."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter

from api.routes.gateway import Gateway

# Each builds an APIRouter of its routes from the app's gateway (api/app.py includes them).
API_ROUTES: tuple[Callable[[Gateway], APIRouter], ...] = ()
