"""``GET /v1/models``: the models the registered engines serve."""

from __future__ import annotations

import msgspec
from fastapi import APIRouter
from fastapi.responses import Response

from api.forward.conductor import Conductor


def models_routes(conductor: Conductor) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/models")
    async def models() -> Response:
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "jetrouter"}
                for m in conductor.replica.models()]
        return Response(msgspec.json.encode({"object": "list", "data": data}),
                        media_type="application/json", headers=conductor.headers())

    return router
