"""The simulated engine's driver keeps simulated time, on a virtual clock: steps shorter than a
timer tick are honoured by absolute deadlines, late wake-ups are made up, an idle engine banks no
time, a stall is not raced through. No real sleeping, no timed assertions."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from workers.engine import Engine
from workers.perf_model import polynomial_decode_ms, polynomial_prefill_ms
from workers.scheduler import EngineConfig

STEP = 0.0006  # every step: 6 ms / speedup 10
CFG = EngineConfig(num_gpu_blocks=256, block_size=16, perf_model="linear",
                   prefill_ms_per_token=0.0, decode_ms_base=6.0, decode_ms_per_seq=0.0,
                   speedup_ratio=10.0)


class VirtualClock:
    """A clock that moves only when the driver sleeps: each sleep of d > 0 ends ``late``
    seconds after it was due (a millisecond timer), a sleep of 0 just yields. Every sleep
    yields first, so a token delivered before it is read at the time it was delivered."""

    def __init__(self, late: float) -> None:
        self.now = 0.0
        self.late = late
        self.sleeps: list[float] = []
        self.stall_next = 0.0  # extra lateness for the next positive sleep

    def time(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        await asyncio.sleep(0)  # consumers of tokens delivered so far read them at "now"
        if seconds > 0:
            self.now += seconds + self.late + self.stall_next
            self.stall_next = 0.0


@contextlib.asynccontextmanager
async def running(engine: Engine) -> AsyncIterator[Engine]:
    engine.start()
    try:
        yield engine
    finally:
        await engine.stop()


async def _run(engine: Engine, clock: VirtualClock, prompt_len: int, max_tokens: int
               ) -> list[float]:
    """Submit one request; the virtual times at which its tokens reached the consumer."""
    handle = engine.submit(f"r{clock.now}", list(range(1, prompt_len + 1)), max_tokens)
    seen: list[float] = []

    async def consume() -> None:
        async for _ in handle.tokens():
            seen.append(clock.now)

    await asyncio.wait_for(consume(), 10)
    return seen


@pytest.fixture
def clock() -> VirtualClock:
    return VirtualClock(late=0.0007)


async def test_sub_millisecond_steps_keep_their_rate_despite_late_wakeups(
        clock: VirtualClock) -> None:
    engine = Engine(CFG, sleep=clock.sleep, clock=clock.time)
    async with running(engine):
        times = await _run(engine, clock, prompt_len=16, max_tokens=200)
    assert engine.steps == 200 and engine.busy_seconds == pytest.approx(200 * STEP)
    # One timer wake-up late at most, not 200 of them (sleeping each step: 200 * 1.3 ms).
    assert clock.now <= 200 * STEP + engine.min_sleep + clock.late + 1e-12
    assert engine.wall_seconds == pytest.approx(clock.now)
    # Never a sleep shorter than a timer tick, and tokens never far ahead of their step's end.
    assert all(s == 0.0 or s >= engine.min_sleep for s in clock.sleeps)
    assert any(s > 0 for s in clock.sleeps)
    for k, t in enumerate(times, start=1):
        assert t >= k * STEP - engine.min_sleep - 1e-12


async def test_an_idle_engine_banks_no_time(clock: VirtualClock) -> None:
    engine = Engine(CFG, sleep=clock.sleep, clock=clock.time)
    async with running(engine):
        await _run(engine, clock, prompt_len=16, max_tokens=50)
        clock.now += 5.0  # idle for five seconds
        start = clock.now
        times = await _run(engine, clock, prompt_len=16, max_tokens=50)
    # The second request's steps are timed from its own start, not from the idle gap.
    assert times[-1] - start >= 50 * STEP - engine.min_sleep - 1e-12
    assert all(t - start >= k * STEP - engine.min_sleep - 1e-12
               for k, t in enumerate(times, start=1))


async def test_a_stall_longer_than_max_lag_resumes_from_now(clock: VirtualClock) -> None:
    engine = Engine(CFG, sleep=clock.sleep, clock=clock.time, max_lag=0.1)
    async with running(engine):
        clock.stall_next = 0.5  # the first real sleep wakes half a second late
        await _run(engine, clock, prompt_len=16, max_tokens=400)
    stalled_at = next(i for i, s in enumerate(clock.sleeps) if s > 0)
    after = clock.sleeps[stalled_at + 1:]
    # Not a burst of 0.5 s / 0.6 ms zero-length steps: the schedule restarts and sleeps again.
    first_sleep = next(i for i, s in enumerate(after) if s > 0)
    assert first_sleep <= 3
    # The stall itself is counted as wall time (achieved step time shows it).
    assert engine.wall_seconds == pytest.approx(clock.now)
    assert engine.wall_seconds >= 0.5


async def test_the_slow_fault_stretches_the_schedule(clock: VirtualClock) -> None:
    engine = Engine(CFG, sleep=clock.sleep, clock=clock.time)
    engine.faults.slow_factor = 4.0
    async with running(engine):
        await _run(engine, clock, prompt_len=16, max_tokens=100)
    assert engine.busy_seconds == pytest.approx(100 * STEP)  # simulated time, before the fault
    assert clock.now >= 100 * STEP * 4 - engine.min_sleep
    assert clock.now <= 100 * STEP * 4 + engine.min_sleep + clock.late + 1e-12


async def test_polynomial_first_token_is_out_after_the_prefill_part(clock: VirtualClock) -> None:
    """Dynamo's mocker order: a step's tokens go out when its prefill part is done, then the
    decode part is waited out before the next step, so token 2 comes one decode part later."""
    cfg = EngineConfig(num_gpu_blocks=256, block_size=16)  # the polynomial model
    engine = Engine(cfg, sleep=clock.sleep, clock=clock.time)
    async with running(engine):
        times = await _run(engine, clock, prompt_len=800, max_tokens=2)
    prefill = polynomial_prefill_ms(800) / 1000
    decode = polynomial_decode_ms(50 * 16, 256 * 16) / 1000  # 800 / 16 prompt blocks pinned
    # each wake-up is at most one timer tick + the clock's lateness behind its deadline
    slack = engine.min_sleep + clock.late + 1e-9
    assert prefill - slack <= times[0] <= prefill + slack
    assert times[1] - times[0] >= decode - slack
    assert engine.busy_seconds == pytest.approx(clock.now, abs=2 * slack)


async def test_token_runs_give_every_token_once_and_the_last_with_the_end(
        clock: VirtualClock) -> None:
    engine = Engine(CFG, sleep=clock.sleep, clock=clock.time)
    async with running(engine):
        by_one = engine.submit("one", list(range(1, 17)), 12)
        singles = [t async for t in by_one.tokens()]
        handle = engine.submit("runs", list(range(1, 17)), 12)
        runs: list[list[int]] = []
        finished_at_last_run: list[bool] = []

        async def consume() -> None:
            async for run in handle.token_runs():
                runs.append(run)
                finished_at_last_run.append(handle.finished)

        await asyncio.wait_for(consume(), 10)
    assert [t for run in runs for t in run] == singles == handle.output
    assert all(runs) and handle.finished
    # The step that made the last token also ended the request: the last run says so, so
    # a stream writes its end with it; no run before it does.
    assert finished_at_last_run[-1] and not any(finished_at_last_run[:-1])
