"""``GET|POST /busy_threshold``: Dynamo's busy-threshold API (design.md §6).

A POST appends the model's new thresholds to the router stream (every replica applies them);
fields left out keep their value, an explicit null clears one.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import Response

from api.admin import require_admin
from api.errors import ApiError
from api.openai_schema import decode_json
from eventlog.events import MAX_COUNT, MAX_RATIO
from replicas.runtime.replica import Replica

KEYS = ("active_decode_blocks_threshold", "active_prefill_tokens_threshold",
        "active_prefill_tokens_threshold_frac")


def _json_response(obj: object) -> Response:
    return Response(msgspec.json.encode(obj), media_type="application/json")


def object_body(raw: bytes) -> dict[str, object]:
    body = decode_json(raw)
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def threshold_doc(replica: Replica, model: str) -> dict[str, object]:
    t = replica.state.thresholds.get(model)
    doc: dict[str, object] = {
        "model": model,
        "active_decode_blocks_threshold": t.active_decode_blocks_threshold if t else None,
        "active_prefill_tokens_threshold": t.active_prefill_tokens_threshold if t else None,
    }
    if t and t.active_prefill_tokens_threshold_frac is not None:
        doc["active_prefill_tokens_threshold_frac"] = t.active_prefill_tokens_threshold_frac
    return doc


def thresholds_router(replica: Replica, cfg: Any) -> APIRouter:
    """``cfg``: :class:`api.app.AppConfig` (``busy_threshold_requires_admin``,
    ``admin_token``)."""
    router = APIRouter()

    @router.get("/busy_threshold")
    async def get_busy_thresholds() -> Response:
        return _json_response({"thresholds": [threshold_doc(replica, m)
                                              for m in sorted(replica.state.thresholds)]})

    @router.post("/busy_threshold")
    async def post_busy_threshold(request: Request) -> Response:
        if cfg.busy_threshold_requires_admin:
            # One POST can mark every engine busy and so refuse all traffic.
            require_admin(request, cfg.admin_token)
        body = object_body(await request.body())
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise ApiError(400, "`model` is required and must be a string", param="model")
        await set_thresholds(replica, model, body)
        return _json_response(threshold_doc(replica, model))

    return router


async def set_thresholds(replica: Replica, model: str, body: dict[str, object]) -> None:
    decode = _optional_number(body, "active_decode_blocks_threshold", 0.0, 1.0)
    tokens = _optional_number(body, "active_prefill_tokens_threshold", 0, MAX_COUNT,
                              integer=True)
    frac = _optional_number(body, "active_prefill_tokens_threshold_frac", 0.0, MAX_RATIO)
    if not any(k in body for k in KEYS):
        return
    current = replica.state.thresholds.get(model)
    # Fields left out keep their value; an explicit null clears one.
    if current is not None:
        decode = decode if "active_decode_blocks_threshold" in body \
            else current.active_decode_blocks_threshold
        tokens = tokens if "active_prefill_tokens_threshold" in body \
            else current.active_prefill_tokens_threshold
        frac = frac if "active_prefill_tokens_threshold_frac" in body \
            else current.active_prefill_tokens_threshold_frac
    await replica.set_busy_thresholds(model, decode,  # type: ignore[arg-type]
                                      tokens, frac)  # type: ignore[arg-type]


def _optional_number(body: dict[str, object], key: str, lo: float, hi: float, *,
                     integer: bool = False) -> float | int | None:
    if key not in body or body[key] is None:
        return None
    v = body[key]
    ok = isinstance(v, int) if integer else isinstance(v, int | float)
    # The value travels in a router-stream event, whose bounds (eventlog/events.py) every
    # replica checks when it reads it: past them the event could not be encoded (a 500, found
    # by the HTTP fuzz tests) or would be skipped as malformed everywhere.
    if (isinstance(v, bool) or not ok or not math.isfinite(v)  # type: ignore[arg-type]
            or v < lo or v > hi):  # type: ignore[operator]
        rng = f"between {lo} and {hi:g}"
        kind = "an integer" if integer else "a number"
        raise ApiError(400, f"`{key}` must be {kind} {rng}", param=key)
    return v if integer else float(v)  # type: ignore[arg-type]
