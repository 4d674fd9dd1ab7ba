"""The event-log watchdog: while degraded, is the log back, and was it lost?

Degraded mode (`replicas.runtime.log_outage`) starts on its own (a request, `/ready` or this
loop asks `LogOutage.degraded` and the connection has been down long enough); this loop makes
the transition happen on time without traffic, and ends it: every ``interval`` seconds while
degraded and connected, it looks the three streams up. Found at or past this replica's
positions: the log is back (NATS returned with its data) and appends resume. Missing on two
rounds in a row, or shorter than what this replica applied: NATS lost its storage, and the log
is re-seeded (`replicas.runtime.reseed`) before appends resume.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext

from eventlog.names import Names
from replicas.runtime.config import ReplicaConfig
from replicas.runtime.follower import StreamFollower
from replicas.runtime.log_outage import LogOutage
from replicas.runtime.reseed import log_lost, reseed

log = logging.getLogger("jetrouter.replica")


class LogWatchdog:
    """``reopen``: open the replica's other buckets again (lease, heartbeats) after a re-seed."""

    def __init__(self, outage: LogOutage, js: JetStreamContext, nc: NatsClient, names: Names,
                 follower: StreamFollower, config: ReplicaConfig, *,
                 reopen: Callable[[], Awaitable[None]], interval: float = 0.5,
                 probe_timeout: float = 2.0) -> None:
        self.outage = outage
        self.js = js
        self.nc = nc
        self.names = names
        self.follower = follower
        self.config = config
        self.interval = interval
        self.probe_timeout = probe_timeout
        self.reseeds = 0
        self._reopen = reopen
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="log-watchdog")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        outage = self.outage
        lost_rounds = 0
        while True:
            await asyncio.sleep(self.interval)  # a periodic check, not a synchronisation
            if not outage.degraded(time.monotonic()) or not outage.connected:
                lost_rounds = 0
                continue
            try:
                lost = await asyncio.wait_for(
                    log_lost(self.js, self.names, dict(self.follower.state.positions)),
                    self.probe_timeout)
                # Lost is judged on two rounds in a row: a server still loading its streams
                # from disk must not pass for one that lost them.
                lost_rounds = lost_rounds + 1 if lost else 0
                if lost_rounds == 1:
                    continue
                if lost:
                    await self._reseed()
            except Exception as exc:  # still unavailable: try again next round
                log.debug("event log probe: %r", exc)
                continue
            outage.log_answered(time.monotonic())

    async def _reseed(self) -> None:
        store = self.follower.snapshots
        if store is None:
            raise RuntimeError("the event log was lost and this replica has no snapshot store")
        done = await reseed(self.js, self.nc, self.names, store, self.follower.state,
                            self.config.state, self.config.replica_id,
                            max_bytes=self.config.stream_max_bytes)
        if done.loaded is not None:
            await self.follower.reseat(done.loaded)
        await self._reopen()
        self.reseeds += 1
