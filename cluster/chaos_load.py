"""Steady load for the chaos suite, sent the way a load balancer in front of the replicas would.

A bounded number of concurrent non-streaming `/v1/completions` requests with token-id prompts
that share prefixes. Replicas are picked round-robin among those a background health checker
last saw answering `/ready` (like the LB's health checks); a request that cannot *connect* is
retried on the next replica, and while no replica accepts connections at all it waits and tries
again for up to `connect_retry_window` seconds (the LB's retry of a request that failed to
connect). A request that connected and then failed is never resent: it counts as failed, with
its start and end times, so the report can tell in-flight casualties from real failures.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx

MODEL = "jetrouter-sim"
REQUEST_ID_HEADER = "x-jetrouter-request-id"
# Raised before the request reached a server: resending cannot serve it twice.
_CONNECT_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout)


@dataclass(slots=True)
class Sent:
    """One request as the client saw it (monotonic times)."""

    index: int
    started: float
    ended: float = 0.0
    ok: bool = False
    error: str = ""
    url: str = ""
    request_id: str | None = None

    def in_flight_at(self, t: float) -> bool:
        return self.in_flight_during(t, t)

    def in_flight_during(self, start: float, end: float) -> bool:
        return self.started <= end and (self.ended or float("inf")) >= start


@dataclass
class LoadDriver:
    urls: list[str]
    concurrency: int = 4
    max_tokens: int = 12
    request_timeout: float = 30.0
    connect_retry_window: float = 60.0
    health_interval: float = 0.25
    sent: list[Sent] = field(default_factory=list)
    _healthy: set[str] = field(default_factory=set)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _rr: itertools.count[int] = field(default_factory=itertools.count)

    # --- figures ---------------------------------------------------------------------------

    @property
    def ok(self) -> int:
        return sum(1 for s in self.sent if s.ok)

    @property
    def failed(self) -> list[Sent]:
        return [s for s in self.sent if s.ended and not s.ok]

    def ok_request_ids(self) -> set[str]:
        return {s.request_id for s in self.sent if s.ok and s.request_id}

    def first_answer_after(self, t: float) -> float | None:
        """When the first request sent at or after ``t`` was answered 200 (monotonic; None: no
        such request): the end of the serving gap a fault at ``t`` opened."""
        return min((s.ended for s in self.sent if s.ok and s.started >= t), default=None)

    def in_flight_during(self, start: float, end: float) -> list[Sent]:
        return [s for s in self.sent if s.in_flight_during(start, end)]

    # --- lifecycle -------------------------------------------------------------------------

    def start(self, client: httpx.AsyncClient) -> None:
        self._healthy = set(self.urls)
        self._tasks = [asyncio.create_task(self._health_loop(client), name="chaos-lb-health")]
        self._tasks += [asyncio.create_task(self._sender(client, k), name=f"chaos-load-{k}")
                        for k in range(self.concurrency)]

    async def stop(self, timeout: float = 60.0) -> None:
        """Stop sending; requests under way finish (bounded by their own timeout)."""
        self._stop.set()
        senders, health = self._tasks[1:], self._tasks[:1]
        if senders:
            await asyncio.wait(senders, timeout=timeout)
        for task in self._tasks:
            task.cancel()
        for task in [*senders, *health]:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks = []

    # --- internals -------------------------------------------------------------------------

    async def _health_loop(self, client: httpx.AsyncClient) -> None:
        while True:
            answers = await asyncio.gather(*(self._ready(client, u) for u in self.urls))
            self._healthy = {u for u, ok in zip(self.urls, answers, strict=True) if ok}
            await asyncio.sleep(self.health_interval)

    async def _ready(self, client: httpx.AsyncClient, url: str) -> bool:
        try:
            r = await client.get(url + "/ready", timeout=1.0)
        except httpx.HTTPError:
            return False
        return r.status_code == 200

    def _order(self) -> list[str]:
        """Every URL once, healthy ones first, starting at the next round-robin slot."""
        k = next(self._rr)
        rotated = [self.urls[(k + i) % len(self.urls)] for i in range(len(self.urls))]
        return [u for u in rotated if u in self._healthy] + \
            [u for u in rotated if u not in self._healthy]

    async def _sender(self, client: httpx.AsyncClient, k: int) -> None:
        for i in itertools.count(k, self.concurrency):
            if self._stop.is_set():
                return
            await self._one(client, i)

    async def _one(self, client: httpx.AsyncClient, i: int) -> None:
        record = Sent(i, time.monotonic())
        self.sent.append(record)
        prefix = list(range(1000 * (i % 5), 1000 * (i % 5) + 96))  # 6 shared blocks of 16
        body = {"model": MODEL, "prompt": [*prefix, *(i % 997, i % 13, 7)],
                "max_tokens": self.max_tokens}
        deadline = record.started + self.connect_retry_window
        try:
            while True:
                for url in self._order():
                    record.url = url
                    try:
                        r = await client.post(url + "/v1/completions", json=body,
                                              timeout=self.request_timeout)
                    except _CONNECT_ERRORS:
                        continue  # never reached a server: the next one may take it
                    record.request_id = r.headers.get(REQUEST_ID_HEADER)
                    record.ok = r.status_code == 200
                    record.error = "" if record.ok else f"HTTP {r.status_code}"
                    return
                if time.monotonic() > deadline or self._stop.is_set():
                    record.error = "no replica accepted the connection"
                    return
                await asyncio.sleep(0.2)  # the whole fleet is down: the LB retries shortly
        except httpx.HTTPError as exc:
            record.error = type(exc).__name__
        finally:
            record.ended = time.monotonic()


def summarize_failures(failed: Sequence[Sent], limit: int = 5) -> list[str]:
    return [f"#{s.index} {s.url} {s.error}" for s in failed[:limit]]
