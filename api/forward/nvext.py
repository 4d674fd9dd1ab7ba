"""Dynamo's ``nvext`` response fields (``nvext.extra_fields`` in the request): which engine
served the request, the reuse the router predicted there, and timing.

Added to the JSON body of a non-streaming answer, and as one extra chunk just before
``data: [DONE]`` of a stream (``choices: []``, like the usage chunk), so OpenAI clients that do
not know ``nvext`` skip it. Only what was asked for is added.

Shapes (milliseconds, as Dynamo reports them):
``worker_id``: ``{"prefill_worker_id", "decode_worker_id", "dp_rank", "predicted_overlap_blocks",
"predicted_cached_tokens", "prompt_blocks", "replica_id"}`` — one engine does both phases in
aggregated serving, so both ids name it; ``timing``: ``{"request_received_ms"`` (Unix ms),
``"routing_ms"`` (hashing, matching, selection and recording the decision), ``"ttft_ms"``
(streams only), ``"total_time_ms"}``.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from fastapi.responses import Response

from api.forward.engine import DONE_EVENT, sse_data
from replicas.runtime.replica import Routed


class NvextFields:
    """What one request's ``nvext`` answer is built from; ``received`` is ``time.time()`` and
    ``started`` ``time.perf_counter()`` when the request arrived."""

    def __init__(self, fields: tuple[str, ...], routed: Routed, replica_id: str, block_size: int,
                 received: float, started: float, routing_s: float) -> None:
        self.fields = fields
        self.routed = routed
        self.replica_id = replica_id
        self.block_size = block_size
        self.received = received
        self.started = started
        self.routing_s = routing_s
        self.ttft_s: float | None = None

    def build(self, worker_id: str | None) -> dict[str, Any]:
        out: dict[str, Any] = {}
        r = self.routed
        if "worker_id" in self.fields:
            wid = worker_id or r.worker_id
            out["worker_id"] = {
                "prefill_worker_id": wid, "decode_worker_id": wid, "dp_rank": r.dp_rank,
                "predicted_overlap_blocks": r.overlap_blocks,
                "predicted_cached_tokens": r.overlap_blocks * self.block_size,
                "prompt_blocks": r.total_blocks, "replica_id": self.replica_id}
        if "timing" in self.fields:
            timing: dict[str, Any] = {
                "request_received_ms": round(self.received * 1000.0, 3),
                "routing_ms": round(self.routing_s * 1000.0, 3)}
            if self.ttft_s is not None:
                timing["ttft_ms"] = round(self.ttft_s * 1000.0, 3)
            timing["total_time_ms"] = round((time.perf_counter() - self.started) * 1000.0, 3)
            out["timing"] = timing
        return out


async def add_to_response(resp: Response, nv: NvextFields) -> Response:
    """Return ``resp`` with the requested fields added (errors are left as they are)."""
    if resp.status_code != 200:
        return resp
    worker = resp.headers.get("x-jetrouter-worker")
    body_iter = getattr(resp, "body_iterator", None)
    if body_iter is None:
        try:
            doc = msgspec.json.decode(resp.body)
        except msgspec.DecodeError:
            return resp
        if isinstance(doc, dict):
            doc["nvext"] = {**(doc.get("nvext") or {}), **nv.build(worker)}
            body = msgspec.json.encode(doc)
            headers = {k: v for k, v in resp.headers.items() if k != "content-length"}
            return Response(body, status_code=200, media_type="application/json",
                            headers=headers)
        return resp
    resp.body_iterator = _stream_with_nvext(body_iter, nv, worker)
    return resp


async def _stream_with_nvext(chunks: AsyncIterator[Any], nv: NvextFields,
                             worker: str | None) -> AsyncIterator[bytes]:
    head: dict[str, Any] | None = None
    async for chunk in chunks:
        data = chunk if isinstance(chunk, bytes) else str(chunk).encode()
        if nv.ttft_s is None and data.startswith(b"data: {"):
            nv.ttft_s = time.perf_counter() - nv.started
        if head is None and data.startswith(b"data: {"):
            head = _frame_head(data)
        if data.endswith(DONE_EVENT):
            frame = {**(head or {}), "choices": [], "nvext": nv.build(worker)}
            yield data[: -len(DONE_EVENT)] + sse_data(frame) + DONE_EVENT
        else:
            yield data


def _frame_head(data: bytes) -> dict[str, Any]:
    """id, object, created and model of a stream's first frame (the nvext chunk repeats them)."""
    line = data.split(b"\n", 1)[0][len(b"data: "):]
    try:
        doc = msgspec.json.decode(line)
    except msgspec.DecodeError:
        return {}
    if not isinstance(doc, dict):
        return {}
    return {k: doc[k] for k in ("id", "object", "created", "model") if k in doc}
