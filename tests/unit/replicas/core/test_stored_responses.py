"""Stored responses in the pure core: the ResponseStored event applied, TTL in event time,
snapshots (old blobs without them still load), reset, digests and the follow-up lookup."""

from __future__ import annotations

import msgspec
import pytest

from eventlog import events as ev
from eventlog.names import CONTROL, KV, ROUTER
from replicas.core.candidates import HEALTH_WEIGHT
from replicas.core.state import RouterState
from replicas.core.stored_responses import Lookup, response_target


def stored(response_id: str, worker: str, ts: float, ttl: float = 10.0) -> ev.ResponseStored:
    return ev.ResponseStored(response_id, worker, 0, "m", ttl, ts, f"req-{ts}")


def registered(worker: str, ts: float) -> ev.WorkerRegistered:
    return ev.WorkerRegistered(worker, f"http://{worker}", "m", 16, 100, 64, ts)


def lookup(state: RouterState, response_id: str) -> tuple[object, Lookup]:
    return response_target(state.responses, state.workers, state.health, HEALTH_WEIGHT,
                           response_id)


def test_a_stored_response_points_at_its_engine() -> None:
    state = RouterState()
    state.apply(KV, 1, [registered("w0", 1.0)])
    state.apply(ROUTER, 1, [stored("resp_1", "w0", 2.0)])
    assert lookup(state, "resp_1") == (("w0", 0), Lookup.FOUND)
    assert lookup(state, "resp_nope") == (None, Lookup.UNKNOWN)
    assert state.stats.counts[(ROUTER, "ResponseStored", "ok")] == 1


def test_the_engine_retired_or_unhealthy_is_reported_not_replaced() -> None:
    state = RouterState()
    state.apply(KV, 1, [registered("w0", 1.0)])
    state.apply(ROUTER, 1, [stored("resp_1", "w0", 2.0)])
    state.apply(CONTROL, 1, [ev.WorkerHealthChanged("w0", "unhealthy", "test", 3.0)])
    assert lookup(state, "resp_1") == (("w0", 0), Lookup.UNAVAILABLE)
    state.apply(KV, 2, [ev.WorkerRetired("w0", "crashed", 4.0)])
    assert lookup(state, "resp_1") == (("w0", 0), Lookup.ENGINE_GONE)


def test_ttl_runs_in_event_time() -> None:
    state = RouterState()
    state.apply(ROUTER, 1, [stored("resp_1", "w0", 100.0, ttl=10.0)])
    state.apply(CONTROL, 1, [ev.SnapshotThresholdSet(5, 109.9)])
    assert state.responses.get("resp_1") is not None
    state.apply(CONTROL, 2, [ev.SnapshotThresholdSet(5, 110.1)])
    assert state.responses.get("resp_1") is None
    assert state.stats.counts[(ROUTER, "ResponseExpired", "ok")] == 1


def test_on_the_wrong_stream_it_is_not_applied() -> None:
    state = RouterState()
    state.apply(KV, 1, [stored("resp_1", "w0", 1.0)])
    assert len(state.responses) == 0
    assert state.stats.counts[(KV, "ResponseStored", "wrong_stream")] == 1


def test_digest_is_order_independent_and_zero_when_empty() -> None:
    a, b = RouterState(), RouterState()
    before = a.digests()["state"]
    assert a.digests()["responses"] == 0
    a.apply(ROUTER, 1, [stored("r1", "w0", 1.0), stored("r2", "w1", 2.0)])
    b.apply(ROUTER, 1, [stored("r2", "w1", 2.0), stored("r1", "w0", 1.0)])
    assert a.digests() == b.digests()
    assert a.digests()["state"] != before


def test_snapshot_round_trip_then_expiry_after_restore() -> None:
    state = RouterState()
    state.apply(ROUTER, 1, [stored("r1", "w0", 100.0, ttl=5.0),
                            stored("r2", "w1", 100.0, ttl=50.0)])
    copy = RouterState.decode(state.encode())
    assert copy.digests() == state.digests()
    assert copy.responses.get("r2").worker == ("w1", 0)  # type: ignore[union-attr]
    copy.apply(ROUTER, 2, [ev.RequestFinished("x", "ok", 0, 106.0)])
    assert copy.responses.get("r1") is None and copy.responses.get("r2") is not None


def test_snapshot_without_responses_still_loads() -> None:
    state = RouterState()
    state.apply(ROUTER, 1, [stored("r1", "w0", 1.0)])
    doc = msgspec.msgpack.decode(state.encode())
    del doc["responses"]  # a blob written before stored responses were replicated
    old = RouterState.decode(msgspec.msgpack.encode(doc))
    assert len(old.responses) == 0 and old.positions[ROUTER] == 1


def test_state_reset_clears_them() -> None:
    state = RouterState()
    state.apply(ROUTER, 1, [stored("r1", "w0", 1.0)])
    state.apply(CONTROL, 1, [ev.StateReset(1, "test", 2.0, {KV: 0, ROUTER: 1})])
    assert len(state.responses) == 0


def test_a_malformed_one_is_refused_by_the_decoder() -> None:
    bad = msgspec.msgpack.encode([{"type": "ResponseStored", "response_id": "", "worker_id": "w",
                                   "dp_rank": 0, "model": "m", "ttl": 1.0, "ts": 1.0}])
    with pytest.raises(ev.MalformedMessage):
        ev.decode_batch(bad)
