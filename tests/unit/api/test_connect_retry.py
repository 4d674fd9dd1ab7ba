"""The policy for a connect that timed out (api/forward/connect_retry.py): alive or not, the
backoff, the window, the count bound; ConnectRetries applying it on a fake clock; and the
Forwarder keeping a live engine's connect timeout from the circuit breakers."""

from __future__ import annotations

import pytest

from api.forward.connect_retry import (
    ConnectRetries,
    ConnectRetryPolicy,
    ConnectTries,
    Retry,
)
from api.forward.forwarder import Forwarder
from api.metrics import RouterMetrics

pytestmark = pytest.mark.timeout(10)

POLICY = ConnectRetryPolicy(connect_timeout=5.0, window=30.0, alive_within=10.0,
                            first_backoff=0.1, max_backoff=2.0, max_retries=20,
                            shortest_connect=1.0)


def test_an_engine_heard_from_within_the_worker_timeout_is_alive() -> None:
    assert POLICY.alive(0.0) and POLICY.alive(9.9) and POLICY.alive(10.0)
    assert not POLICY.alive(10.1)
    assert not POLICY.alive(None)  # never heard from: nothing says it is alive


def test_an_engine_not_heard_from_is_not_tried_again() -> None:
    assert POLICY.next_try(retries=0, elapsed=5.0, heard_ago=None, jitter=0.0) is None
    assert POLICY.next_try(retries=0, elapsed=5.0, heard_ago=11.0, jitter=0.0) is None


def test_the_backoff_doubles_up_to_its_cap_and_jitter_spreads_its_second_half() -> None:
    assert [POLICY.backoff(n, 1.0) for n in range(7)] == \
        pytest.approx([0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0])
    assert POLICY.backoff(0, 0.0) == pytest.approx(0.05)
    assert POLICY.backoff(3, 0.5) == pytest.approx(0.8 * 0.75)
    assert POLICY.backoff(10_000, 1.0) == 2.0  # no overflow however many


def test_a_live_engine_is_tried_again_with_a_full_connect_while_the_window_allows() -> None:
    assert POLICY.next_try(retries=0, elapsed=5.0, heard_ago=1.0, jitter=1.0) == \
        Retry(wait=pytest.approx(0.1), timeout=5.0)


def test_the_last_connect_gets_what_is_left_of_the_window() -> None:
    retry = POLICY.next_try(retries=4, elapsed=26.0, heard_ago=1.0, jitter=1.0)
    assert retry == Retry(wait=pytest.approx(1.6), timeout=pytest.approx(30.0 - 26.0 - 1.6))


def test_no_connect_with_less_than_the_shortest_worth_making_left() -> None:
    assert POLICY.next_try(retries=5, elapsed=27.5, heard_ago=1.0, jitter=1.0) is None
    assert POLICY.next_try(retries=0, elapsed=31.0, heard_ago=1.0, jitter=0.0) is None
    # A connect timeout shorter than the shortest connect is the bound instead.
    quick = ConnectRetryPolicy(connect_timeout=0.3, window=2.0, first_backoff=0.1)
    assert quick.next_try(retries=0, elapsed=1.5, heard_ago=0.0, jitter=1.0) == \
        Retry(wait=pytest.approx(0.1), timeout=pytest.approx(0.3))
    assert quick.next_try(retries=0, elapsed=1.65, heard_ago=0.0, jitter=1.0) is None


def test_retries_are_bounded_by_count_as_well() -> None:
    assert POLICY.next_try(retries=19, elapsed=5.0, heard_ago=0.0, jitter=0.0) is not None
    assert POLICY.next_try(retries=20, elapsed=5.0, heard_ago=0.0, jitter=0.0) is None


@pytest.mark.parametrize("bad", [
    {"connect_timeout": 0}, {"window": 0}, {"first_backoff": 0},
    {"first_backoff": 3.0, "max_backoff": 2.0}, {"max_retries": -1}, {"alive_within": -1}])
def test_nonsense_settings_are_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        ConnectRetryPolicy(**bad)  # type: ignore[arg-type]


class FakeTime:
    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


async def test_connect_retries_time_the_hop_from_its_first_connect_and_stop_at_the_window(
        ) -> None:
    t = FakeTime()
    heard = {"w1": 0.5}
    retries = ConnectRetries(ConnectRetryPolicy(connect_timeout=1.0, window=5.0,
                                                first_backoff=0.5, max_backoff=1.0),
                             heard.get, clock=t.clock, jitter=lambda: 1.0, sleep=t.sleep)
    assert retries.alive("w1") and not retries.alive("w2")
    tries = await retries.again(None, "w1", "r~0")
    # The first connect began one connect timeout before it failed.
    assert tries == ConnectTries(started=99.0, retries=1, timeout=1.0) and t.slept == [0.5]
    timeouts = []
    while tries is not None:
        timeouts.append(tries.timeout)
        t.now += tries.timeout or 0.0  # that connect timed out too
        tries = await retries.again(tries, "w1", "r~0")
    # From 99: connects at 100.5 (timed out at 101.5) and 102.5 (at 103.5); one more after a
    # 1 s backoff would have 0.5 s of the 5 s left, less than the shortest connect.
    assert timeouts == [1.0, 1.0] and t.slept == [0.5, 1.0]


async def test_an_engine_that_falls_silent_is_not_tried_again() -> None:
    t = FakeTime()
    heard: dict[str, float] = {"w1": 0.5}
    retries = ConnectRetries(POLICY, heard.get, clock=t.clock, sleep=t.sleep)
    tries = await retries.again(None, "w1", "r")
    assert tries is not None
    heard["w1"] = 12.0  # its gauges stopped past the worker timeout
    assert await retries.again(tries, "w1", "r") is None


async def test_without_a_liveness_view_no_engine_is_alive() -> None:
    retries = ConnectRetries(POLICY, None)
    assert not retries.alive("w1")
    assert await retries.again(None, "w1", "r") is None


def test_a_live_engine_s_connect_timeout_is_not_reported_to_the_breakers() -> None:
    seen: list[tuple[str, str]] = []
    fw = Forwarder(None, RouterMetrics(),  # type: ignore[arg-type]
                   on_worker_failure=lambda w, r: seen.append((w, r)),
                   heard_ago={"busy": 0.5, "silent": 30.0}.get, alive_within=10.0)
    fw.report_failure("busy", "connect_timeout")      # alive: its canary judges it
    fw.report_failure("silent", "connect_timeout")    # not heard from for 30 s
    fw.report_failure("never", "connect_timeout")     # never heard from
    fw.report_failure("busy", "connect_error")        # refused: gone, whatever it published
    assert seen == [("silent", "connect_timeout"), ("never", "connect_timeout"),
                    ("busy", "connect_error")]
