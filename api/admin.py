"""Admin API behind a bearer token (design.md §9): state, workers, snapshots, reset, ledger."""

from __future__ import annotations

import contextlib
import hmac
import time
from typing import Any

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import Response

from api.errors import ApiError
from api.openai_schema import decode_json
from eventlog.events import MAX_COUNT
from eventlog.names import CONTROL, ROUTER
from replicas.runtime.replica import Replica

_json = msgspec.json.Encoder()
# How long a snapshot listing or a decision lookup waits for the projector to write what this
# replica has seen.
LISTING_WAIT = 2.0


def _json_response(obj: object, status: int = 200) -> Response:
    return Response(_json.encode(obj), status_code=status, media_type="application/json")


def require_admin(request: Request, admin_token: str | None) -> None:
    """Raise 403 (admin API disabled, wrong token) or 401 (no token) unless ``request`` carries
    ``Authorization: Bearer <admin_token>``.

    The comparison is constant-time (``hmac.compare_digest`` on bytes): ``!=`` on strings stops
    at the first differing character, and that timing difference lets a client that can measure
    many requests guess the token one character at a time."""
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
    # compare_digest takes bytes of any content (str only when ASCII); a length difference
    # still answers at once, which reveals only the token's length.
    given = token.strip().encode("utf-8", "surrogateescape")
    wanted = admin_token.encode("utf-8", "surrogateescape")
    if not hmac.compare_digest(given, wanted) or scheme.lower() != "bearer":
        raise ApiError(403, "invalid admin token", type="permission_error")


def admin_router(replica: Replica, cfg: Any) -> APIRouter:
    router = APIRouter()
    admin_token: str | None = cfg.admin_token

    # --- admin (bearer token) --------------------------------------------------------------------

    def check_admin(request: Request) -> None:
        require_admin(request, admin_token)

    @router.get("/admin/state")
    async def admin_state(request: Request) -> Response:
        check_admin(request)
        state = replica.state
        return _json_response({
            "replica_id": replica.replica_id,
            "ready": replica.ready,
            "leader": replica.leader.is_leader if replica.leader else False,
            "epoch": state.epoch,
            "positions": state.positions,
            "digests": {k: f"{v:016x}" for k, v in state.digests().items()},
            "lag": replica.lag(),
            "snapshot_threshold": threshold(),
            "messages_since_snapshot": (replica.leader.messages_since_snapshot()
                                        if replica.leader else None),
            "last_snapshot": (state.last_snapshot.snapshot_id if state.last_snapshot else None),
            "restores": replica.restores,
            "event_time": state.now,
            "workers": len(state.workers),
            "active_requests": len(state.load),
            "sessions": len(state.sessions),
            "stored_responses": len(state.responses),  # Responses API ids -> their engine
            "malformed_messages": replica.malformed_counts(),
            # Streams stopped at a message in a newer format (stream -> why): upgrade this one.
            "blocked_streams": replica.blocked_streams(),
            # Decisions routed here and not yet seen back from the stream (optimistic overlay).
            "pending_decisions": replica.pending_decisions(),
            "decision_log": replica.decision_log.view(time.monotonic()),
            # Degraded mode: whether the event log takes appends, and what was not appended.
            "event_log": replica.outage.view(time.monotonic()),
            # Decoding + applying other replicas' router messages (bench scale's share).
            "replication": replica.replication.view(),
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
                "dp_size": w.dp_size, "role": w.role, "engine_kind": w.engine_kind,
                "bootstrap_port": w.bootstrap_port or None,
                "health": state.health.get(w.worker_id, "healthy"),
                "cached_blocks": sum(state.index.tree_size(k) for k in keys),
                # What routing judges by: prefill decayed to event time, output blocks weighted.
                "active_prefill_tokens": round(sum(state.load.active_prefill_tokens(k, state.now)
                                                   for k in keys), 3),
                "active_decode_blocks": round(sum(state.load.active_decode_blocks(k)
                                                  for k in keys), 3),
                "out_of_sync": w.worker_id in state.out_of_sync,
                "status": "ok", "reason": None,
            })
        for w in sorted(state.refused_workers.values(), key=lambda w: w.worker_id):
            # Listed so an operator sees why a started engine takes no traffic.
            out.append({
                "worker_id": w.worker_id, "url": w.url, "model": w.model,
                "block_size": w.block_size, "kv_total_blocks": w.kv_total_blocks,
                "dp_size": w.dp_size, "health": "refused", "cached_blocks": 0,
                "active_prefill_tokens": 0, "active_decode_blocks": 0, "out_of_sync": False,
                "status": "refused", "reason": state.refusal_reason(w.worker_id),
            })
        return _json_response({"workers": out})

    def durability() -> Any:
        if replica.leader is None:
            raise ApiError(503, "snapshots are disabled on this replica",
                           type="service_unavailable")
        return replica.leader

    def threshold() -> int | None:
        d = replica.leader
        return d.threshold if d is not None else replica.state.snapshot_threshold

    async def leader_call(verb: str, payload: dict[str, Any]) -> dict[str, Any]:
        from replicas.runtime.leader import LeaderOperationFailed, NoLeader

        try:
            result = await durability().request(verb, payload)
            seq = result.get("control_seq")
            if isinstance(seq, int):
                # Answered once this replica has the operation's control message too (the
                # leader may be another replica), so what is asked of it next reflects it.
                with contextlib.suppress(TimeoutError):
                    await replica.wait_applied(CONTROL, seq, LISTING_WAIT)
            return result
        except NoLeader as exc:
            raise ApiError(503, f"{exc}; retry in a few seconds",
                           type="service_unavailable") from None
        except LeaderOperationFailed as exc:
            # Not a bug in the request: JetStream refused or timed out a write (a NATS node
            # lost, a bucket removed). Say what failed; the admin decides whether to retry.
            raise ApiError(503, str(exc), type="service_unavailable") from None

    @router.post("/admin/snapshot")
    async def admin_snapshot(request: Request) -> Response:
        check_admin(request)
        return _json_response(await leader_call("snapshot", {"trigger": "admin"}))

    @router.get("/admin/snapshots")
    async def admin_snapshots(request: Request) -> Response:
        check_admin(request)
        if replica.projections is not None:
            # Everything this replica has seen of the control stream is listed (the projector
            # child writes the catalogue), unless the projector is behind by more than
            # LISTING_WAIT.
            await replica.projections.reached(CONTROL, replica.seen(CONTROL), LISTING_WAIT)
            rows = await replica.projections.snapshots()
        else:
            rows = [msgspec.structs.asdict(m) if isinstance(m, msgspec.Struct) else vars(m)
                    for m in await durability().store.list()]
        return _json_response({"snapshots": rows})

    @router.post("/admin/reset")
    async def admin_reset(request: Request) -> Response:
        check_admin(request)
        return _json_response(await leader_call("reset", {"reason": "admin"}))

    @router.get("/admin/snapshot-threshold")
    async def get_snapshot_threshold(request: Request) -> Response:
        check_admin(request)
        return _json_response({"threshold": threshold()})

    @router.put("/admin/snapshot-threshold")
    async def put_snapshot_threshold(request: Request) -> Response:
        check_admin(request)
        body = decode_json(await request.body())
        value = body.get("threshold") if isinstance(body, dict) else None
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_COUNT:
            raise ApiError(400, "`threshold` must be a positive integer (messages between "
                           f"snapshots) up to {MAX_COUNT}", param="threshold")
        await replica.set_snapshot_threshold(value)
        return _json_response({"threshold": threshold()})

    @router.get("/admin/replicas")
    async def admin_replicas(request: Request) -> Response:
        check_admin(request)
        return _json_response({"replicas": await replica.peers_view()})

    @router.get("/admin/sessions")
    async def admin_sessions(request: Request) -> Response:
        """Sticky sessions: which engine each is pinned to and when its TTL (event time) ends.
        ``engine_usable`` false: the engine is gone or unhealthy, its next turn re-pins."""
        check_admin(request)
        state = replica.state
        rows = []
        for pin in sorted(state.sessions, key=lambda p: p.session_id):
            row = pin.view(state.now)
            info = state.workers.get(pin.worker[0])
            row["engine_usable"] = info is not None and state.health.get(
                pin.worker[0], "healthy") != "unhealthy"
            rows.append(row)
        return _json_response({"event_time": state.now, "sessions": rows})

    @router.get("/admin/requests/{request_id}")
    async def admin_request(request_id: str, request: Request) -> Response:
        check_admin(request)
        if replica.projections is None:
            raise ApiError(503, "the decision ledger is disabled on this replica",
                           type="service_unavailable")
        row = await replica.projections.request(request_id)
        if row is None:
            # Not in the ledger yet, perhaps: the projector writes it a moment after the
            # request was answered. Asked again once it has what this replica has seen.
            await replica.projections.reached(ROUTER, replica.seen(ROUTER), LISTING_WAIT)
            row = await replica.projections.request(request_id)
        if row is None:
            raise ApiError(404, f"no routing decision recorded for request {request_id!r}",
                           param="request_id")
        return _json_response(row)

    return router
