"""Waiting on a condition with a deadline — the only way tests synchronise (never a bare sleep)."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any


async def until(probe: Callable[[], Awaitable[Any] | Any], ok: Callable[[Any], bool] = bool,
                timeout: float = 60.0, what: str = "condition", *, interval: float = 0.05,
                tolerate: tuple[type[BaseException], ...] = ()) -> Any:
    """Poll `probe` until `ok(value)`; return that value, or fail with the last one seen.

    Exceptions listed in `tolerate` count as "not yet" (e.g. a replica still restarting)."""
    deadline = time.monotonic() + timeout
    value: Any = None
    while time.monotonic() < deadline:
        try:
            value = probe()
            if inspect.isawaitable(value):
                value = await value
        except tolerate as exc:
            value = exc
        else:
            if ok(value):
                return value
        await asyncio.sleep(interval)
    raise AssertionError(f"{what} not met within {timeout}s; last value {value!r}")


def until_sync(probe: Callable[[], Any], ok: Callable[[Any], bool] = bool,
               timeout: float = 60.0, what: str = "condition", *, interval: float = 0.05,
               tolerate: tuple[type[BaseException], ...] = ()) -> Any:
    """`until` for a test whose own thread runs no event loop (its cluster runs on a
    `tests.loop_thread.LoopThread`): the same polling, blocking between probes."""
    deadline = time.monotonic() + timeout
    value: Any = None
    while time.monotonic() < deadline:
        try:
            value = probe()
        except tolerate as exc:
            value = exc
        else:
            if ok(value):
                return value
        time.sleep(interval)
    raise AssertionError(f"{what} not met within {timeout}s; last value {value!r}")
