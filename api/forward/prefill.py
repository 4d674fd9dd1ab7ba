"""The prefill hop of a disaggregated request: run on the engine its decision chose, it ends
with the fields that hand the prompt's KV blocks to the decode hop.

The prefill hop is the one hop whose lifecycle on the router stream is not in
:mod:`api.forward.run`: it streams nothing to the client, so it is run and ended here, before
the request's run starts on the decode engine. Its decision, and the decode decision after it,
are made by :class:`api.forward.hops.HopRouter` (replicas/core/disagg.py): the prefill decision
under ``<request_id>~prefill``, the decode decision under the request's own id.

A model counts as disaggregated while it has prefill engines, or decode engines whose prefill
engines all retired (``Replica.is_disaggregated``): its requests then find no prefill engine and
fall back to aggregated serving, counted ``no_prefill_engine``.

What the prefill engine is asked and how its answer reaches the decode engine is the engine
kind's hand-off (``WorkerRegistered.engine_kind``; :mod:`api.forward.handoff`): vLLM's
``kv_transfer_params`` (:mod:`api.forward.vllm_handoff`), or the simulated engine's
``/v1/prefill`` and transfer handle (:mod:`api.forward.jetrouter_handoff`). SGLang's bootstrap
hand-off (:mod:`api.forward.sglang_handoff`) is the exception: its prefill request runs
*beside* the decode hop (:meth:`PrefillHop.start_beside`), both carrying the same bootstrap
fields, because an SGLang prefill engine answers only once the decode engine has pulled the
blocks. Clients may not send these fields themselves (api/handoff_fields.py).

The prefill engine is called while the prefill decision's append is on its way; its answer is
used only once the decision is recorded (``Replica.recorded``): a refused one ends the hop
``not_routed`` and the request is answered 503, like a refused decode decision. A hop that fails
(refused connection, 5xx, a 4xx, an answer without a usable handle) ends ``error`` and the
request is served aggregated. A client that goes away during the prefill hop ends it as
``cancelled``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from enum import StrEnum
from typing import Any

import msgspec

from api import tracing
from api.forward import sglang_handoff, vllm_handoff
from api.forward.engine import HopFailure, classify
from api.forward.handoff import handoff_for
from api.upstream import Patience, UpstreamError, UpstreamPool
from errors.root import JetrouterError
from eventlog.events import EngineKind, Outcome
from replicas.runtime.replica import DecisionNotRecorded, Replica, Routed, RouteRequest

log = logging.getLogger("jetrouter.disagg")


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


class PrefillHop:
    """Runs the prefill hop of disaggregated requests for one replica.

    ``on_worker_failure(worker_id, reason)`` is the Forwarder's passive health signal.
    ``on_transfer(blocks)`` counts the KV blocks each successful hand-off names."""

    def __init__(self, replica: Replica, pool: UpstreamPool, *,
                 on_worker_failure: Callable[[str, str], None] | None = None,
                 on_transfer: Callable[[int], None] | None = None,
                 patience: Callable[[str, str], Patience | None] | None = None) -> None:
        self.replica = replica
        self.pool = pool
        # (worker id, request id) -> how long a silent prefill engine is waited for
        # (api/forward/first_byte.py): a prefill answer's first byte is its last.
        self.patience = patience
        self.on_worker_failure = on_worker_failure
        self.on_transfer = on_transfer  # KV blocks of each hand-off
        # SGLang prefill requests running beside their decode hop, by the decode hop's id
        # (taken by the Forwarder for the run; each removes itself when it ends).
        self.concurrent: dict[str, sglang_handoff.ConcurrentPrefill] = {}

    def engine_kind(self, worker_id: str) -> str:
        info = self.replica.state.workers.get(worker_id)
        return info.engine_kind if info is not None else EngineKind.JETROUTER

    def start_beside(self, pre: Routed, decode: Routed, req: RouteRequest, endpoint: str,
                     body: dict[str, Any], fields: dict[str, Any],
                     on_done: Callable[[bool], None]) -> None:
        """SGLang: run the prefill hop decided as ``pre`` in the background, with the bootstrap
        ``fields`` the decode hop (decided as ``decode``) carries too; the decode hop's run
        takes it from :attr:`concurrent`. ``on_done(ok)`` says how it ended."""
        beside = sglang_handoff.ConcurrentPrefill(pre.request_id)
        self.concurrent[decode.request_id] = beside

        async def prefill() -> bool:
            done: dict[str, Any] | None = None
            try:
                done = await self.run(pre, req, endpoint, body, sglang=fields)
            except DecisionNotRecorded:
                pass  # its decode decision meets the same refusal in its own run
            finally:
                self.concurrent.pop(decode.request_id, None)
                on_done(done is not None)
            return done is not None

        beside.start(prefill())

    async def run(self, pre: Routed, req: RouteRequest, endpoint: str,
                  body: dict[str, Any] | None, *, sglang: dict[str, Any] | None = None
                  ) -> dict[str, Any] | None:
        """Run the prefill hop decided as ``pre``; the decode hop's hand-off fields, or None
        (the hop ended as ``error``) when it failed. Raises :class:`DecisionNotRecorded` when
        JetStream refused ``pre``. ``sglang``: the bootstrap fields of an SGLang hand-off,
        whose decode hop is already on its way (:meth:`start_beside`)."""
        outcome, cached = Outcome.CANCELLED, -1
        handoff = handoff_for(self.engine_kind(pre.worker_id))
        try:
            try:  # the engine is asked while the decision's append is acked
                request: tuple[str, dict[str, Any]] | str
                if sglang is not None and body is not None:
                    request = (vllm_handoff.engine_path(endpoint),
                               sglang_handoff.prefill_body(body, sglang))
                else:
                    request = handoff.prefill_request(endpoint, body, req, pre)
                if isinstance(request, str):
                    raise PrefillFailed(PrefillProblem.BAD_REQUEST, request)
                answer = await self._call(pre, *request)
            finally:
                try:
                    await self.replica.recorded(pre)
                except DecisionNotRecorded:
                    outcome = Outcome.NOT_ROUTED  # the request is answered 503
                    raise
            if sglang is not None:
                fields: dict[str, Any] | str = sglang
                blocks = sglang_handoff.prompt_blocks(pre.isl_tokens, pre.event.block_size)
            else:
                fields = handoff.decode_fields(answer)
                if isinstance(fields, str):
                    raise PrefillFailed(PrefillProblem.BAD_ANSWER, fields)
                blocks = handoff.blocks(fields)
            if self.on_transfer is not None:
                self.on_transfer(blocks)
            usage = answer.get("usage")
            details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
            value = details.get("cached_tokens") if isinstance(details, dict) else None
            cached = value if isinstance(value, int) and value >= 0 else -1
            self.replica.prefill_completed(pre.request_id)
            outcome = Outcome.OK
            return fields
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
            patience = (self.patience(pre.worker_id, pre.request_id)
                        if self.patience is not None else None)
            resp = await self.pool.post(url, msgspec.json.encode(request), headers,
                                        patience=patience)
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
