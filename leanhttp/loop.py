"""Running a server's event loop: uvloop where it is installed, asyncio's own loop otherwise.

uvloop (installed with ``uvicorn[standard]``) runs the loop, its timers and its socket transports
in C. A process whose work is many small requests spends a large share of its CPU in the loop
itself: the simulated engines' host profiled at 64 concurrent requests spent ~16 % of its
samples in asyncio's pure-Python code (``_run_once``, ``Handle._run``, futures, queues, the
selector). uvicorn picks uvloop by itself when it owns the loop (a replica, a single engine);
this is for the processes that run their own loop around several servers or clients.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` on uvloop when it can be imported."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)
