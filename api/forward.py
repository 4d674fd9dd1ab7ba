"""Forwarding a routed request to its engine and reporting how it went (design.md §9).

The request's lifecycle events are appended here: `PrefillCompleted` at the first output token,
`RequestFinished` exactly once at the end, with the outcome (ok, error, cancelled).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

import httpx
import msgspec
from fastapi.responses import Response, StreamingResponse

from api.errors import error_response
from api.metrics import RouterMetrics
from api.openai_schema import ParsedRequest
from api.proxy import Exchange, SseWatcher, relay
from replicas.runtime import Replica, Routed


def replica_headers(replica_id: str, worker_id: str | None = None) -> dict[str, str]:
    h = {"x-jetrouter-replica": replica_id}
    if worker_id:
        h["x-jetrouter-worker"] = worker_id
    return h


class Forwarder:
    def __init__(self, replica: Replica, metrics: RouterMetrics,
                 client: Callable[[], httpx.AsyncClient]) -> None:
        self.replica = replica
        self.metrics = metrics
        self.client = client

    def _headers(self, routed: Routed) -> dict[str, str]:
        return replica_headers(self.replica.replica_id, routed.worker_id)

    async def forward(self, endpoint: str, parsed: ParsedRequest, raw: bytes,
                      routed: Routed) -> Response:
        path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
        url = routed.worker_url.rstrip("/") + path
        if parsed.stream:
            return await self._stream(endpoint, url, raw, routed)
        return await self._unary(endpoint, url, raw, routed)

    def _finish(self, endpoint: str, routed: Routed, ex: Exchange) -> None:
        self.replica.finished(routed.request_id, ex.outcome, ex.tokens)
        self.metrics.requests.labels(endpoint=endpoint, outcome=ex.outcome).inc()
        if ex.ttft is not None:
            self.metrics.ttft.observe(ex.ttft)
        for gap in ex.itl:
            self.metrics.itl.observe(gap)
        if ex.outcome == "ok":
            self.metrics.output_tokens.observe(ex.tokens)

    async def _unary(self, endpoint: str, url: str, raw: bytes, routed: Routed) -> Response:
        ex = Exchange()
        client = self.client()
        try:
            resp = await client.post(url, content=raw, headers={
                "content-type": "application/json", "x-request-id": routed.request_id})
        except httpx.HTTPError as exc:
            self._finish(endpoint, routed, ex)
            return error_response(502, f"the inference engine {routed.worker_id} failed: "
                                  f"{type(exc).__name__}", type="upstream_error",
                                  headers=self._headers(routed))
        except BaseException:
            ex.outcome = "cancelled"
            self._finish(endpoint, routed, ex)
            raise
        ex.first_token_at = time.perf_counter()
        self.replica.prefill_completed(routed.request_id)
        if resp.status_code == 200:
            with contextlib.suppress(Exception):
                ex.take_usage(msgspec.json.decode(resp.content).get("usage"))
            ex.outcome = "ok"
        self._finish(endpoint, routed, ex)
        return Response(resp.content, status_code=resp.status_code,
                        media_type=resp.headers.get("content-type", "application/json"),
                        headers=self._headers(routed))

    async def _stream(self, endpoint: str, url: str, raw: bytes, routed: Routed) -> Response:
        ex = Exchange()
        client = self.client()
        req = client.build_request("POST", url, content=raw, headers={
            "content-type": "application/json", "x-request-id": routed.request_id})
        try:
            resp = await client.send(req, stream=True)
        except httpx.HTTPError as exc:
            self._finish(endpoint, routed, ex)
            return error_response(502, f"the inference engine {routed.worker_id} failed: "
                                  f"{type(exc).__name__}", type="upstream_error",
                                  headers=self._headers(routed))
        except BaseException:
            ex.outcome = "cancelled"
            self._finish(endpoint, routed, ex)
            raise
        if resp.status_code != 200:
            body = await resp.aread()
            await resp.aclose()
            self._finish(endpoint, routed, ex)
            return Response(body, status_code=resp.status_code,
                            media_type=resp.headers.get("content-type", "application/json"),
                            headers=self._headers(routed))
        watcher = SseWatcher(ex, lambda: self.replica.prefill_completed(routed.request_id))

        async def body() -> AsyncIterator[bytes]:
            try:
                async for chunk in relay(resp, watcher):
                    yield chunk
            except (asyncio.CancelledError, GeneratorExit):
                ex.outcome = "cancelled"
                raise
            finally:
                if ex.outcome != "ok" and watcher.saw_done is False and ex.outcome != "cancelled":
                    ex.outcome = "error"
                self._finish(endpoint, routed, ex)

        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers=self._headers(routed))

