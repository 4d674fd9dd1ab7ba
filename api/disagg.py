"""Disaggregated serving on the request path: the prefill hop and the KV hand-off.

For a model with prefill engines (``Replica.is_disaggregated``) a request gets two routing
decisions, both ``RequestRouted`` events on the router stream (replicas/core/disagg.py):

1. the **prefill decision**, under ``<request_id>~prefill``: the chosen engine computes the
   prompt (``POST /v1/prefill``) and answers with a transfer handle; that hop then ends like any
   other (``PrefillCompleted``, ``RequestFinished``), so its prefill load is freed at once;
2. the **decode decision**, under the request's own id: the chosen engine receives the handle in
   the forwarded body (``"jetrouter": {"kv_transfer": ...}``) and streams the answer.

If no prefill engine can take the request (none registered and healthy, all busy) or the prefill
hop fails (refused connection, 5xx, a malformed answer), the request falls back to aggregated
serving on a decode engine, as Dynamo's router does. A client that goes away during the prefill
hop ends it as ``cancelled``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import msgspec

from api.proxy import classify
from api.upstream import UpstreamError, UpstreamPool
from replicas.core import disagg
from replicas.runtime.replica import (
    DecisionNotRecorded,
    Replica,
    Routed,
    RouteRequest,
    RoutingError,
)

log = logging.getLogger("jetrouter.disagg")

PREFILL_SUFFIX = "~prefill"
PREFILL_PATH = "/v1/prefill"
TRANSFER_KEY = "kv_transfer"


class PrefillFailed(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def prefill_id(request_id: str) -> str:
    return request_id + PREFILL_SUFFIX


def with_transfer(body: bytes, transfer: dict[str, Any]) -> bytes:
    """The forwarded JSON body with the transfer handle in its ``jetrouter`` extension."""
    obj = msgspec.json.decode(body)
    ext = obj.get("jetrouter")
    obj["jetrouter"] = {**(ext if isinstance(ext, dict) else {}), TRANSFER_KEY: transfer}
    return msgspec.json.encode(obj)


class PrefillRouter:
    """Runs the prefill hop of disaggregated requests for one replica.

    ``on_outcome(outcome)`` counts each request: ``disaggregated``, or the reason it fell back
    (``no_prefill_engine``, ``prefill_failed``). ``on_worker_failure(worker_id, reason)`` is the
    Forwarder's passive health signal."""

    def __init__(self, replica: Replica, pool: UpstreamPool, *,
                 on_outcome: Callable[[str], None] | None = None,
                 on_worker_failure: Callable[[str, str], None] | None = None) -> None:
        self.replica = replica
        self.pool = pool
        self.on_outcome = on_outcome
        self.on_worker_failure = on_worker_failure

    async def route(self, req: RouteRequest) -> tuple[Routed, dict[str, Any] | None]:
        """(the decode decision, the transfer handle) or (an aggregated decision, None)."""
        transfer: dict[str, Any] | None = None
        outcome = "no_prefill_engine"
        try:
            pre = await self.replica.route(replace(req, request_id=prefill_id(req.request_id),
                                                   phase=disagg.PREFILL))
        except DecisionNotRecorded:
            raise  # the router stream does not take decisions: the decode one would fail too
        except RoutingError as exc:
            log.info("request %s: no prefill engine (%s); serving it aggregated",
                     req.request_id, exc)
            pre = None
        if pre is not None:
            transfer = await self._prefill(pre, req)
            outcome = "disaggregated" if transfer is not None else "prefill_failed"
        if self.on_outcome is not None:
            self.on_outcome(outcome)
        phase = disagg.DECODE if transfer is not None else disagg.AGGREGATED
        return await self.replica.route(replace(req, phase=phase)), transfer

    async def _prefill(self, pre: Routed, req: RouteRequest) -> dict[str, Any] | None:
        """Run the prefill hop; its handle, or None (hop ended as ``error``) when it failed."""
        outcome, cached = "cancelled", -1
        try:
            answer = await self._call(pre, req)
            transfer = answer.get(TRANSFER_KEY)
            if not isinstance(transfer, dict):
                raise PrefillFailed("bad_answer", "the prefill answer has no kv_transfer")
            usage = answer.get("usage")
            details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
            value = details.get("cached_tokens") if isinstance(details, dict) else None
            cached = value if isinstance(value, int) and value >= 0 else -1
            self.replica.prefill_completed(pre.request_id)
            outcome = "ok"
            return transfer
        except PrefillFailed as exc:
            outcome = "error"
            log.warning("request %s: prefill on %s failed (%s); serving it aggregated",
                        req.request_id, pre.worker_id, exc)
            if self.on_worker_failure is not None and exc.reason != "bad_request":
                self.on_worker_failure(pre.worker_id, exc.reason)
            return None
        finally:
            self.replica.finished(pre.request_id, outcome, 0, cached)

    async def _call(self, pre: Routed, req: RouteRequest) -> dict[str, Any]:
        body = msgspec.json.encode({"model": req.model, "prompt": list(req.token_ids),
                                    "max_tokens": 1, "jetrouter": {"dp_rank": pre.dp_rank}})
        url = pre.worker_url.rstrip("/") + PREFILL_PATH
        headers = {"content-type": "application/json", "x-request-id": pre.request_id}
        try:
            resp = await self.pool.post(url, body, headers)
            try:
                raw = await resp.aread()
            finally:
                resp.close()
        except (UpstreamError, OSError) as exc:
            raise PrefillFailed(classify(exc), f"{type(exc).__name__}: {exc}") from None
        if resp.status_code != 200:
            reason = "bad_request" if 400 <= resp.status_code < 500 else "upstream_5xx"
            raise PrefillFailed(reason, f"HTTP {resp.status_code} {raw[:200]!r}")
        try:
            answer = msgspec.json.decode(raw)
        except msgspec.DecodeError as exc:
            raise PrefillFailed("bad_answer", f"not JSON: {exc}") from None
        if not isinstance(answer, dict):
            raise PrefillFailed("bad_answer", "the prefill answer is not an object")
        return answer
