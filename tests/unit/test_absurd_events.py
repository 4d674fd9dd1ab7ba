"""Regression tests for what the stream fuzzers found: events that decoded fine but broke or
split replicas. Each is now malformed (counted and skipped by every replica alike) or skipped."""

from __future__ import annotations

import msgspec
import pytest

from eventlog import events as ev
from eventlog.events import MalformedMessage, decode_batch
from eventlog.names import CONTROL, KV, ROUTER
from replicas.core.state import RouterState


def routed(**over: object) -> dict[str, object]:
    doc: dict[str, object] = {
        "type": "RequestRouted", "request_id": "q", "replica_id": "r0", "worker_id": "w0",
        "dp_rank": 0, "isl_tokens": 32, "block_seq_hashes": [1, 2], "overlap_blocks": 0,
        "expected_osl": 8, "priority": 0, "ts": 5.0}
    doc.update(over)
    return doc


def registered(**over: object) -> dict[str, object]:
    doc: dict[str, object] = {
        "type": "WorkerRegistered", "worker_id": "w0", "url": "http://x", "model": "m",
        "block_size": 16, "kv_total_blocks": 100, "max_num_batched_tokens": 64, "ts": 1.0}
    doc.update(over)
    return doc


@pytest.mark.parametrize("doc", [
    # overlap_blocks < 0 made the prefill estimate overflow the load digest's int64 packing,
    # and the follower restarted on that message forever ("argument out of range").
    routed(overlap_blocks=-(2**62)),
    routed(isl_tokens=-1),
    routed(ts=float("nan")), routed(ts=float("inf")), routed(ts=-1.0),
    routed(block_seq_hashes=[-5]),
    routed(request_id=""),
    # dp_size is iterated for every request, metrics scrape and /admin/workers call.
    registered(dp_size=10**9), registered(dp_size=0), registered(block_size=0),
    registered(kv_total_blocks=-3),
    # A cut far beyond any stream's end would make every replica skip everything after it,
    # and the leader then purged the stream up to it.
    {"type": "StateReset", "epoch": 1, "reason": "x", "ts": 1.0, "positions": {"kv": 2**60}},
    {"type": "SnapshotThresholdSet", "threshold": 0, "ts": 1.0},
    {"type": "WorkerHealthChanged", "worker_id": "w0", "status": "bogus", "reason": "", "ts": 1.0},
    {"type": "BusyThresholdsSet", "model": "m", "active_decode_blocks_threshold": float("nan"),
     "active_prefill_tokens_threshold": None, "active_prefill_tokens_threshold_frac": None,
     "ts": 1.0},
])
def test_absurd_events_are_malformed(doc: dict[str, object]) -> None:
    with pytest.raises(MalformedMessage):
        decode_batch(msgspec.msgpack.encode([doc]))


def test_sane_events_still_decode() -> None:
    batch = decode_batch(msgspec.msgpack.encode([routed(), registered(dp_size=4)]))
    assert isinstance(batch[0], ev.RequestRouted) and isinstance(batch[1], ev.WorkerRegistered)


def test_an_event_on_another_stream_is_skipped() -> None:
    """A RequestRouted on the KV stream used to be applied; replicas interleave the streams
    differently, so against the router stream's RequestFinished it split their states."""
    finished = ev.RequestFinished("q", "ok", 3, 6.0)
    (event,) = decode_batch(msgspec.msgpack.encode([routed()]))
    a, b = RouterState(), RouterState()
    a.apply(KV, 1, [event])
    a.apply(ROUTER, 1, [finished])
    b.apply(ROUTER, 1, [finished])
    b.apply(KV, 1, [event])
    assert a.digests() == b.digests() == RouterState().digests()
    assert a.stats.counts[(KV, "RequestRouted", "wrong_stream")] == 1
    assert len(a.load) == 0
    c = RouterState()
    c.apply(CONTROL, 1, [ev.WorkerRetired("w0", "x", 1.0)])
    assert c.stats.counts[(CONTROL, "WorkerRetired", "wrong_stream")] == 1


def test_a_reset_cutting_below_a_snapshot_is_skipped() -> None:
    """Found by the live stream fuzz: a StateReset whose cut lay below what the leader had
    already purged rewound every replica to messages that no longer exist (stuck forever)."""
    state = RouterState()
    state.apply(CONTROL, 1, [ev.SnapshotTaken("s1", {KV: 64, ROUTER: 10, CONTROL: 1}, 1, "h",
                                              "r0", "threshold", 1.0)])
    state.apply(CONTROL, 2, [ev.StateReset(1, "forged", 2.0, {KV: 2, ROUTER: 10})])
    assert state.epoch == 0 and state.stats.counts[(CONTROL, "StateReset", "stale_cut")] == 1
    state.apply(CONTROL, 3, [ev.StateReset(1, "admin", 3.0, {KV: 70, ROUTER: 12})])
    assert state.epoch == 1 and state.positions[KV] == 70
    # The floor travels in snapshots, so a restored replica judges the next reset alike.
    assert RouterState.decode(state.encode()).snapshot_floor == {KV: 64, ROUTER: 10, CONTROL: 1}
