"""The bridge's watch on the engine's HTTP side: ``/health`` (retire when it keeps failing,
register again when it recovers) and ``/metrics`` (load gauges; a new
``process_start_time_seconds`` means the engine restarted).

Busy is not dead. A real engine computing long prompts on a loaded host answers ``/health`` and
``/metrics`` late or not within the timeout (vLLM's API server shares the CPU with its engine
core: on two cores, eight prompts of ~1,500 tokens kept both silent for over 12 s), and an engine
whose HTTP side falls silent looks the same from here as a hung one. What tells them apart is
the engine core's own output: its KV events. So a ``/health`` that *timed out* counts towards
``--unhealthy-after`` only from the engine's last live KV batch on (a refused connection or an
error status counts at once), and while ``/metrics`` times out but KV batches came within
``--unhealthy-after`` the load gauges go on, with the last load read: the router's liveness
judges engines by those gauges (replicas/runtime/liveness.py, api/forward/connect_retry.py).
A hung engine sends no KV events, so it is retired as before.

The loops never touch the stream themselves: they put control items on the bridge's queue, which
its one appending task handles between batches, so every append stays in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from typing import Protocol

from nats.aio.client import Client as NatsClient

from eventlog.names import Names
from workers.bridge.engine_http import (
    EngineHttp,
    EngineSilent,
    EngineUnavailable,
    Health,
    MetricsView,
)

log = logging.getLogger(__name__)


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
    cleared_for_start: float | None
    metrics: MetricsView
    control: asyncio.Queue[str]
    kv_total_blocks: int | None
    clock: Callable[[], float]
    last_progress: float | None  # monotonic time of the engine's last live KV batch

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
        self.busy_warned = False
        self.silent_gauges = 0  # gauges sent with the last load read while /metrics was silent

    def progressing(self, now: float) -> bool:
        """Whether the engine sent a live KV batch within ``--unhealthy-after``."""
        last = self.bridge.last_progress
        return last is not None and now - last < self.bridge.s.unhealthy_after

    async def health_loop(self) -> None:
        b = self.bridge
        while True:
            await asyncio.sleep(b.s.health_interval)
            health = await b.engine.health()
            now = time.monotonic()
            if health is Health.OK:
                if self.unhealthy_since is not None and b.retired:
                    b.control.put_nowait("recovered")
                self.unhealthy_since = None
                self.busy_warned = False
                continue
            if self.unhealthy_since is None:
                self.unhealthy_since = now
            since = self.unhealthy_since
            if health is Health.SILENT and b.last_progress is not None:
                since = max(since, b.last_progress)  # it computed something since: busy
                if since > self.unhealthy_since and not self.busy_warned:
                    self.busy_warned = True
                    log.warning("%s: /health timed out, but the engine's KV events flow "
                                "(the last %.1fs ago): busy, not unhealthy", b.s.worker_id,
                                now - b.last_progress)
            if now - since >= b.s.unhealthy_after and not b.retired:
                b.control.put_nowait("unhealthy")

    async def load_loop(self) -> None:
        b = self.bridge
        subject = b.names.load_subject(b.s.worker_id)
        while True:
            view: MetricsView | None
            try:
                view = await b.engine.metrics()
            except EngineSilent:
                # Busy, not gone, while its KV events flow: the last load read stands in.
                view = None
                if self.progressing(time.monotonic()):
                    self.silent_gauges += 1
                    await self._publish(subject, b.metrics)
            except EngineUnavailable:
                view = None
            if view is not None:
                b.metrics = view
                if b.engine_start is None:
                    # A restart whose start time the bridge could not read when it cleared.
                    b.engine_start = b.cleared_for_start = view.start_time
                elif view.start_time is not None and view.start_time != b.engine_start:
                    b.engine_start = view.start_time
                    b.control.put_nowait("engine_restarted")
                await self._publish(subject, view)
            await asyncio.sleep(b.s.load_interval)

    async def _publish(self, subject: str, view: MetricsView) -> None:
        b = self.bridge
        nc = b.nc
        if b.registered and not b.retired and nc is not None and nc.is_connected:
            for payload in load_gauges(b.s.worker_id, view, b.kv_total_blocks or 0, b.clock()):
                with contextlib.suppress(Exception):
                    await nc.publish(subject, json.dumps(payload).encode())
