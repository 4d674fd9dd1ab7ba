"""An asyncio loop on a background thread, for synchronous tests that drive async machinery.

Hypothesis runs each example as a plain function call, so a ``@given`` test cannot await; it hands
coroutines to this loop instead (``LoopThread.run``), where a
:class:`launch.local_cluster.LocalCluster` or a NATS connection lives for the whole module.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="test-loop",
                                        daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = 120.0) -> T:
        """Run ``coro`` on the loop and wait for its result (``timeout`` bounds the wait)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=30)
        if not self._thread.is_alive():
            self.loop.close()
