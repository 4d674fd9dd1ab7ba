"""Helpers for tests that run whole local clusters and kill their processes."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import httpx

from launch.local_cluster import LocalCluster
from tests.waiting import until as _until

MODEL = "jetrouter-sim"



async def until(probe: Callable[[], Awaitable[object]], ok: Callable[[object], bool],
                timeout: float = 30.0, what: str = "condition") -> object:
    """`tests.waiting.until` tolerating a replica that is restarting (connection errors)."""
    return await _until(probe, ok, timeout, what, interval=0.1,
                        tolerate=(httpx.HTTPError, KeyError, ValueError))


class Admin:
    def __init__(self, cluster: LocalCluster, client: httpx.AsyncClient) -> None:
        self.c = cluster
        self.h = client
        self.auth = {"authorization": f"Bearer {cluster.admin_token}"}

    def url(self, name: str) -> str:
        return self.c.children[name].url

    async def get(self, name: str, path: str) -> dict:
        r = await self.h.get(self.url(name) + path, headers=self.auth, timeout=10)
        r.raise_for_status()
        return r.json()

    async def post(self, name: str, path: str, body: dict | None = None) -> dict:
        r = await self.h.post(self.url(name) + path, headers=self.auth, json=body or {},
                              timeout=60)
        r.raise_for_status()
        return r.json()

    async def state(self, name: str) -> dict:
        return await self.get(name, "/admin/state")

    async def states(self, names: list[str]) -> dict[str, dict]:
        return {n: await self.state(n) for n in names}

    async def converged(self, names: list[str], timeout: float = 30.0) -> dict[str, dict]:
        """Wait until every replica is ready at the same positions, then return their states."""

        async def probe() -> dict[str, dict]:
            return await self.states(names)

        def ok(states: object) -> bool:
            assert isinstance(states, dict)
            pos = {str(s["positions"]) for s in states.values()}
            return len(pos) == 1 and all(s["ready"] for s in states.values()) and \
                all(max(s["lag"].values()) == 0 for s in states.values())

        return await until(probe, ok, timeout, "replicas converged")  # type: ignore[return-value]


@dataclass
class Load:
    """Steady background traffic over given replicas, bounded in count and time."""

    urls: list[str]
    ok: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self, client: httpx.AsyncClient, max_requests: int = 2000,
                  concurrency: int = 4) -> None:
        counter = iter(range(max_requests))

        async def one_worker(k: int) -> None:
            for i in counter:
                if self._stop.is_set():
                    return
                url = self.urls[(i + k) % len(self.urls)]
                prefix = list(range(100 * (i % 7), 100 * (i % 7) + 64))  # shared prefixes
                try:
                    r = await client.post(url + "/v1/completions", timeout=10, json={
                        "model": MODEL, "prompt": [*prefix, i % 251, 7], "max_tokens": 4})
                    if r.status_code == 200:
                        self.ok += 1
                    else:
                        self.failed += 1
                        self.errors.append(f"{r.status_code}")
                except httpx.HTTPError as exc:
                    self.failed += 1
                    self.errors.append(type(exc).__name__)

        await asyncio.gather(*(one_worker(k) for k in range(concurrency)))

    def stop(self) -> None:
        self._stop.set()


@contextlib.asynccontextmanager
async def running(load: Load, client: httpx.AsyncClient, **kw: int) -> AsyncIterator[Load]:
    task = asyncio.create_task(load.run(client, **kw))
    try:
        yield load
    finally:
        load.stop()
        await asyncio.wait_for(task, 30)
