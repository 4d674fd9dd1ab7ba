"""Canary timeouts on an engine that says it is working: a stand-in on a real socket reports
vLLM's ``vllm:num_requests_running`` in its /metrics and never answers the canary in time (as
a CPU vLLM compiling kernels for a new shape, no token counter moving for seconds). With its
``/health`` answering, the timeouts are *busy*, not failures; with ``/health`` failing (vLLM's,
once its engine core is gone) they are failures, and the engine becomes unhealthy. A right but
slow answer is busy too while other requests were in flight, and slow (suspicious) when none
were."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from replicas.core.health import HealthStatus
from replicas.runtime.canary import progress_of
from tests.integration.replicas.test_canary import running, until
from tests.standin_engine import Received, Reply, standin_engine

pytestmark = pytest.mark.timeout(60)

METRICS = ("# TYPE vllm:num_requests_running gauge\n"
           'vllm:num_requests_running{engine="0",model_name="canary-sim"} 1.0\n'
           "# TYPE vllm:generation_tokens_total counter\n"
           'vllm:generation_tokens_total{engine="0",model_name="canary-sim"} 40.0\n')


def stuck_engine(stuck: asyncio.Event, health: int):  # type: ignore[no-untyped-def]
    def answer(got: Received) -> Reply:
        if got.path == "/metrics":
            return Reply(text=METRICS)
        if got.path == "/health":
            return Reply(status=health, json={})
        return Reply(json={"choices": [{"text": "x"}]}, hold=stuck)
    return answer


def test_progress_reads_token_counters_and_requests_in_flight() -> None:
    p = progress_of(METRICS)
    assert p.tokens == 40.0 and p.in_flight == 1.0
    assert progress_of("jetrouter_worker_generation_tokens_total 3\n").tokens == 3.0
    assert progress_of("other 1\n").tokens is None


@pytest.mark.parametrize(("health", "judged"), [(200, False), (503, True)])
async def test_a_timeout_with_requests_in_flight_is_busy_while_health_answers(
        health: int, judged: bool) -> None:
    stuck = asyncio.Event()
    try:
        async with standin_engine(stuck_engine(stuck, health)) as engine, \
                running({"w0": engine.url}, timeout=0.3) as h:
            if judged:
                await until(lambda: h.reached("w0", HealthStatus.UNHEALTHY))
                assert h.checker.busy == 0
            else:
                await until(lambda: h.checker.busy >= 4)
                assert h.of("w0") == []  # never suspicious, let alone unhealthy
    finally:
        stuck.set()


def slowing_engine(in_flight: int):  # type: ignore[no-untyped-def]
    """Answers the right tokens at once for its first five checks, then 0.4 s late (its
    baseline is a few ms), with ``in_flight`` requests running besides the check."""
    checks = itertools.count()

    def answer(got: Received) -> Reply:
        if got.path == "/metrics":
            return Reply(text=METRICS.replace("} 1.0", f"}} {in_flight}.0"))
        if got.path == "/health":
            return Reply(json={})
        if next(checks) < 5:
            return Reply(json={"choices": [{"text": "x"}]})
        late = asyncio.Event()
        asyncio.get_running_loop().call_later(0.4, late.set)
        return Reply(json={"choices": [{"text": "x"}]}, hold=late)
    return answer


@pytest.mark.parametrize(("in_flight", "suspicious"), [(1, False), (0, True)])
async def test_a_slow_right_answer_is_busy_while_other_requests_run(
        in_flight: int, suspicious: bool) -> None:
    """A real engine serving long prompts answers the canary right but several times slower
    than its idle baseline; that is their doing, not a slow engine's."""
    async with standin_engine(slowing_engine(in_flight)) as engine, \
            running({"w0": engine.url}, timeout=5.0) as h:
        if suspicious:
            await until(lambda: h.reached("w0", HealthStatus.SUSPICIOUS))
            assert h.checker.busy == 0
        else:
            await until(lambda: h.checker.busy >= 3)
            assert h.of("w0") == []
