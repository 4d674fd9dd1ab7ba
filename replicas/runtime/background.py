"""Fire-and-forget work of a replica (appends after a response, re-announce requests), kept
referenced until done and logged when it fails, so `stop()` can wait for it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable

log = logging.getLogger("jetrouter.replica")


class Background:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Future[object]] = set()

    def spawn(self, work: Awaitable[object]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Future[object]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background append failed: %s", task.exception())

    async def wait(self, timeout: float) -> None:
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=timeout)
