"""The bridge's watch on the engine's HTTP side: ``/health`` (retire when it keeps failing,
register again when it recovers) and ``/metrics`` (load gauges; a new
``process_start_time_seconds`` means the engine restarted).

The loops never touch the stream themselves: they put control items on the bridge's queue, which
its one appending task handles between batches, so every append stays in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from typing import Protocol

from nats.aio.client import Client as NatsClient

from eventlog.names import Names
from workers.bridge.engine_http import EngineHttp, EngineUnavailable, MetricsView


class MonitorSettings(Protocol):
    @property
    def worker_id(self) -> str: ...
    @property
    def health_interval(self) -> float: ...
    @property
    def unhealthy_after(self) -> float: ...
    @property
    def load_interval(self) -> float: ...


class MonitoredBridge(Protocol):
    """What the monitor reads and sets on the bridge (`workers.bridge.bridge.Bridge`): a port,
    so this module does not import the bridge that imports it."""

    names: Names
    engine: EngineHttp
    nc: NatsClient | None
    registered: bool
    retired: bool
    engine_start: float | None
    metrics: MetricsView
    control: asyncio.Queue[str]
    kv_total_blocks: int | None
    clock: Callable[[], float]

    @property
    def s(self) -> MonitorSettings: ...


def load_gauges(worker_id: str, view: MetricsView, kv_total_blocks: int,
                ts: float) -> list[dict[str, object]]:
    """Load per dp rank in the simulated worker's JSON shape (workers/scheduler.py ``load``)."""
    out: list[dict[str, object]] = []
    for rank, load in sorted((view.load or {0: {}}).items()):
        usage = float(load.get("kv_usage", 0.0))
        out.append({
            "worker_id": worker_id, "ts": ts, "dp_rank": rank,
            "active_decode_blocks": round(usage * max(1, kv_total_blocks)),
            "kv_total_blocks": kv_total_blocks,
            "kv_usage": usage,
            "num_running": int(load.get("num_running", 0)),
            "num_waiting": int(load.get("num_waiting", 0)),
        })
    return out


class EngineMonitor:
    def __init__(self, bridge: MonitoredBridge) -> None:
        self.bridge = bridge
        self.unhealthy_since: float | None = None

    async def health_loop(self) -> None:
        b = self.bridge
        while True:
            await asyncio.sleep(b.s.health_interval)
            healthy = await b.engine.healthy()
            now = time.monotonic()
            if healthy:
                if self.unhealthy_since is not None and b.retired:
                    b.control.put_nowait("recovered")
                self.unhealthy_since = None
                continue
            if self.unhealthy_since is None:
                self.unhealthy_since = now
            elif now - self.unhealthy_since >= b.s.unhealthy_after and not b.retired:
                b.control.put_nowait("unhealthy")

    async def load_loop(self) -> None:
        b = self.bridge
        subject = b.names.load_subject(b.s.worker_id)
        while True:
            try:
                view: MetricsView | None = await b.engine.metrics()
            except EngineUnavailable:
                view = None
            if view is not None:
                b.metrics = view
                if (view.start_time is not None and b.engine_start is not None
                        and view.start_time != b.engine_start):
                    b.engine_start = view.start_time
                    b.control.put_nowait("engine_restarted")
                nc = b.nc
                if b.registered and not b.retired and nc is not None and nc.is_connected:
                    for payload in load_gauges(b.s.worker_id, view, b.kv_total_blocks or 0,
                                               b.clock()):
                        with contextlib.suppress(Exception):
                            await nc.publish(subject, json.dumps(payload).encode())
            await asyncio.sleep(b.s.load_interval)
