"""A request's wait for its routing decision (`replicas.runtime.decision_log`), on bare futures:
an outcome known in the very loop turn the request asks is taken into account at once."""

from __future__ import annotations

import asyncio

import pytest

from eventlog.appender import AppendFailed
from replicas.runtime.decision_log import DecisionLog, DecisionNotRecorded, RecordState

pytestmark = pytest.mark.timeout(10)


def _log(settled: list[str], grace: float = 1.0) -> DecisionLog:
    return DecisionLog("r1", grace=grace, timeout=15.0, settle=settled.append)


async def test_a_refusal_that_just_arrived_is_not_served() -> None:
    settled: list[str] = []
    log = _log(settled)
    fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    record = log.track("q1", fut)
    fut.set_exception(AppendFailed("jr.router.r1", "m1", RuntimeError("maximum bytes exceeded")))
    with pytest.raises(DecisionNotRecorded, match="maximum bytes"):
        await log.wait(record)  # before the future's own callback ran
    await asyncio.sleep(0)  # ...which then changes nothing
    assert settled == ["q1"] and log.health.failures == 1 and record.refused


async def test_an_acknowledgement_that_just_arrived_is_recorded_once() -> None:
    settled: list[str] = []
    log = _log(settled)
    fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    record = log.track("q1", fut)
    fut.set_result(7)
    await log.wait(record)
    await asyncio.sleep(0)
    assert record.state is RecordState.RECORDED and settled == []
    assert log.health.served_unrecorded == 0 and log.health.failures == 0


def test_grace_and_timeout_are_checked() -> None:
    with pytest.raises(ValueError):
        DecisionLog("r1", grace=-1.0, timeout=15.0, settle=lambda _: None)
    with pytest.raises(ValueError):
        DecisionLog("r1", grace=1.0, timeout=0.0, settle=lambda _: None)
