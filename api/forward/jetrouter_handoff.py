"""The simulated engine's KV hand-off (``engine_kind`` "jetrouter", workers/handoff.py; no I/O).

The prefill hop is ``POST /v1/prefill`` with the routed token ids (and the data-parallel rank
the decision chose); the engine answers with a transfer handle naming the prompt's blocks, which
the decode hop's body carries as ``"jetrouter": {"kv_transfer": handle}``.
"""

from __future__ import annotations

from typing import Any

from eventlog.names import TRANSFER_KEY
from replicas.runtime.replica import Routed, RouteRequest

PREFILL_PATH = "/v1/prefill"


class JetrouterHandoff:
    """:class:`api.forward.handoff.Handoff` for the simulated engine."""

    def prefill_request(self, endpoint: str, body: dict[str, Any] | None, req: RouteRequest,
                        pre: Routed) -> tuple[str, dict[str, Any]] | str:
        return PREFILL_PATH, {"model": req.model, "prompt": list(req.token_ids),
                              "max_tokens": 1, "jetrouter": {"dp_rank": pre.dp_rank}}

    def decode_fields(self, answer: dict[str, Any]) -> dict[str, Any] | str:
        handle = answer.get(TRANSFER_KEY)
        if not isinstance(handle, dict):
            return "the prefill answer has no kv_transfer"
        return {"jetrouter": {TRANSFER_KEY: handle}}

    def blocks(self, fields: dict[str, Any]) -> int:
        ext = fields.get("jetrouter")
        handle = ext.get(TRANSFER_KEY) if isinstance(ext, dict) else None
        hashes = handle.get("block_hashes") if isinstance(handle, dict) else None
        return len(hashes) if isinstance(hashes, list) else 0
