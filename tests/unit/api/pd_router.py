"""A router replica served by uvicorn on a loopback socket, in front of engines the test
registers (role and engine kind included) on an in-memory event log."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import uvicorn

from api.app import AppConfig, create_app
from eventlog.events import EngineKind, Event, Role, WorkerRegistered
from eventlog.memory import MemoryLog
from eventlog.names import KV, ROUTER, Names
from replicas.core.state import StateConfig
from replicas.runtime.replica import Replica, ReplicaConfig
from tests.waiting import until

NAMES = Names("jr")
BLOCK_SIZE = 16
MODEL = "tiny"


def worker(worker_id: str, url: str, role: Role = Role.BOTH,
           kind: EngineKind = EngineKind.VLLM, bootstrap_port: int = 0,
           model: str = MODEL) -> WorkerRegistered:
    return WorkerRegistered(worker_id, url, model, BLOCK_SIZE, 4096, 8192, time.time(),
                            role=role, engine_kind=kind, bootstrap_port=bootstrap_port)


@contextlib.asynccontextmanager
async def router_on_a_socket(workers: list[WorkerRegistered]
                             ) -> AsyncIterator[tuple[str, Replica]]:
    log = MemoryLog()
    replica = Replica(ReplicaConfig("r1", "", state=StateConfig(block_size=BLOCK_SIZE),
                                    seed=3, durable=False, canary_interval=0), log=log)
    app = create_app(replica, AppConfig(ready_wait=0))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                           access_log=False, lifespan="on"))
    serving = asyncio.create_task(server.serve())
    try:
        await until(lambda: server.started or serving.done(), timeout=20, what="router started")
        assert server.started, "the router did not start"
        for w in workers:
            seq = await log.append(NAMES.kv_subject(w.worker_id), [w],
                                   f"{w.worker_id}.registered")
            await replica.wait_applied(KV, seq)
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://127.0.0.1:{port}", replica
    finally:
        server.should_exit = True
        await asyncio.wait_for(serving, 20)


def counter(metrics_text: str, name: str, label: str) -> dict[str, float]:
    """``{label value: count}`` of one labelled counter in a Prometheus text page."""
    out: dict[str, float] = {}
    for line in metrics_text.splitlines():
        if line.startswith(name + "{"):
            value = line.split(f'{label}="', 1)[1].split('"', 1)[0]
            out[value] = float(line.rsplit(" ", 1)[1])
    return out


async def router_events(log: MemoryLog) -> list[Event]:
    """Every event on the router stream so far, in order."""
    stream = NAMES.stream(ROUTER)
    _, last = await log.bounds(stream)
    out: list[Event] = []
    if last == 0:
        return out
    reader = log.reader(stream)
    try:
        while True:
            seq, events = await anext(reader)
            out.extend(events)
            if seq >= last:
                return out
    finally:
        await reader.close()
