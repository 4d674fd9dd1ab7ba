"""Admin API behind a bearer token (design.md §9): state, workers, and (later) snapshots."""

from __future__ import annotations

from typing import Any

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import Response

from api.errors import ApiError
from replicas.runtime import Replica

_json = msgspec.json.Encoder()


def _json_response(obj: object, status: int = 200) -> Response:
    return Response(_json.encode(obj), status_code=status, media_type="application/json")


def admin_router(replica: Replica, cfg: Any) -> APIRouter:
    router = APIRouter()
    admin_token: str | None = cfg.admin_token

    # --- admin (bearer token) --------------------------------------------------------------------

    def check_admin(request: Request) -> None:
        if not admin_token:
            raise ApiError(403, "the admin API is disabled: start the replica with --admin-token "
                           "TOKEN (or JETROUTER_ADMIN_TOKEN) to enable it",
                           type="permission_error")
        auth = request.headers.get("authorization", "")
        if not auth:
            raise ApiError(401, "missing bearer token: send `Authorization: Bearer TOKEN`",
                           type="authentication_error",
                           headers={"www-authenticate": "Bearer"})
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or token.strip() != admin_token:
            raise ApiError(403, "invalid admin token", type="permission_error")

    @router.get("/admin/state")
    async def admin_state(request: Request) -> Response:
        check_admin(request)
        state = replica.state
        return _json_response({
            "replica_id": replica.replica_id,
            "ready": replica.ready,
            "leader": False,
            "epoch": state.epoch,
            "positions": state.positions,
            "digests": {k: f"{v:016x}" for k, v in state.digests().items()},
            "lag": replica.lag(),
            "snapshot_threshold": state.snapshot_threshold,
            "event_time": state.now,
            "workers": len(state.workers),
            "active_requests": len(state.load),
            "malformed_messages": replica.malformed,
        })

    @router.get("/admin/workers")
    async def admin_workers(request: Request) -> Response:
        check_admin(request)
        state = replica.state
        out = []
        for w in sorted(state.workers.values(), key=lambda w: w.worker_id):
            keys = [(w.worker_id, r) for r in range(w.dp_size)]
            out.append({
                "worker_id": w.worker_id, "url": w.url, "model": w.model,
                "block_size": w.block_size, "kv_total_blocks": w.kv_total_blocks,
                "dp_size": w.dp_size, "health": state.health.get(w.worker_id, "healthy"),
                "cached_blocks": sum(state.index.tree_size(k) for k in keys),
                "active_prefill_tokens": sum(state.load.active_prefill_tokens(k) for k in keys),
                "active_decode_blocks": sum(state.load.active_decode_blocks(k) for k in keys),
                "out_of_sync": w.worker_id in state.out_of_sync,
            })
        return _json_response({"workers": out})

    return router
