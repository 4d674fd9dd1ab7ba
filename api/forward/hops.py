"""Where every hop of a request is routed: the one caller of ``Replica.route`` on the request path.

A request's hops are decided here and nowhere else:

* :meth:`HopRouter.first_hop` — the request's first decision. A model with prefill engines
  (``Replica.is_disaggregated``; replicas/core/disagg.py), on a route that can hand the KV over
  (chat and completions), gets two: the **prefill decision** under ``<request_id>~prefill``,
  whose hop :class:`api.forward.prefill.PrefillHop` runs at once, then the **decode decision**
  under the request's own id, which gets the hand-off fields for its body. No prefill engine
  free, or a failed prefill hop, and the request is decided aggregated instead, as Dynamo's
  router does (counted in ``jetrouter_disaggregated_requests_total``). Any other request gets
  one aggregated decision.
* :meth:`HopRouter.next_hop` — the decision of a migrated hop, ``<request_id>~<n>``
  (:func:`eventlog.names.hop_request_id`), with the engines that failed the request excluded;
  it carries no hand-off (the engine that takes it computes the prompt).

Each returns as soon as the decision is made, counted in this replica's optimistic overlay and
its ``RequestRouted`` submitted to the group commit; it does not wait for JetStream
(replicas/runtime/dispatcher.py). The hop's lifecycle after that is its runner's:
:class:`api.forward.run.Run` or :class:`api.forward.passthrough.Passthrough`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from api.forward import sglang_handoff
from api.forward.handoff import handoff_for
from api.forward.prefill import DisaggOutcome, PrefillHop
from eventlog.events import EngineKind, Outcome
from eventlog.names import hop_request_id, prefill_request_id
from replicas.core import disagg
from replicas.core.sticky import SessionRequest
from replicas.runtime.replica import (
    DecisionNotRecorded,
    Replica,
    Routed,
    RouteRequest,
    RoutingError,
)

log = logging.getLogger("jetrouter.disagg")

# The decode hop's hand-off fields (api/forward/handoff.py), None for an aggregated one.
Transfer = dict[str, Any] | None


class HopRouter:
    """Decides the hops of this replica's requests (see the module docstring).

    ``on_disaggregated(outcome)`` counts each request of a model with prefill engines."""

    def __init__(self, replica: Replica, prefill: PrefillHop, *,
                 on_disaggregated: Callable[[DisaggOutcome], None] | None = None) -> None:
        self.replica = replica
        self.prefill = prefill
        self.on_disaggregated = on_disaggregated

    async def _route(self, req: RouteRequest) -> Routed:
        return await self.replica.route(req)

    async def first_hop(self, req: RouteRequest, *, endpoint: str = "completions",
                        body: dict[str, Any] | None = None,
                        disaggregated: bool = False) -> tuple[Routed, Transfer]:
        """The first decision and the hand-off fields of its body. ``disaggregated``: the route
        can run a prefill hop first (chat and completions, whose client ``body`` a vLLM prefill
        engine is sent); other routes go to an engine that does both. Raises the routing errors
        of ``Replica.route``."""
        if disaggregated and self.replica.is_disaggregated(req.model):
            return await self._prefill_then_decode(req, endpoint, body)
        return await self._route(req), None

    async def _prefill_then_decode(self, req: RouteRequest, endpoint: str,
                                   body: dict[str, Any] | None) -> tuple[Routed, Transfer]:
        transfer: Transfer = None
        outcome = DisaggOutcome.NO_PREFILL_ENGINE
        try:
            pre: Routed | None = await self._route(replace(
                req, request_id=prefill_request_id(req.request_id), phase=disagg.PREFILL))
        except DecisionNotRecorded:
            raise  # the router stream does not take decisions: the decode one would fail too
        except RoutingError as exc:
            log.info("request %s: no prefill engine (%s); serving it aggregated",
                     req.request_id, exc)
            pre = None
        if pre is not None and body is not None and (
                self.prefill.engine_kind(pre.worker_id) == EngineKind.SGLANG):
            return await self._decode_beside_prefill(pre, req, endpoint, body)
        if pre is not None:
            transfer = await self.prefill.run(pre, req, endpoint, body)
            outcome = (DisaggOutcome.DISAGGREGATED if transfer is not None
                       else DisaggOutcome.PREFILL_FAILED)
        if self.on_disaggregated is not None:
            self.on_disaggregated(outcome)
        phase = disagg.DECODE if transfer is not None else disagg.AGGREGATED
        blocks = (handoff_for(self.prefill.engine_kind(pre.worker_id)).blocks(transfer)
                  if transfer is not None and pre is not None else -1)
        return await self._route(replace(req, phase=phase, transfer_blocks=blocks)), transfer

    async def _decode_beside_prefill(self, pre: Routed, req: RouteRequest, endpoint: str,
                                     body: dict[str, Any]) -> tuple[Routed, Transfer]:
        """SGLang: the decode decision now, then the prefill request in the background with the
        same bootstrap fields the decode hop carries (api/forward/sglang_handoff.py)."""
        blocks = sglang_handoff.prompt_blocks(pre.isl_tokens, pre.event.block_size)
        try:
            routed = await self._route(replace(req, phase=disagg.DECODE, transfer_blocks=blocks))
        except BaseException:
            self.replica.finished(pre.request_id, Outcome.CANCELLED, 0)  # never sent
            raise
        info = self.replica.state.workers.get(pre.worker_id)
        fields = sglang_handoff.bootstrap_fields(
            pre.worker_url, info.bootstrap_port if info is not None else 0,
            sglang_handoff.choices(body))

        def done(ok: bool) -> None:  # cancelled too: no hand-off took place
            if self.on_disaggregated is not None:
                self.on_disaggregated(DisaggOutcome.DISAGGREGATED if ok
                                      else DisaggOutcome.PREFILL_FAILED)

        self.prefill.start_beside(pre, routed, req, endpoint, body, fields, done)
        return routed, fields

    async def next_hop(self, first: RouteRequest, hop: int, *, exclude: frozenset[str],
                       session: SessionRequest | None, tenant: str,
                       token_ids: Sequence[int] | None = None, expected_osl: int | None = None,
                       osl_hint: int | None = None) -> Routed:
        """Hop number ``hop`` (1 for the first migration) of the request first routed as
        ``first``, on an engine not in ``exclude``. ``session`` moves with its turn (re-pinned),
        ``tenant`` is the one the request is still in flight for; ``token_ids``,
        ``expected_osl`` and ``osl_hint`` default to the first hop's (a continued stream
        re-prompts with what was generated). Raises the routing errors of ``Replica.route``."""
        return await self._route(RouteRequest(
            request_id=hop_request_id(first.request_id, hop), model=first.model,
            token_ids=first.token_ids if token_ids is None else token_ids,
            expected_osl=first.expected_osl if expected_osl is None else expected_osl,
            osl_hint=first.osl_hint if osl_hint is None else osl_hint,
            priority=first.priority, overlap_weight=first.overlap_weight,
            latency_sensitivity=first.latency_sensitivity, exclude=exclude, session=session,
            tenant=tenant))
