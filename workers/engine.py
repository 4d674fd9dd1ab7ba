"""The async driver of one simulated engine (one data-parallel rank).

A single task loops: plan and apply a step on the pure :class:`EngineCore`, hand its KV-cache
changes to the publisher *at once* (so the event feed follows the cache's own order of changes,
which a re-announce snapshot relies on), sleep the simulated step time (the sleep IS the
simulation), then deliver the step's tokens to the waiting HTTP handlers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from workers.faults import FaultState
from workers.kvcache import KvChange
from workers.scheduler import EngineConfig, EngineCore, SimRequest

log = logging.getLogger(__name__)

KvSink = Callable[[int, list[KvChange]], None]
_END = -1


class RequestHandle:
    """What the HTTP layer holds for one request: its token feed and its accounting."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._queue: asyncio.Queue[int] = asyncio.Queue()
        self.req: SimRequest  # set by Engine.submit
        self.finished = False
        self.aborted = False
        self.delivered = 0

    @property
    def request_id(self) -> str:
        return self.req.request_id

    @property
    def prompt_tokens(self) -> int:
        return self.req.prompt_len

    @property
    def cached_tokens(self) -> int:
        return self.req.cached_tokens or 0

    @property
    def output(self) -> list[int]:
        return self.req.output

    @property
    def dp_rank(self) -> int:
        return self._engine.dp_rank

    def _push(self, token: int) -> None:
        self._queue.put_nowait(token)

    async def tokens(self) -> AsyncIterator[int]:
        """Output tokens as the engine produces them; ends after ``max_tokens``."""
        while True:
            token = await self._queue.get()
            if token == _END:
                self.finished = True
                return
            yield token

    def abort(self) -> None:
        self._engine.abort(self)


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        *,
        dp_rank: int = 0,
        salt: int = 0,
        faults: FaultState | None = None,
        on_kv_changes: KvSink | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.config = config
        self.dp_rank = dp_rank
        self.core = EngineCore(config, salt=salt)
        self.faults = faults or FaultState()
        self.faults.on_change.append(self.poke)
        self.on_kv_changes = on_kv_changes
        self._sleep = sleep
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.steps = 0
        self.busy_seconds = 0.0  # simulated time spent in steps (before the slow fault)
        self.prompt_tokens_total = 0
        self.cached_tokens_total = 0
        self.output_tokens_total = 0

    # --- requests ---------------------------------------------------------------------------

    def submit(self, request_id: str, prompt: list[int], max_tokens: int, *,
               transferred_tokens: int = 0) -> RequestHandle:
        """Queue a request (raises ValueError/RequestTooLarge for one that can never run).
        ``transferred_tokens``: prompt tokens whose KV a prefill engine handed over."""
        handle = RequestHandle(self)
        handle.req = self.core.add(request_id, prompt, max_tokens, tag=handle,
                                   transferred_tokens=transferred_tokens)
        self.prompt_tokens_total += len(prompt)
        self.poke()
        return handle

    def abort(self, handle: RequestHandle) -> None:
        handle.aborted = True
        if not handle.req.done:
            self.core.abort(handle.req)
            self._publish(self.core.cache.drain_changes())

    def load(self) -> dict[str, int]:
        return self.core.load()

    def dump(self) -> list[KvChange]:
        return self.core.cache.dump()

    # --- loop -------------------------------------------------------------------------------

    def poke(self) -> None:
        self._wake.set()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"engine-{self.dp_rank}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            if self.faults.hang or not self.core.has_work():
                self._wake.clear()
                await self._wake.wait()
                continue
            self.core.wrong_output = self.faults.wrong_output
            out = self.core.step()
            self._publish(out.changes)
            if not out.emitted and out.duration == 0.0:
                # Nothing could be scheduled (cannot happen for admissible requests): wait.
                self._wake.clear()
                await self._wake.wait()
                continue
            self.steps += 1
            self.busy_seconds += out.duration
            await self._sleep(out.duration * self.faults.slow_factor)
            for req, token in out.emitted:
                handle: RequestHandle = req.tag
                if handle.aborted:
                    continue
                handle.delivered += 1
                if handle.delivered == 1:
                    self.cached_tokens_total += handle.cached_tokens
                handle._push(token)
                self.output_tokens_total += 1
            for req in out.finished:
                req.tag._push(_END)

    def _publish(self, changes: list[KvChange]) -> None:
        if changes and self.on_kv_changes is not None:
            try:
                self.on_kv_changes(self.dp_rank, changes)
            except Exception:  # the publisher must never stop the engine
                log.exception("KV change sink failed")
