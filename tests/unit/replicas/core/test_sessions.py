"""Sticky session pins in the pure core: pin, refresh, move, release, TTL in event time,
snapshots (old blobs without sessions still load), reset and digests."""

from __future__ import annotations

import msgspec

from eventlog import events as ev
from eventlog.names import CONTROL, KV, ROUTER
from replicas.core.sessions import SessionTable
from replicas.core.state import RouterState


def pinned(session: str, worker: str, ts: float, ttl: float = 10.0,
           reason: str = "bind") -> ev.SessionPinned:
    return ev.SessionPinned(session, worker, 0, "m", ttl, ts, f"req-{ts}", reason)


def test_pin_refresh_and_move() -> None:
    state = RouterState()
    state.apply(ROUTER, 1, [pinned("s1", "w0", 100.0, reason="open")])
    pin = state.sessions.get("s1")
    assert pin is not None and pin.worker == ("w0", 0) and pin.requests == 1
    state.apply(ROUTER, 2, [pinned("s1", "w0", 105.0)])
    pin = state.sessions.get("s1")
    assert pin is not None and pin.last_ts == 105.0 and pin.opened_ts == 100.0
    assert pin.requests == 2
    state.apply(ROUTER, 3, [pinned("s1", "w1", 106.0, reason="repin")])
    assert state.sessions.get("s1").worker == ("w1", 0)  # type: ignore[union-attr]
    assert state.stats.counts[(ROUTER, "SessionPinned", "moved")] == 1


def test_sliding_ttl_in_event_time() -> None:
    state = RouterState()
    state.apply(ROUTER, 1, [pinned("s1", "w0", 100.0, ttl=10.0)])
    # Another stream's event moves event time: 109 is inside the window.
    state.apply(CONTROL, 1, [ev.SnapshotThresholdSet(5, 109.0)])
    assert state.sessions.get("s1") is not None
    state.apply(ROUTER, 2, [pinned("s1", "w0", 109.5, ttl=10.0)])  # slides to 119.5
    state.apply(CONTROL, 2, [ev.SnapshotThresholdSet(5, 119.0)])
    assert state.sessions.get("s1") is not None
    state.apply(CONTROL, 3, [ev.SnapshotThresholdSet(5, 119.6)])
    assert state.sessions.get("s1") is None
    assert state.stats.counts[(ROUTER, "SessionExpired", "ok")] == 1


def test_an_older_timestamp_never_shortens_the_window() -> None:
    table = SessionTable()
    table.pin("s", ("w0", 0), "m", 10.0, 50.0)
    table.pin("s", ("w0", 0), "m", 10.0, 40.0)  # a replica whose clock is behind
    assert table.get("s").last_ts == 50.0  # type: ignore[union-attr]
    assert table.expire(59.0) == [] and table.expire(60.5) == ["s"]


def test_release_closes_and_unknown_is_counted() -> None:
    state = RouterState()
    state.apply(ROUTER, 1, [pinned("s1", "w0", 1.0)])
    state.apply(ROUTER, 2, [ev.SessionReleased("s1", "closed", 2.0)])
    state.apply(ROUTER, 3, [ev.SessionReleased("s1", "closed", 3.0)])
    assert len(state.sessions) == 0
    assert state.stats.counts[(ROUTER, "SessionReleased", "unknown_session")] == 1


def test_pin_on_the_wrong_stream_is_not_applied() -> None:
    state = RouterState()
    state.apply(KV, 1, [pinned("s1", "w0", 1.0)])
    assert len(state.sessions) == 0
    assert state.stats.counts[(KV, "SessionPinned", "wrong_stream")] == 1


def test_digest_is_order_independent_and_ignores_turn_counts() -> None:
    a, b = RouterState(), RouterState()
    a.apply(ROUTER, 1, [pinned("s1", "w0", 1.0), pinned("s2", "w1", 2.0)])
    b.apply(ROUTER, 1, [pinned("s2", "w1", 2.0), pinned("s1", "w0", 1.0)])
    assert a.digests() == b.digests()
    a.apply(ROUTER, 2, [ev.SessionReleased("s1", "closed", 3.0)])
    assert a.digests()["sessions"] != b.digests()["sessions"]
    assert a.digests()["state"] != b.digests()["state"]


def test_snapshot_round_trip_and_expiry_after_restore() -> None:
    state = RouterState()
    state.apply(ROUTER, 1, [pinned("s1", "w0", 100.0, ttl=5.0), pinned("s2", "w1", 100.0, 50.0)])
    copy = RouterState.decode(state.encode())
    assert copy.digests() == state.digests()
    assert copy.sessions.get("s2").worker == ("w1", 0)  # type: ignore[union-attr]
    copy.apply(ROUTER, 2, [ev.RequestFinished("x", "ok", 0, 106.0)])
    assert copy.sessions.get("s1") is None and copy.sessions.get("s2") is not None


def test_snapshot_without_sessions_still_loads() -> None:
    state = RouterState()
    state.apply(ROUTER, 1, [pinned("s1", "w0", 1.0)])
    doc = msgspec.msgpack.decode(state.encode())
    del doc["sessions"]  # a blob written before sticky sessions existed
    old = RouterState.decode(msgspec.msgpack.encode(doc))
    assert len(old.sessions) == 0 and old.positions[ROUTER] == 1


def test_state_reset_clears_pins() -> None:
    state = RouterState()
    state.apply(ROUTER, 1, [pinned("s1", "w0", 1.0)])
    state.apply(CONTROL, 1, [ev.StateReset(1, "test", 2.0, {KV: 0, ROUTER: 1})])
    assert len(state.sessions) == 0


def test_malformed_session_events_are_refused_by_the_decoder() -> None:
    bad = msgspec.msgpack.encode([{"type": "SessionPinned", "session_id": "s", "worker_id": "w",
                                   "dp_rank": 0, "model": "m", "ttl": -1.0, "ts": 1.0}])
    try:
        ev.decode_batch(bad)
    except ev.MalformedMessage:
        pass
    else:
        raise AssertionError("a negative ttl must not decode")
