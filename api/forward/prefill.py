"""Disaggregated serving on the request path: the prefill hop and the KV hand-off.

The prefill hop is the one hop whose lifecycle on the router stream is not in
:mod:`api.forward.run`: it streams nothing to the client, so it is routed, run and ended here,
before the request's run starts on the decode engine.

For a model with prefill engines (``Replica.is_disaggregated``) a request gets two routing
decisions, both ``RequestRouted`` events on the router stream (replicas/core/disagg.py):

1. the **prefill decision**, under ``<request_id>~prefill``: the chosen engine computes the
   prompt (``POST /v1/prefill``) and answers with a transfer handle; that hop then ends like any
   other (``PrefillCompleted``, ``RequestFinished``), so its prefill load is freed at once;
2. the **decode decision**, under the request's own id: the chosen engine receives the handle in
   the forwarded body (``"jetrouter": {"kv_transfer": ...}``) and streams the answer.

The prefill engine is called while the prefill decision's append is on its way; its answer is
used only once the decision is recorded (``Replica.recorded``): a refused one ends the hop
``not_routed`` and the request is answered 503, like a refused decode decision.

If no prefill engine can take the request (none registered and healthy, all busy) or the prefill
hop fails (refused connection, 5xx, a malformed answer), the request falls back to aggregated
serving on a decode engine, as Dynamo's router does. A client that goes away during the prefill
hop ends it as ``cancelled``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from enum import StrEnum
from typing import Any

import msgspec

from api import tracing
from api.forward.engine import HopFailure, classify
from api.upstream import UpstreamError, UpstreamPool
from eventlog.errors import JetrouterError
from eventlog.events import Outcome
from eventlog.names import TRANSFER_KEY, prefill_request_id
from replicas.core import disagg
from replicas.runtime.replica import (
    DecisionNotRecorded,
    Replica,
    Routed,
    RouteRequest,
    RoutingError,
)

log = logging.getLogger("jetrouter.disagg")

PREFILL_PATH = "/v1/prefill"


class DisaggOutcome(StrEnum):
    """How a request of a model with prefill engines was served: the ``outcome`` label of
    ``jetrouter_disaggregated_requests_total``."""

    DISAGGREGATED = "disaggregated"
    NO_PREFILL_ENGINE = "no_prefill_engine"  # none registered, healthy and free: aggregated
    PREFILL_FAILED = "prefill_failed"        # the prefill hop failed: aggregated


class PrefillProblem(StrEnum):
    """Ways a prefill hop fails besides the transport ones (:class:`HopFailure`)."""

    BAD_REQUEST = "bad_request"  # a 4xx: the engine judged the request, not a health signal
    BAD_ANSWER = "bad_answer"    # a 200 without a usable transfer handle


class PrefillFailed(JetrouterError):
    """The prefill hop failed for ``reason``; the request is served aggregated."""

    def __init__(self, reason: HopFailure | PrefillProblem, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


class PrefillRouter:
    """Runs the prefill hop of disaggregated requests for one replica.

    ``on_outcome(outcome)`` counts each request (a :class:`DisaggOutcome`).
    ``on_worker_failure(worker_id, reason)`` is the Forwarder's passive health signal."""

    def __init__(self, replica: Replica, pool: UpstreamPool, *,
                 on_outcome: Callable[[DisaggOutcome], None] | None = None,
                 on_worker_failure: Callable[[str, str], None] | None = None) -> None:
        self.replica = replica
        self.pool = pool
        self.on_outcome = on_outcome
        self.on_worker_failure = on_worker_failure

    async def route(self, req: RouteRequest) -> tuple[Routed, dict[str, Any] | None]:
        """(the decode decision, the transfer handle) or (an aggregated decision, None)."""
        transfer: dict[str, Any] | None = None
        outcome = DisaggOutcome.NO_PREFILL_ENGINE
        try:
            pre = await self.replica.route(replace(
                req, request_id=prefill_request_id(req.request_id), phase=disagg.PREFILL))
        except DecisionNotRecorded:
            raise  # the router stream does not take decisions: the decode one would fail too
        except RoutingError as exc:
            log.info("request %s: no prefill engine (%s); serving it aggregated",
                     req.request_id, exc)
            pre = None
        if pre is not None:
            transfer = await self._prefill(pre, req)
            outcome = (DisaggOutcome.DISAGGREGATED if transfer is not None
                       else DisaggOutcome.PREFILL_FAILED)
        if self.on_outcome is not None:
            self.on_outcome(outcome)
        phase = disagg.DECODE if transfer is not None else disagg.AGGREGATED
        return await self.replica.route(replace(req, phase=phase)), transfer

    async def _prefill(self, pre: Routed, req: RouteRequest) -> dict[str, Any] | None:
        """Run the prefill hop; its handle, or None (hop ended as ``error``) when it failed."""
        outcome, cached = Outcome.CANCELLED, -1
        try:
            try:
                answer = await self._call(pre, req)  # while the decision's append is acked
            finally:
                try:
                    await self.replica.recorded(pre)
                except DecisionNotRecorded:
                    outcome = Outcome.NOT_ROUTED  # the request is answered 503
                    raise
            transfer = answer.get(TRANSFER_KEY)
            if not isinstance(transfer, dict):
                raise PrefillFailed(PrefillProblem.BAD_ANSWER,
                                    "the prefill answer has no kv_transfer")
            usage = answer.get("usage")
            details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
            value = details.get("cached_tokens") if isinstance(details, dict) else None
            cached = value if isinstance(value, int) and value >= 0 else -1
            self.replica.prefill_completed(pre.request_id)
            outcome = Outcome.OK
            return transfer
        except PrefillFailed as exc:
            outcome = Outcome.ERROR
            log.warning("request %s: prefill on %s failed (%s); serving it aggregated",
                        req.request_id, pre.worker_id, exc)
            if self.on_worker_failure is not None and exc.reason != PrefillProblem.BAD_REQUEST:
                self.on_worker_failure(pre.worker_id, exc.reason)
            return None
        finally:
            self.replica.finished(pre.request_id, outcome, 0, cached)

    async def _call(self, pre: Routed, req: RouteRequest) -> dict[str, Any]:
        body = msgspec.json.encode({"model": req.model, "prompt": list(req.token_ids),
                                    "max_tokens": 1, "jetrouter": {"dp_rank": pre.dp_rank}})
        url = pre.worker_url.rstrip("/") + PREFILL_PATH
        headers = {"content-type": "application/json", "x-request-id": pre.request_id}
        tracing.start_hop(pre.request_id, url, headers)
        try:
            resp = await self.pool.post(url, body, headers)
            tracing.hop_answered(pre.request_id, resp.status_code)
            try:
                raw = await resp.aread()
            finally:
                resp.close()
        except (UpstreamError, OSError) as exc:
            tracing.hop_answered(pre.request_id, failure=classify(exc))
            raise PrefillFailed(classify(exc), f"{type(exc).__name__}: {exc}") from None
        if resp.status_code != 200:
            reason: HopFailure | PrefillProblem = (
                PrefillProblem.BAD_REQUEST if 400 <= resp.status_code < 500
                else HopFailure.UPSTREAM_5XX)
            raise PrefillFailed(reason, f"HTTP {resp.status_code} {raw[:200]!r}")
        try:
            answer = msgspec.json.decode(raw)
        except msgspec.DecodeError as exc:
            raise PrefillFailed(PrefillProblem.BAD_ANSWER, f"not JSON: {exc}") from None
        if not isinstance(answer, dict):
            raise PrefillFailed(PrefillProblem.BAD_ANSWER,
                                "the prefill answer is not an object")
        return answer
