"""Disaggregated serving on the request path: the prefill hop and the KV hand-off.

The prefill hop is the one hop whose lifecycle on the router stream is not in
:mod:`api.forward.run`: it streams nothing to the client, so it is routed, run and ended here,
before the request's run starts on the decode engine.

For a model with prefill engines, or with decode engines whose prefill engines all retired
(``Replica.is_disaggregated``), a request gets two routing decisions, both ``RequestRouted``
events on the router stream (replicas/core/disagg.py):

1. the **prefill decision**, under ``<request_id>~prefill``: the chosen engine computes the
   prompt and answers with a transfer handle; that hop then ends like any other
   (``PrefillCompleted``, ``RequestFinished``), so its prefill load is freed at once;
2. the **decode decision**, under the request's own id: the chosen engine receives the handle in
   the forwarded body and streams the answer.

The hand-off speaks the prefill engine's protocol (``WorkerRegistered.engine_kind``):

* **vLLM** (:mod:`api.forward.vllm_handoff`): the client's request with ``kv_transfer_params:
  {"do_remote_decode": true}``, one token, not streamed, on the route the client used; the
  answer's ``kv_transfer_params`` go to the decode engine at the top level of its body, and it
  pulls the blocks (NIXL) instead of computing the prompt;
* **jetrouter** (the simulated engine, workers/handoff.py): ``POST /v1/prefill`` with the
  routed token ids; the handle goes to the decode engine as ``"jetrouter": {"kv_transfer":
  ...}``.

Either way ``route`` returns the decode hop's hand-off as the fields to set in its body
(:func:`api.forward.continuation.with_transfer`). Clients may not send these fields themselves
(api/handoff_fields.py).

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
from api.forward import vllm_handoff
from api.forward.engine import HopFailure, classify
from api.upstream import UpstreamError, UpstreamPool
from eventlog.errors import JetrouterError
from eventlog.events import EngineKind, Outcome
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
    ``jetrouter_disaggregated_requests_total``. Each request counts once as
    ``disaggregated`` (the prefill engine handed its KV over), ``no_prefill_engine`` or
    ``prefill_failed``; a hand-off the decode engine then could not use counts once more, as
    ``pull_failed`` (:class:`api.forward.run.Run`), so requests served disaggregated are
    ``disaggregated`` minus ``pull_failed``."""

    DISAGGREGATED = "disaggregated"
    NO_PREFILL_ENGINE = "no_prefill_engine"  # none registered, healthy and free: aggregated
    PREFILL_FAILED = "prefill_failed"        # the prefill hop failed: aggregated
    # The decode engine could not pull the blocks (the prefill engine died or restarted, its
    # lease ran out): the prompt was computed without the hand-off after all.
    PULL_FAILED = "pull_failed"


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
    ``on_worker_failure(worker_id, reason)`` is the Forwarder's passive health signal.
    ``on_transfer(blocks)`` counts the KV blocks each successful hand-off names."""

    def __init__(self, replica: Replica, pool: UpstreamPool, *,
                 on_outcome: Callable[[DisaggOutcome], None] | None = None,
                 on_worker_failure: Callable[[str, str], None] | None = None,
                 on_transfer: Callable[[int], None] | None = None) -> None:
        self.replica = replica
        self.pool = pool
        self.on_outcome = on_outcome
        self.on_worker_failure = on_worker_failure
        self.on_transfer = on_transfer  # KV blocks of each hand-off

    async def route(self, req: RouteRequest, *, endpoint: str = "completions",
                    body: dict[str, Any] | None = None
                    ) -> tuple[Routed, dict[str, Any] | None]:
        """(the decode decision, the fields that hand the KV over in the decode hop's body) or
        (an aggregated decision, None). ``endpoint`` ("completions" or "chat") and ``body``
        (the client's JSON body) make a vLLM prefill engine's request."""
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
            transfer = await self._prefill(pre, req, endpoint, body)
            outcome = (DisaggOutcome.DISAGGREGATED if transfer is not None
                       else DisaggOutcome.PREFILL_FAILED)
        if self.on_outcome is not None:
            self.on_outcome(outcome)
        phase = disagg.DECODE if transfer is not None else disagg.AGGREGATED
        return await self.replica.route(replace(req, phase=phase)), transfer

    def engine_kind(self, worker_id: str) -> str:
        info = self.replica.state.workers.get(worker_id)
        return info.engine_kind if info is not None else EngineKind.JETROUTER

    async def _prefill(self, pre: Routed, req: RouteRequest, endpoint: str,
                       body: dict[str, Any] | None) -> dict[str, Any] | None:
        """Run the prefill hop; the decode hop's hand-off fields, or None (hop ended as
        ``error``) when it failed."""
        outcome, cached = Outcome.CANCELLED, -1
        vllm = self.engine_kind(pre.worker_id) == EngineKind.VLLM
        try:
            try:  # the engine is asked while the decision's append is acked
                if vllm:
                    if body is None:  # a caller without the client's body: nothing to send
                        raise PrefillFailed(PrefillProblem.BAD_REQUEST,
                                            "no client body for a vLLM prefill request")
                    answer = await self._call(pre, vllm_handoff.engine_path(endpoint),
                                              vllm_handoff.prefill_body(body))
                else:
                    answer = await self._call(pre, PREFILL_PATH, {
                        "model": req.model, "prompt": list(req.token_ids), "max_tokens": 1,
                        "jetrouter": {"dp_rank": pre.dp_rank}})
            finally:
                try:
                    await self.replica.recorded(pre)
                except DecisionNotRecorded:
                    outcome = Outcome.NOT_ROUTED  # the request is answered 503
                    raise
            transfer = _handoff(answer, vllm)
            if self.on_transfer is not None:
                self.on_transfer(_blocks(transfer))
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

    async def _call(self, pre: Routed, path: str, request: dict[str, Any]) -> dict[str, Any]:
        url = pre.worker_url.rstrip("/") + path
        headers = {"content-type": "application/json", "x-request-id": pre.request_id}
        tracing.start_hop(pre.request_id, url, headers)
        try:
            resp = await self.pool.post(url, msgspec.json.encode(request), headers)
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


def _handoff(answer: dict[str, Any], vllm: bool) -> dict[str, Any]:
    """The fields that hand the prompt's KV over in the decode hop's body, from the prefill
    engine's answer; PrefillFailed (bad_answer) when the answer holds no usable handle."""
    if vllm:
        params = vllm_handoff.transfer_params(answer)
        if isinstance(params, str):
            raise PrefillFailed(PrefillProblem.BAD_ANSWER, params)
        return {vllm_handoff.KV_TRANSFER_PARAMS: params}
    handle = answer.get(TRANSFER_KEY)
    if not isinstance(handle, dict):
        raise PrefillFailed(PrefillProblem.BAD_ANSWER, "the prefill answer has no kv_transfer")
    return {"jetrouter": {TRANSFER_KEY: handle}}


def _blocks(transfer: dict[str, Any]) -> int:
    """The KV blocks a hand-off names (vLLM's remote block ids, or the jetrouter handle's
    block hashes)."""
    params = transfer.get(vllm_handoff.KV_TRANSFER_PARAMS)
    if isinstance(params, dict):
        return vllm_handoff.transfer_blocks(params)
    ext = transfer.get("jetrouter")
    handle = ext.get(TRANSFER_KEY) if isinstance(ext, dict) else None
    hashes = handle.get("block_hashes") if isinstance(handle, dict) else None
    return len(hashes) if isinstance(hashes, list) else 0
