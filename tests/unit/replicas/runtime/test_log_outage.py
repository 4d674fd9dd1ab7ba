"""Degraded mode's bookkeeping on its own (times given explicitly): when it starts, when it ends,
and that each transition is one log line however often it is asked."""

from __future__ import annotations

import logging

import pytest

from replicas.runtime.log_outage import DISCONNECTED, UNACKNOWLEDGED, LogOutage

pytestmark = pytest.mark.timeout(10)


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "jetrouter.replica"]


def test_a_short_disconnect_is_not_an_outage_a_long_one_is(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    outage = LogOutage("r1", after_disconnect=3.0, after_unacknowledged=15.0)
    changes: list[bool] = []
    outage.listeners.append(changes.append)
    outage.connection_lost(100.0)
    assert not outage.degraded(102.9)  # a NATS node's death: reconnected elsewhere by now
    outage.connection_back()
    assert not outage.degraded(110.0)
    outage.connection_lost(200.0)
    assert all(outage.degraded(t) for t in (203.0, 203.5, 250.0))  # asked per request
    view = outage.view(250.0)
    assert view["degraded"] is True and view["reason"] == DISCONNECTED
    assert view["connected"] is False and view["degraded_for_s"] == 47.0
    outage.log_answered(251.0)  # not connected: a stale answer does not end it
    assert outage.degraded(251.0)
    outage.skipped_decision()
    outage.skipped_followup()
    outage.connection_back()
    outage.log_answered(260.0)
    assert not outage.degraded(260.0) and changes == [True, False]
    view = outage.view(260.0)
    assert view["outages"] == 1 and view["decisions_not_appended"] == 1
    assert view["followups_not_appended"] == 1
    lines = _lines(caplog)
    assert len(lines) == 2, lines  # one line per transition
    assert "DEGRADED" in lines[0] and "available again" in lines[1] and "1 routing" in lines[1]


def test_connected_without_acknowledgements_past_the_bound_is_an_outage() -> None:
    outage = LogOutage("r1", after_disconnect=3.0, after_unacknowledged=15.0)
    outage.unacknowledged_for(9.0)  # an election's length: still serving through it
    assert not outage.degraded(0.0)
    outage.unacknowledged_for(15.0)
    assert outage.degraded(0.0) and outage.reason == UNACKNOWLEDGED


def test_thresholds_must_be_positive() -> None:
    with pytest.raises(ValueError):
        LogOutage("r1", after_disconnect=0.0)
