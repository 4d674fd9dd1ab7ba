"""``/health``, ``/ready``, ``/ready/balancer`` and ``/metrics`` of a replica."""

from __future__ import annotations

import time

import msgspec
from fastapi import APIRouter
from fastapi.responses import Response

from api.metrics import RouterMetrics
from replicas.runtime.replica import Replica


def _json_response(obj: object, status: int = 200) -> Response:
    return Response(msgspec.json.encode(obj), status_code=status, media_type="application/json")


def taking_requests(replica: Replica, decisions: dict[str, object]) -> bool:
    # Not ready while routing decisions cannot be recorded (a load balancer then sends traffic
    # to replicas that can); it turns ready again after a quiet window or at the first decision
    # recorded, so that traffic finds out when JetStream takes appends again.
    return replica.ready and bool(decisions["ok"])


def probes_router(replica: Replica, metrics: RouterMetrics) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health() -> Response:
        return _json_response({"status": "ok", "replica_id": replica.replica_id})

    @router.get("/ready")
    async def ready() -> Response:
        return readiness(replica)

    @router.get("/ready/balancer")
    async def ready_for_balancer() -> Response:
        # The same readiness in the status codes HAProxy's `http-check disable-on-404` reads:
        # 200 ready; 404 alive but not taking new requests (starting, draining, decisions
        # refused) - drained, its streams kept. Only a replica that does not answer at all
        # (dead, paused, stuck) is marked down, and then its sessions may be cut
        # (deploy/haproxy.cfg). A 503 here would count as down and cut healthy streams.
        if taking_requests(replica, replica.decision_log.view(time.monotonic())):
            return _json_response({"ready": True, "replica_id": replica.replica_id})
        return _json_response({"ready": False, "alive": True, "draining": replica.draining,
                               "replica_id": replica.replica_id}, status=404)

    @router.get("/metrics")
    async def metrics_endpoint() -> Response:
        # The replica's own figures are read by the collector at this scrape
        # (api/replica_metrics.py).
        payload, content_type = metrics.render()
        return Response(payload, media_type=content_type)

    return router


def readiness(replica: Replica) -> Response:
    now = time.monotonic()
    decisions = replica.decision_log.view(now)
    if taking_requests(replica, decisions):
        body: dict[str, object] = {"ready": True, "replica_id": replica.replica_id}
        if decisions["unrecorded_for_s"] is not None:  # serving through an election
            body["decision_log"] = decisions
        # Degraded (the event log is unavailable: replicas/runtime/log_outage.py) is still 200.
        # The replica serves every request on the state it has, and so does every other
        # replica cut off from the same NATS: a load balancer that took degraded replicas out
        # would take out the whole fleet and turn a logging outage into an inference outage.
        # The detail is for operators and monitors.
        if replica.outage.degraded(now):
            body["degraded"] = True
            body["event_log"] = replica.outage.view(now)
        return _json_response(body)
    body = {"ready": False, "replica_id": replica.replica_id, "lag": replica.lag(),
            "decision_log": decisions}
    if blocked := replica.blocked_streams():  # stopped at a newer format: upgrade it
        body["blocked_streams"] = blocked
    return _json_response(body, status=503)
