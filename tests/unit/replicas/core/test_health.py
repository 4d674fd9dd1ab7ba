"""Circuit breaker and worker health state machine (Dynamo's fault-tolerance guide), driven with
explicit times."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from eventlog.events import WorkerHealthChanged
from replicas.core.health import (
    BreakerState,
    CircuitBreaker,
    HealthBoard,
    HealthConfig,
    HealthStatus,
    ReferenceAnswers,
)
from tests.unit.test_core_purity import FORBIDDEN_MODULES, imported_roots

ROOT = Path(__file__).resolve().parents[4]


@pytest.mark.parametrize("path", ["replicas/core/health.py", "replicas/core/shedding.py"])
def test_health_and_shedding_are_pure(path: str) -> None:
    tree = ast.parse((ROOT / path).read_text())
    assert not imported_roots(tree) & FORBIDDEN_MODULES


# --- circuit breaker ------------------------------------------------------------------------------

def test_breaker_opens_after_threshold_consecutive_failures() -> None:
    b = CircuitBreaker(failure_threshold=3, recovery_timeout=60.0)
    b.record_failure(1.0)
    b.record_failure(2.0)
    assert b.state == BreakerState.CLOSED and b.allow(2.0)
    b.record_failure(3.0)
    assert b.state == BreakerState.OPEN
    assert not b.allow(3.0) and not b.allow(62.9)


def test_breaker_success_resets_the_consecutive_count() -> None:
    b = CircuitBreaker(failure_threshold=3)
    for t in range(10):  # fail, fail, succeed, ... never three in a row
        if t % 3 == 2:
            b.record_success(float(t))
        else:
            b.record_failure(float(t))
    assert b.state == BreakerState.CLOSED


def half_open() -> CircuitBreaker:
    """A breaker (3 failures, 60 s) opened by failures at 0-2 s, its trial let through at 62 s."""
    b = CircuitBreaker(failure_threshold=3, recovery_timeout=60.0)
    for t in (0.0, 1.0, 2.0):
        b.record_failure(t)
    assert b.allow(62.0)
    return b


def test_half_open_lets_exactly_one_trial_through() -> None:
    b = half_open()
    assert b.state == BreakerState.HALF_OPEN
    assert not b.allow(62.0) and not b.allow(63.0)


def test_half_open_success_closes() -> None:
    b = half_open()
    b.record_success(62.1)
    assert b.state == BreakerState.CLOSED and b.failures == 0
    assert b.allow(62.2) and b.allow(62.3)


def test_half_open_failure_reopens_for_another_timeout() -> None:
    b = half_open()
    b.record_failure(62.5)
    assert b.state == BreakerState.OPEN
    assert not b.allow(122.0)
    assert b.allow(122.5) and b.state == BreakerState.HALF_OPEN


def test_success_while_open_does_not_close() -> None:
    b = CircuitBreaker(failure_threshold=1, recovery_timeout=60.0)
    b.record_failure(0.0)
    b.record_success(1.0)  # e.g. an in-flight request that drained fine
    assert b.state == BreakerState.OPEN


def test_a_lost_trial_does_not_wedge_the_breaker() -> None:
    b = CircuitBreaker(failure_threshold=1, recovery_timeout=10.0)
    b.record_failure(0.0)
    assert b.allow(10.0)          # the trial goes out and never reports back
    assert not b.allow(19.9)
    assert b.allow(20.0)          # another trial after one more recovery_timeout


@given(st.lists(st.sampled_from(["fail", "success", "allow"]), max_size=60))
def test_half_open_never_lets_two_trials_through_within_a_timeout(ops: list[str]) -> None:
    b = CircuitBreaker(failure_threshold=2, recovery_timeout=5.0)
    last_trial: float | None = None
    for t, op in enumerate(ops):
        if op == "fail":
            b.record_failure(float(t))
        elif op == "success":
            b.record_success(float(t))
        elif b.state != BreakerState.CLOSED and b.allow(float(t)):
            # A second trial is only handed out once the previous one may be presumed lost.
            assert last_trial is None or t - last_trial >= 5.0
            last_trial = float(t)
        if b.state != BreakerState.HALF_OPEN:
            last_trial = None


# --- status machine ---------------------------------------------------------------------------

def board(**kw: float) -> HealthBoard:
    return HealthBoard(HealthConfig(failure_threshold=3, recovery_timeout=60.0, **kw))


def test_first_failure_suspicious_third_unhealthy() -> None:
    hb = board()
    c1 = hb.on_canary("w", ok=True, latency=0.1, tokens_match=False, now=1.0)
    assert c1 is not None and (c1.old, c1.new) == (HealthStatus.HEALTHY, HealthStatus.SUSPICIOUS)
    assert "mismatch" in c1.reason
    assert hb.on_canary("w", False, 5.0, False, 2.0, "timeout") is None
    c3 = hb.on_passive_failure("w", "connection reset", 3.0)
    assert c3 is not None and (c3.old, c3.new) == (HealthStatus.SUSPICIOUS, HealthStatus.UNHEALTHY)
    assert hb.status_gauge("w") == 2 and hb.breaker_state("w") == BreakerState.OPEN
    assert hb.breaker_gauge("w") == 1
    e = c3.event()
    assert isinstance(e, WorkerHealthChanged)
    assert (e.worker_id, e.status, e.ts) == ("w", HealthStatus.UNHEALTHY, 3.0)


def test_a_success_makes_a_suspicious_worker_healthy_again() -> None:
    hb = board()
    hb.on_canary("w", True, 0.1, True, 0.0)
    hb.on_canary("w", False, 0.1, False, 1.0, "refused")
    assert hb.status("w") == HealthStatus.SUSPICIOUS and hb.status_gauge("w") == 1
    c = hb.on_canary("w", True, 0.1, True, 2.0)
    assert c is not None and (c.old, c.new) == (HealthStatus.SUSPICIOUS, HealthStatus.HEALTHY)
    # ... and the failure count restarted: two more failures do not make it unhealthy.
    hb.on_canary("w", False, 0.1, False, 3.0)
    hb.on_canary("w", False, 0.1, False, 4.0)
    assert hb.status("w") == HealthStatus.SUSPICIOUS


def test_unhealthy_recovers_only_through_the_half_open_trial() -> None:
    hb = board()
    for t in (0.0, 1.0, 2.0):
        hb.on_canary("w", True, 0.1, False, t)
    assert hb.status("w") == HealthStatus.UNHEALTHY
    assert not hb.should_check("w", 30.0)
    hb.on_passive_success("w", 31.0)  # a drained request: proves nothing
    assert hb.status("w") == HealthStatus.UNHEALTHY
    assert hb.should_check("w", 62.0) and hb.breaker_state("w") == BreakerState.HALF_OPEN
    assert not hb.should_check("w", 62.0)
    c = hb.on_canary("w", True, 0.1, True, 62.1)
    assert c is not None and (c.old, c.new) == (HealthStatus.UNHEALTHY, HealthStatus.HEALTHY)
    assert "half-open" in c.reason and hb.breaker_state("w") == BreakerState.CLOSED


def test_failed_trial_keeps_it_unhealthy_without_a_new_change() -> None:
    hb = board()
    for t in (0.0, 1.0, 2.0):
        hb.on_canary("w", False, 0.1, False, t)
    assert hb.should_check("w", 63.0)
    assert hb.on_canary("w", True, 0.1, False, 63.0) is None
    assert hb.status("w") == HealthStatus.UNHEALTHY and hb.breaker_state("w") == BreakerState.OPEN
    assert not hb.should_check("w", 100.0)


def test_slow_canary_is_suspicious_but_never_trips_the_breaker() -> None:
    hb = board(slow_factor=3.0, slow_min_excess=0.05)
    for t in range(5):
        hb.on_canary("w", True, 0.1, True, float(t))
    changes = [hb.on_canary("w", True, 0.5, True, 10.0 + t) for t in range(10)]
    assert changes[0] is not None and changes[0].new == HealthStatus.SUSPICIOUS
    assert "slow" in changes[0].reason
    assert all(c is None for c in changes[1:])
    assert hb.breaker_state("w") == BreakerState.CLOSED
    # The baseline did not drift up to the slow latency: back to normal speed → healthy.
    assert hb.worker("w").baseline == pytest.approx(0.1)
    c = hb.on_canary("w", True, 0.11, True, 30.0)
    assert c is not None and c.new == HealthStatus.HEALTHY


def test_jitter_on_a_tiny_baseline_is_not_slow() -> None:
    hb = board(slow_factor=3.0, slow_min_excess=0.05)
    hb.on_canary("w", True, 0.004, True, 0.0)
    assert hb.on_canary("w", True, 0.02, True, 1.0) is None  # 5x, but only 16 ms more
    assert hb.status("w") == HealthStatus.HEALTHY


def test_baseline_is_an_ewma_of_healthy_latencies() -> None:
    hb = board(baseline_alpha=0.1)
    hb.on_canary("w", True, 0.1, True, 0.0)
    hb.on_canary("w", True, 0.2, True, 1.0)
    assert hb.worker("w").baseline == pytest.approx(0.11)


def test_passive_success_resets_the_count_but_changes_no_status() -> None:
    hb = board()
    hb.on_passive_failure("w", "reset", 0.0)
    hb.on_passive_failure("w", "reset", 1.0)
    assert hb.on_passive_success("w", 2.0) is None
    assert hb.status("w") == HealthStatus.SUSPICIOUS
    hb.on_passive_failure("w", "reset", 3.0)
    assert hb.status("w") == HealthStatus.SUSPICIOUS  # 1 since the reset, not 3


def test_adopt_takes_over_the_replicated_view() -> None:
    hb = board()
    hb.adopt({"a": HealthStatus.UNHEALTHY, "b": HealthStatus.SUSPICIOUS}, ["a", "b", "c"],
             now=100.0)
    assert [hb.status(w) for w in "abc"] == [HealthStatus.UNHEALTHY, HealthStatus.SUSPICIOUS,
                                             HealthStatus.HEALTHY]
    assert not hb.should_check("a", 159.0) and hb.should_check("a", 160.0)
    c = hb.on_canary("b", True, 0.1, True, 101.0)
    assert c is not None and (c.old, c.new) == (HealthStatus.SUSPICIOUS, HealthStatus.HEALTHY)
    with pytest.raises(ValueError):
        hb.adopt({"a": "zombie"}, ["a"], 0.0)


def test_forget_starts_a_new_incarnation_clean() -> None:
    hb = board()
    for t in (0.0, 1.0, 2.0):
        hb.on_canary("w", False, 0.1, False, t)
    hb.forget("w")
    assert hb.status("w") == HealthStatus.HEALTHY and hb.should_check("w", 3.0)


# --- reference answers ------------------------------------------------------------------------

def test_majority_outvotes_a_worker_wrong_from_its_first_check() -> None:
    refs = ReferenceAnswers()
    refs.settle("m", {"a": "good", "b": "bad", "c": "good"})
    assert refs.pinned("b") is None
    assert refs.expected("b", "m") == "good"
    assert refs.expected("a", "m") == "good"


def test_without_a_majority_each_worker_is_held_to_its_own_pin() -> None:
    refs = ReferenceAnswers()
    refs.settle("m", {"a": "x", "b": "y"})
    assert refs.majority("m") is None
    assert refs.expected("a", "m") == "x" and refs.expected("b", "m") == "y"
    refs.settle("other", {"z": "q"})
    assert refs.expected("z", "other") == "q"  # models never vote for each other
    refs.forget("a")
    assert refs.pinned("a") is None and refs.majority("m") == "y"
