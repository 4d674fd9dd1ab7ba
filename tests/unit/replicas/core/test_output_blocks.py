"""Output-block tracking in the load (``--router-track-output-blocks``): placeholder decode blocks
as generation crosses block boundaries, weighted by progress toward the expected output length."""

from __future__ import annotations

import msgspec

from eventlog import events as ev
from eventlog.names import KV, ROUTER
from replicas.core.load import ActiveLoad, OutputTracking, output_block_milli, output_blocks
from replicas.core.state import RouterState, StateConfig

W = ("w1", 0)
BS = 16


def test_blocks_counted_are_the_boundaries_generation_crossed() -> None:
    assert output_blocks(32, 0, BS) == 0
    assert output_blocks(32, 15, BS) == 0
    assert output_blocks(32, 16, BS) == 1
    assert output_blocks(40, 8, BS) == 1   # a partial prompt block fills up first
    assert output_blocks(40, 7, BS) == 0
    assert output_blocks(40, 40, BS) == 3  # 80 // 16 - 40 // 16


def test_load_grows_with_generated_blocks_at_full_weight_without_an_osl() -> None:
    load = ActiveLoad()
    load.add("r", "rep", W, 32, [1, 2], ts=1.0, output=OutputTracking(32, BS))
    assert load.active_decode_blocks(W) == 2
    seen = []
    for generated in (16, 32, 48, 64):
        assert load.output_progress("r", generated)
        seen.append(load.active_decode_blocks(W))
    assert seen == [3, 4, 5, 6]
    assert load.active_output_blocks(W) == 4.0
    assert load.finish("r")
    assert load.active_decode_blocks(W) == 0 and load.active_output_blocks(W) == 0


def test_with_an_osl_the_blocks_weigh_what_is_left_of_it() -> None:
    load = ActiveLoad()
    load.add("r", "rep", W, 0, [1, 2], ts=1.0, output=OutputTracking(32, BS, osl_hint=64))
    weights = []
    for generated in (16, 32, 48, 64, 80):
        load.output_progress("r", generated)
        weights.append(load.active_output_blocks(W))
    # 1 block at 3/4 left, 2 at 1/2, 3 at 1/4, then nothing once the expected length is reached
    assert weights == [0.75, 1.0, 0.75, 0.0, 0.0]
    # Output grows load at first, and a request near its end weighs less than at its middle.
    assert weights[3] < weights[1]
    assert load.active_decode_blocks(W) == 2


def test_progress_only_moves_forward_and_only_for_tracked_requests() -> None:
    load = ActiveLoad()
    load.add("t", "rep", W, 0, [1], ts=1.0, output=OutputTracking(16, BS))
    load.add("u", "rep", W, 0, [2], ts=1.0)
    assert load.output_progress("t", 32)
    digest = load.digest
    assert not load.output_progress("t", 16)  # stale (a coalesced append landing late)
    assert not load.output_progress("t", 32)
    assert not load.output_progress("u", 64)  # not tracked
    assert not load.output_progress("nope", 64)
    assert load.digest == digest
    assert load.active_output_blocks(W) == 2.0


def test_progress_changes_the_digest_and_survives_a_snapshot() -> None:
    load = ActiveLoad()
    load.add("a", "rep", W, 10, [1, 2], ts=1.0, output=OutputTracking(40, BS, osl_hint=100))
    load.add("b", "rep", ("w2", 0), 10, [3], ts=2.0, output=OutputTracking(20, BS))
    before = load.digest
    load.output_progress("a", 30)
    load.prefill_completed("b", ts=3.0)
    load.output_progress("b", 50)
    assert load.digest != before
    back = ActiveLoad.from_plain(msgspec.msgpack.decode(msgspec.msgpack.encode(load.to_plain())))
    assert back.digest == load.digest
    assert back.to_plain() == load.to_plain()
    for w in (W, ("w2", 0)):
        assert back.active_decode_blocks(w) == load.active_decode_blocks(w)
    back.output_progress("a", 60)
    load.output_progress("a", 60)
    assert back.digest == load.digest


def test_weights_are_exact_whatever_order_requests_come_and_go() -> None:
    def run(order: list[str]) -> tuple[float, int]:
        load = ActiveLoad()
        for rid in order:
            k = int(rid[1:])
            load.add(rid, "rep", W, 0, [], ts=float(k), output=OutputTracking(7, BS, 90 + 7 * k))
        for step in range(1, 5):
            for rid in order:
                load.output_progress(rid, step * 17 + int(rid[1:]))
        return load.active_output_blocks(W), load.digest

    ids = [f"r{i}" for i in range(20)]
    weighted, digest = run(ids)
    assert 0 < weighted < 20 * 4
    assert run(list(reversed(ids))) == run(ids[7:] + ids[:7]) == (weighted, digest)
    assert output_block_milli(OutputTracking(0, BS, 3), 32) == 0  # past the expected length


def _routed(rid: str, replica: str, ts: float, *, osl: int = 0) -> ev.RequestRouted:
    return ev.RequestRouted(rid, replica, "w1", 0, 64, [1, 2, 3, 4], 0, 128, 1, ts,
                            block_size=BS, track_output_blocks=True, osl_hint=osl,
                            prefill_load_model="linear")


def test_two_replicas_applying_the_stream_agree_on_tracked_load() -> None:
    """Both flags travel on the router stream: a replica configured without them accounts the
    request exactly like the one that routed it, live or restored from a snapshot."""
    stream = [
        [_routed("a", "ra", 10.0, osl=96)],
        [_routed("b", "rb", 10.5)],
        [ev.PrefillCompleted("a", 11.0)],
        [ev.OutputProgress("a", 16, 11.5)],
        [ev.OutputProgress("a", 32, 12.0)],
        [ev.PrefillCompleted("b", 12.5)],
        [ev.OutputProgress("b", 16, 13.0)],
    ]
    reg = [ev.WorkerRegistered("w1", "http://w1", "m", BS, 1000, 8192, 1.0)]
    one, two = RouterState(StateConfig(block_size=BS)), RouterState(StateConfig(block_size=BS))
    for state in (one, two):
        state.apply(KV, 1, reg)
    for seq, batch in enumerate(stream, 1):
        one.apply(ROUTER, seq, batch)
        if seq == 4:
            two = RouterState.decode(one.encode(), two.config)  # joins from a snapshot
        elif seq > 4:
            two.apply(ROUTER, seq, batch)
    assert one.digests() == two.digests()
    # 4 prompt blocks (shared); a: 2 output blocks at 64/96 left (1.333); b: 1 at full weight
    assert one.load.active_decode_blocks(W) == two.load.active_decode_blocks(W) == 4 + 2.333
    assert one.load.active_output_blocks(W) == two.load.active_output_blocks(W)
    assert one.stats.counts[(ROUTER, "OutputProgress", "ok")] == 3
