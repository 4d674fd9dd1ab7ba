"""Stand-in engines (tests/standin_engine.py) registered with a router cluster through the
custom-engine API (workers/publishing.py), as a bridge registers vLLM, and what the tests read
back: the router's view of its workers and its counters."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx

from eventlog.events import WorkerRegistered
from eventlog.names import Names
from launch.local_cluster import LocalCluster
from tests.standin_engine import Received, Reply, completion_events
from tests.waiting import until
from workers.publishing import KvPublisher

BLOCK = 16
TEXTS = ["a", "b", "c"]


def answer(got: Received) -> Reply:
    """"abc" for every choice: streamed when asked to, else one JSON body."""
    body = got.body if isinstance(got.body, dict) else {}
    model = body.get("model", "m")
    if body.get("stream"):
        return Reply(events=completion_events(TEXTS, model=model))
    return Reply(json={
        "id": "x", "object": "text_completion", "created": 1, "model": model,
        "choices": [{"index": i, "text": "".join(TEXTS), "finish_reason": "length"}
                    for i in range(body.get("n", 1))],
        "usage": {"prompt_tokens": 1, "completion_tokens": 3 * body.get("n", 1),
                  "total_tokens": 1 + 3 * body.get("n", 1)}})


@contextlib.asynccontextmanager
async def registered(c: LocalCluster, worker_id: str, url: str, model: str, *,
                     gauges: bool = True) -> AsyncIterator[KvPublisher]:
    """``worker_id`` at ``url`` registered for ``model``; with ``gauges`` it publishes its load
    (it is alive to the router), without it it never does."""
    def load() -> list[dict[str, Any]]:
        return [{"dp_rank": 0, "num_running": 0, "num_waiting": 0}] if gauges else []

    pub = KvPublisher(c.nats_url, Names(c.namespace), worker_id, uuid.uuid4().hex, load=load,
                      load_interval=0.2)
    await pub.start()
    pub.register(WorkerRegistered(worker_id, url, model, BLOCK, 4096, 8192, time.time()))
    try:
        async with httpx.AsyncClient(timeout=10) as h:
            await until(lambda: workers(h, c), lambda ws: worker_id in ws,
                        what=f"{worker_id} registered")
        yield pub
    finally:
        pub.retire("test over")
        await pub.close(flush_timeout=5)


async def workers(h: httpx.AsyncClient, c: LocalCluster) -> dict[str, dict[str, Any]]:
    r = await h.get(f"{c.router_urls[0]}/admin/workers",
                    headers={"authorization": f"Bearer {c.admin_token}"})
    return {w["worker_id"]: w for w in r.json()["workers"]}


async def counter(h: httpx.AsyncClient, c: LocalCluster, name: str) -> dict[str, float]:
    """A labelled counter of the first replica, by its (one) label's value."""
    out: dict[str, float] = {}
    for line in (await h.get(c.router_urls[0] + "/metrics")).text.splitlines():
        if line.startswith(name + "{"):
            label = line.split('="', 1)[1].split('"', 1)[0]
            out[label] = float(line.rsplit(" ", 1)[1])
    return out


def grew(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}
