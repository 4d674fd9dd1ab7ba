"""The ended-requests window (replicas/core/ended.py): membership, expiry by whole seconds of
event time, snapshot round trips (and the older id -> ts form), and through RouterState: a
RequestRouted delivered again after its request ended brings back no load, until the window
has passed."""

from __future__ import annotations

import msgspec

from eventlog import events as ev
from eventlog.names import KV, ROUTER
from replicas.core.ended import EndedRequests
from replicas.core.state import RouterState, StateConfig


def test_membership_and_expiry_by_whole_seconds() -> None:
    ended = EndedRequests()
    ended.add("a", 10.2)
    ended.add("b", 10.9)
    ended.add("c", 11.5)
    ended.add("a", 50.0)  # the first time counts
    assert ("a" in ended, "b" in ended, "c" in ended, "d" in ended) == (True, True, True, False)
    assert len(ended) == 3
    ended.expire(10.95)  # "b" is older than the bound, but its second [10, 11) is not all past
    assert "a" in ended and "b" in ended
    ended.expire(11.0)
    assert ("a" in ended, "b" in ended, "c" in ended) == (False, False, True)
    ended.add("a", 60.0)  # forgotten, so it can end again; its second add above left no trace
    ended.expire(51.0)
    assert "a" in ended and "c" not in ended
    ended.expire(1e9)
    assert len(ended) == 0 and "a" not in ended


def test_snapshot_round_trip_and_the_older_form() -> None:
    ended = EndedRequests()
    for i in range(50):
        ended.add(f"req-{i}", 100.0 + i / 7)
    copy = EndedRequests.from_plain(msgspec.msgpack.decode(msgspec.msgpack.encode(
        ended.to_plain())))
    old = EndedRequests.from_ids({f"req-{i}": 100.0 + i / 7 for i in range(50)})
    for other in (copy, old):
        assert other.to_plain() == ended.to_plain()
        other.expire(103.0)
        ended_copy = EndedRequests.from_plain(ended.to_plain())
        ended_copy.expire(103.0)
        assert other.to_plain() == ended_copy.to_plain()
        assert "req-0" not in other and "req-49" in other


def _state() -> RouterState:
    s = RouterState(StateConfig(request_max_age=60.0))
    s.apply(KV, 1, [ev.WorkerRegistered("w", "u", "m", 16, 100, 8192, 1.0)])
    return s


def test_a_request_routed_again_after_it_ended_adds_no_load_until_the_window_passed() -> None:
    s = _state()
    routed = ev.RequestRouted("q", "r", "w", 0, 64, [1, 2, 3, 4], 0, 8, 1, 2.0)
    s.apply(ROUTER, 1, [routed])
    s.apply(ROUTER, 2, [ev.RequestFinished("q", "ok", 3, 4.0)])
    assert len(s.load) == 0
    s.apply(ROUTER, 3, [routed])  # delivered again, as a fresh message
    assert len(s.load) == 0
    # Through a snapshot too, in the current form and in the older one (id -> routed ts).
    copy = RouterState.decode(s.encode(), s.config)
    doc = msgspec.msgpack.decode(s.encode())
    doc.pop("ended_buckets")
    doc["ended"] = {"q": 2.0}
    older = RouterState.decode(msgspec.msgpack.encode(doc), s.config)
    for state in (copy, older):
        state.apply(ROUTER, 4, [routed])
        assert len(state.load) == 0
    # Once event time has moved past the window, the id is forgotten (a duplicate that late
    # would expire at once anyway).
    s.apply(ROUTER, 5, [ev.RequestFinished("other", "ok", 1, 100.0)])
    assert "q" not in s._ended
