"""How long a hop waits for a live engine's first byte (api/forward/first_byte.py)."""

from __future__ import annotations

import pytest

from api.forward.first_byte import FirstBytePolicy, FirstByteWaits, WaitAction


def test_waits_only_for_a_live_working_engine_and_only_up_to_the_limit() -> None:
    policy = FirstBytePolicy(limit=60.0)
    assert policy.keep_waiting(30.0, alive=True, working=True)
    assert not policy.keep_waiting(30.0, alive=False, working=True)
    assert not policy.keep_waiting(30.0, alive=True, working=False)  # hung
    assert not policy.keep_waiting(60.0, alive=True, working=True)
    with pytest.raises(ValueError):
        FirstBytePolicy(limit=-1.0)


def test_each_idle_timeout_is_counted_by_what_followed() -> None:
    alive = {"e1": True}
    recorded: list[WaitAction] = []
    waits = FirstByteWaits(FirstBytePolicy(limit=10.0), lambda wid: alive[wid],
                           lambda wid: True, record=recorded.append)
    patience = waits.patience("e1", "r1")
    assert patience is not None
    assert patience(1.0) and patience(5.0)
    alive["e1"] = False  # its gauges stopped: the timeout stands
    assert not patience(6.0)
    alive["e1"] = True
    assert not patience(10.0)  # out of time
    assert recorded == [WaitAction.WAITED, WaitAction.WAITED, WaitAction.FAILED,
                        WaitAction.FAILED]


def test_a_hand_off_s_decode_hop_counts_as_working_while_it_pulls_the_kv() -> None:
    """The decode engine of a KV hand-off stores nothing until its pull is done."""
    waits = FirstByteWaits(FirstBytePolicy(limit=10.0), lambda wid: True, lambda wid: False)
    ordinary, decode = waits.patience("e1", "r1"), waits.patience("e1", "r2", handoff=True)
    assert ordinary is not None and decode is not None
    assert not ordinary(1.0)
    assert decode(1.0) and not decode(10.0)


def test_a_zero_limit_turns_waiting_off() -> None:
    waits = FirstByteWaits(FirstBytePolicy(limit=0.0), lambda wid: True, lambda wid: True)
    assert waits.patience("e1", "r1") is None
