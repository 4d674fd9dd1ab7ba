"""The async driver of one simulated engine (one data-parallel rank).

A single task loops: plan and apply a step on the pure :class:`EngineCore`, hand its KV-cache
changes to the publisher *at once* (so the event feed follows the cache's own order of changes,
which a re-announce snapshot relies on), wait out the simulated step time (the wait IS the
simulation), then deliver the step's tokens to the waiting HTTP handlers. With the polynomial
model the tokens go out once the step's prefill part is done and the decode part is waited out
after them, as Dynamo's mocker does (``StepOutcome.tokens_at``).

What a step costs in simulated time is the core's business (:mod:`workers.scheduler` with
:mod:`workers.perf_model`: by default Dynamo mocker's polynomial, a prefill term for the step's
uncached prompt tokens plus a decode term when it emits tokens, divided by ``speedup_ratio``).
This driver makes wall-clock time follow it, including steps shorter than the event loop's timer
resolution (about a millisecond: ``--speedup-ratio 10`` makes an empty-cache decode step 0.57 ms,
which sleeping it on its own would stretch to 1.1 ms or more):

* steps are scheduled by **absolute deadlines**: a step ends at its start + its duration, and the
  next step starts at that deadline, not at "now" — a wake-up that comes late is made up by the
  steps after it;
* the driver **sleeps only when ahead** of the deadline by at least ``min_sleep`` (one timer
  tick); otherwise it just yields to the event loop once, so tokens are never delivered more
  than ``min_sleep`` before their step's deadline and no wake-up is wasted on a sub-tick sleep;
* a busy period starts from "now" (an idle engine does not bank time), and so does a step that
  finds the driver more than ``max_lag`` behind (a stalled process catches up at once rather
  than racing through a burst of zero-length steps).

``steps``/``busy_seconds`` count steps and their simulated time; ``wall_seconds`` the wall-clock
time the driver spent in busy periods, so ``wall_seconds / steps`` is the achieved step time
(``python -m workers.bench --steps`` prints both).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from workers.faults import FaultState
from workers.kvcache import KvChange
from workers.scheduler import EngineConfig, EngineCore, SimRequest, StepOutcome

log = logging.getLogger(__name__)

KvSink = Callable[[int, list[KvChange]], None]
_END = -1
MIN_SLEEP = 0.001  # the event loop's timers tick in milliseconds
MAX_LAG = 0.1


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

    async def token_runs(self) -> AsyncIterator[list[int]]:
        """The tokens of :meth:`tokens`, those already produced when one is awaited together:
        a request's last token and its end come in one step, so a stream may write them, and
        what follows the end, at once."""
        queue = self._queue
        while True:
            run = [await queue.get()]
            while not queue.empty():
                run.append(queue.get_nowait())
            if run[-1] == _END:
                self.finished = True
                if len(run) > 1:
                    yield run[:-1]
                return
            yield run

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
        clock: Callable[[], float] | None = None,
        min_sleep: float = MIN_SLEEP,
        max_lag: float = MAX_LAG,
    ) -> None:
        self.config = config
        self.dp_rank = dp_rank
        self.core = EngineCore(config, salt=salt)
        self.faults = faults or FaultState()
        self.faults.on_change.append(self.poke)
        self.on_kv_changes = on_kv_changes
        self._sleep = sleep
        self._clock = clock  # None: the running loop's clock
        self.min_sleep = min_sleep
        self.max_lag = max_lag
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.steps = 0
        self.busy_seconds = 0.0  # simulated time spent in steps (before the slow fault)
        self.wall_seconds = 0.0  # wall-clock time of busy periods (module doc)
        self.prompt_tokens_total = 0
        self.cached_tokens_total = 0
        self.output_tokens_total = 0

    # --- requests ---------------------------------------------------------------------------

    def submit(self, request_id: str, prompt: list[int], max_tokens: int, *,
               transferred_tokens: int = 0, cache_salt: str = "") -> RequestHandle:
        """Queue a request (raises ValueError/RequestTooLarge for one that can never run).
        ``transferred_tokens``: prompt tokens whose KV a prefill engine handed over."""
        handle = RequestHandle(self)
        handle.req = self.core.add(request_id, prompt, max_tokens, tag=handle,
                                   transferred_tokens=transferred_tokens, cache_salt=cache_salt)
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
        clock = self._clock or asyncio.get_running_loop().time
        deadline: float | None = None  # when the previous step ends; None: idle
        mark = 0.0  # wall time accounted into wall_seconds so far
        while True:
            if self.faults.hang or not self.core.has_work():
                deadline = None
                self._wake.clear()
                await self._wake.wait()
                continue
            self.core.wrong_output = self.faults.wrong_output
            out = self.core.step()
            self._publish(out.changes)
            if not out.emitted and out.duration == 0.0:
                # Nothing could be scheduled (cannot happen for admissible requests): wait.
                deadline = None
                self._wake.clear()
                await self._wake.wait()
                continue
            self.steps += 1
            self.busy_seconds += out.duration
            now = clock()
            if deadline is None:
                deadline = mark = now  # a busy period starts now
            elif now - deadline > self.max_lag:
                deadline = now  # stalled: resume from now (the stall still counts as wall time)
            start = deadline
            deadline = start + out.duration * self.faults.slow_factor
            tokens_at = start + out.tokens_at * self.faults.slow_factor
            await self._sleep_until(tokens_at, now)
            self._deliver(out)
            if tokens_at < deadline:  # the step's tail after its tokens (polynomial decode)
                await self._sleep_until(deadline, clock())
            done = clock()
            self.wall_seconds += done - mark
            mark = done

    async def _sleep_until(self, when: float, now: float) -> None:
        """Sleep only when ahead by a timer tick or more; otherwise yield once (module doc)."""
        ahead = when - now
        await self._sleep(ahead if ahead >= self.min_sleep else 0.0)

    def _deliver(self, out: StepOutcome) -> None:
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
