"""The KV hand-off of a disaggregated request, one implementation per prefill engine kind.

A prefill engine computes the prompt and answers with something that lets a decode engine take
its KV blocks instead of computing them; how it is asked, and what the decode hop's body must
carry, is the engine's protocol, named by ``WorkerRegistered.engine_kind``. A :class:`Handoff`
is that protocol, without I/O: :class:`api.forward.prefill.PrefillHop` sends what it builds and
reads the answer with it.

**Adding an engine kind** takes one module beside :mod:`api.forward.vllm_handoff` with a class
that has the three methods of :class:`Handoff`, and one entry in :data:`HANDOFFS` (plus the
module in the import-linter layer of the hand-offs, pyproject.toml). Nothing else on the request
path changes: routing, the prefill hop's lifecycle, the fallback to aggregated serving and the
metrics are the same for every kind. A kind with no entry speaks the simulated engine's
protocol (:mod:`api.forward.jetrouter_handoff`). SGLang's hand-off does not fit this shape (its
prefill and decode requests must run at the same time, sharing fields drawn once), so
:class:`api.forward.hops.HopRouter` runs it beside the decode hop
(:meth:`api.forward.prefill.PrefillHop.start_beside`, :mod:`api.forward.sglang_handoff`).
"""

from __future__ import annotations

from typing import Any, Protocol

from api.forward.jetrouter_handoff import JetrouterHandoff
from api.forward.vllm_handoff import VllmHandoff
from eventlog.events import EngineKind
from replicas.runtime.replica import Routed, RouteRequest


class Handoff(Protocol):
    """One engine kind's KV hand-off (no I/O). A ``str`` result says why there is none."""

    def prefill_request(self, endpoint: str, body: dict[str, Any] | None, req: RouteRequest,
                        pre: Routed) -> tuple[str, dict[str, Any]] | str:
        """(engine path, JSON body) of the prefill hop's request, for the client's request on
        ``endpoint`` ("chat" or "completions"; ``body`` its JSON body, when the route has one)
        routed as ``req`` and decided as ``pre``."""
        ...

    def decode_fields(self, answer: dict[str, Any]) -> dict[str, Any] | str:
        """The fields to set at the top level of the decode hop's body, from the prefill
        engine's JSON answer (:func:`api.forward.continuation.with_transfer` sets them)."""
        ...

    def blocks(self, fields: dict[str, Any]) -> int:
        """The KV blocks those fields hand over (``jetrouter_kv_transfer_blocks``)."""
        ...


HANDOFFS: dict[str, Handoff] = {
    EngineKind.JETROUTER: JetrouterHandoff(),
    EngineKind.VLLM: VllmHandoff(),
}


def handoff_for(engine_kind: str) -> Handoff:
    return HANDOFFS.get(engine_kind) or HANDOFFS[EngineKind.JETROUTER]
