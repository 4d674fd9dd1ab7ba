"""Requests that need an engine but no routing decision: ``/tokenize``, ``/detokenize`` and
Anthropic's ``count_tokens`` without ``--model-path`` (the engine's tokenizer answers them).

Nothing is generated and no load is charged, so no decision is made or appended: a usable engine
serving the model is taken in turn, and its answer passed on.
"""

from __future__ import annotations

import itertools

from fastapi.responses import Response

from api.errors import ApiError, error_response
from api.upstream import UpstreamError, UpstreamPool
from replicas.core.candidates import HEALTH_WEIGHT
from replicas.runtime.replica import Replica

CALL_TIMEOUT = 30.0
_JSON = "application/json"

_turn = itertools.count()


def engine_for(replica: Replica, model: str | None) -> tuple[str, str]:
    """(worker id, url) of a usable engine serving ``model`` (any model when None), in turn."""
    state = replica.state
    if model is not None and model not in replica.models():
        raise ApiError(404, f"The model `{model}` does not exist.", param="model",
                       code="model_not_found")
    usable = sorted(
        (w.worker_id, w.url) for w in state.workers.values()
        if (model is None or w.model == model or model in w.loras)
        and HEALTH_WEIGHT.get(state.health.get(w.worker_id, "healthy"), 0.0) > 0.0)
    if not usable:
        raise ApiError(503, f"no engine serves model {model!r} now", type="service_unavailable")
    return usable[next(_turn) % len(usable)]


async def forward_unrouted(replica: Replica, pool: UpstreamPool, path: str, raw: bytes,
                           model: str | None, headers: dict[str, str]) -> Response:
    """``raw`` POSTed to ``path`` on an engine serving ``model``; its answer, or a 502.
    ``headers`` (the replica's) are completed with the engine's id."""
    worker_id, url = engine_for(replica, model)
    headers = {**headers, "x-jetrouter-worker": worker_id}
    try:
        resp = await pool.post(url.rstrip("/") + path, raw, {"content-type": _JSON},
                               idle_timeout=CALL_TIMEOUT)
        try:
            data = await resp.aread()
        finally:
            resp.close()
    except (UpstreamError, OSError) as exc:
        return error_response(502, f"the engine {worker_id} failed: {exc}",
                              type="upstream_error", headers=headers)
    return Response(data, status_code=resp.status_code, headers=headers,
                    media_type=resp.headers.get("content-type", _JSON))
