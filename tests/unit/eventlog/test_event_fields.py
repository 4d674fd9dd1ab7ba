"""Fields added to events decode from messages written before them (old replicas' streams)."""

from __future__ import annotations

import msgspec

from eventlog import events as ev


def test_older_messages_decode_with_unknown_defaults() -> None:
    old_finished = msgspec.msgpack.encode([{"type": "RequestFinished", "request_id": "a",
                                            "outcome": "ok", "output_tokens": 3, "ts": 1.0}])
    old_routed = msgspec.msgpack.encode([{
        "type": "RequestRouted", "request_id": "a", "replica_id": "r", "worker_id": "w",
        "dp_rank": 0, "isl_tokens": 40, "block_seq_hashes": [1, 2], "overlap_blocks": 2,
        "expected_osl": 8, "priority": 1, "ts": 1.0}])
    (finished,) = ev.decode_batch(old_finished)
    (routed,) = ev.decode_batch(old_routed)
    assert isinstance(finished, ev.RequestFinished) and finished.cached_tokens == -1
    assert isinstance(routed, ev.RequestRouted) and routed.block_size == 0


def test_new_fields_round_trip() -> None:
    batch = [ev.RequestFinished("a", "ok", 3, 1.0, cached_tokens=32)]
    assert ev.decode_batch(ev.encode_batch(batch)) == batch
