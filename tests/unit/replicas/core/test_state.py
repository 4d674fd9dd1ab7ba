"""RouterState: exactly-once application, order independence, encode/decode round trips."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from eventlog import events as ev
from eventlog.names import CONTROL, KV, ROUTER
from replicas.core.state import RouterState, StateConfig
from tests.eventgen import interleave, router_history, worker_history

WORKERS = ["w0", "w1", "w2"]


def build(seed: int, order_seed: int, n: int = 30) -> tuple[RouterState, list, list]:
    rng = random.Random(seed)
    kv = [worker_history(rng, w, n, dp_size=1 + (i == 2)) for i, w in enumerate(WORKERS)]
    router = [router_history(rng, r, WORKERS, n) for r in ("ra", "rb")]
    order = random.Random(order_seed)
    kv_msgs, router_msgs = interleave(order, kv), interleave(order, router)
    state = RouterState(StateConfig(request_max_age=1e9))
    for seq, batch in enumerate(kv_msgs, 1):
        state.apply(KV, seq, batch)
    for seq, batch in enumerate(router_msgs, 1):
        state.apply(ROUTER, seq, batch)
    return state, kv_msgs, router_msgs


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32), st.integers(0, 2**32))
def test_encode_decode_round_trip_keeps_digests_and_answers(seed: int, order_seed: int) -> None:
    state, _, _ = build(seed, order_seed)
    copy = RouterState.decode(state.encode(), state.config)
    assert copy.digests() == state.digests()
    assert copy.positions == state.positions
    rng = random.Random(seed)
    for _ in range(5):
        query = [rng.randrange(12) for _ in range(rng.randint(1, 6))]
        assert copy.index.find_matches(query) == state.index.find_matches(query)
    # And the copy keeps evolving like the original.
    late = [ev.RequestFinished(r, "ok", 1, 9e9) for r in ("ra-0", "rb-0", "ra-1")]
    state.apply(ROUTER, 10_000, late)
    copy.apply(ROUTER, 10_000, late)
    assert copy.digests() == state.digests()


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32), st.integers(0, 2**32), st.integers(0, 2**32))
def test_interleaving_of_workers_does_not_change_digest(seed: int, o1: int, o2: int) -> None:
    a, _, _ = build(seed, o1)
    b, _, _ = build(seed, o2)
    assert a.digests() == b.digests()


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**32))
def test_applying_any_event_again_changes_nothing(seed: int) -> None:
    state, kv_msgs, router_msgs = build(seed, seed + 1)
    before = state.digests()
    seq = {KV: len(kv_msgs), ROUTER: len(router_msgs)}
    # Same message at its old sequence: ignored by position.
    assert not state.apply(KV, 1, kv_msgs[0])
    # Each event re-delivered as a fresh message (a publisher retry that escaped dedup):
    # event_ids and request ids make it a no-op.
    rng = random.Random(seed)
    for stream, msgs in ((KV, kv_msgs), (ROUTER, router_msgs)):
        for batch in rng.sample(msgs, min(10, len(msgs))):
            for e in batch:
                if isinstance(e, ev.WorkerRegistered | ev.ReplicaLost):
                    continue  # re-registration means a restarted engine; not a duplicate
                if isinstance(e, ev.PrefillCompleted | ev.RequestFinished):
                    continue  # see test below: finishing a request is idempotent
                seq[stream] += 1
                state.apply(stream, seq[stream], [e])
    assert state.digests() == before


def test_finish_and_prefill_are_idempotent() -> None:
    s = RouterState()
    s.apply(KV, 1, [ev.WorkerRegistered("w", "u", "m", 16, 100, 8192, 1.0)])
    s.apply(ROUTER, 1, [ev.RequestRouted("q", "r", "w", 0, 64, [1, 2, 3, 4], 0, 8, 1, 2.0)])
    assert s.load.active_prefill_tokens(("w", 0)) == 64
    s.apply(ROUTER, 2, [ev.PrefillCompleted("q", 3.0)])
    once = s.digests()
    s.apply(ROUTER, 3, [ev.PrefillCompleted("q", 3.0)])
    assert s.digests() == once
    s.apply(ROUTER, 4, [ev.RequestFinished("q", "ok", 3, 4.0)])
    done = s.digests()
    s.apply(ROUTER, 5, [ev.RequestFinished("q", "ok", 3, 4.0)])
    assert s.digests() == done and len(s.load) == 0


def test_duplicate_message_is_ignored_and_counted() -> None:
    s = RouterState()
    batch = [ev.WorkerRegistered("w", "u", "m", 16, 100, 8192, 1.0)]
    assert s.apply(KV, 5, batch)
    assert not s.apply(KV, 5, batch)
    assert not s.apply(KV, 4, batch)
    assert s.positions[KV] == 5
    assert s.stats.counts[(KV, "message", "duplicate")] == 2


def test_malformed_message_advances_position_only() -> None:
    s = RouterState()
    before = s.digests()
    assert s.apply(CONTROL, 1, [])
    assert s.positions[CONTROL] == 1 and s.digests() == before


def test_event_id_gap_marks_worker_out_of_sync_until_reannounced() -> None:
    s = RouterState()
    s.apply(KV, 1, [ev.WorkerRegistered("w", "u", "m", 16, 100, 8192, 1.0),
                    ev.BlocksStored("w", 1, 0, None, [(10, 1)], 1.0)])
    s.apply(KV, 2, [ev.BlocksStored("w", 3, 0, 10, [(11, 2)], 2.0)])  # event 2 lost
    assert "w" in s.out_of_sync
    s.apply(KV, 3, [ev.AllBlocksCleared("w", 4, 0, 3.0),
                    ev.BlocksStored("w", 5, 0, None, [(10, 1), (11, 2)], 3.0)])
    assert "w" not in s.out_of_sync
    assert s.index.find_matches([1, _chain(1, 2)]).scores == {("w", 0): 2}


def test_requests_expire_in_event_time() -> None:
    s = RouterState(StateConfig(request_max_age=100.0))
    s.apply(KV, 1, [ev.WorkerRegistered("w", "u", "m", 16, 100, 8192, 1.0)])
    s.apply(ROUTER, 1, [ev.RequestRouted("q", "r", "w", 0, 32, [1, 2], 0, 8, 1, 10.0)])
    s.apply(ROUTER, 2, [ev.RequestRouted("p", "r", "w", 0, 32, [3], 0, 8, 1, 105.0)])
    assert len(s.load) == 2
    s.apply(CONTROL, 1, [ev.SnapshotThresholdSet(5, 111.0)])  # event time moves past q's bound
    assert s.load.request("q") is None and s.load.request("p") is not None


def test_replica_lost_frees_only_its_requests() -> None:
    s = RouterState()
    s.apply(KV, 1, [ev.WorkerRegistered("w", "u", "m", 16, 100, 8192, 1.0)])
    s.apply(ROUTER, 1, [ev.RequestRouted("a1", "ra", "w", 0, 32, [1], 0, 8, 1, 2.0),
                        ev.RequestRouted("b1", "rb", "w", 0, 32, [2], 0, 8, 1, 2.0)])
    s.apply(ROUTER, 2, [ev.ReplicaLost("ra", 3.0)])
    assert s.load.request("a1") is None and s.load.request("b1") is not None


def test_state_reset_clears_index_and_load_and_bumps_epoch() -> None:
    s = RouterState()
    s.apply(KV, 1, [ev.WorkerRegistered("w", "u", "m", 16, 100, 8192, 1.0),
                    ev.BlocksStored("w", 1, 0, None, [(10, 1)], 1.0)])
    s.apply(ROUTER, 1, [ev.RequestRouted("a", "ra", "w", 0, 32, [1], 0, 8, 1, 2.0)])
    s.apply(CONTROL, 1, [ev.StateReset(1, "test", 3.0)])
    assert s.epoch == 1 and len(s.load) == 0 and s.index.total_blocks == 0
    assert "w" in s.workers  # engines stay registered; they re-announce their caches
    s.apply(CONTROL, 2, [ev.StateReset(1, "stale", 4.0)])
    assert s.stats.counts[(CONTROL, "StateReset", "stale_epoch")] == 1


def _chain(parent: int, local: int) -> int:
    from eventlog.hashing import chain_hash

    return chain_hash(parent, local)


def test_state_reset_cuts_other_streams_at_its_positions() -> None:
    """Whatever a replica applied of the KV stream before the reset, it ends at the cut."""
    ahead, behind = RouterState(), RouterState()
    reg = [ev.WorkerRegistered("w", "u", "m", 16, 100, 8192, 1.0)]
    ahead.apply(KV, 1, reg)
    ahead.apply(KV, 2, [ev.BlocksStored("w", 1, 0, None, [(10, 1)], 2.0)])
    behind.apply(KV, 1, reg)
    reset = [ev.StateReset(1, "test", 3.0, {KV: 1, ROUTER: 0})]
    for s in (ahead, behind):
        s.apply(CONTROL, 1, reset)
        assert s.positions[KV] == 1
        s.apply(KV, 2, [ev.BlocksStored("w", 1, 0, None, [(10, 1)], 2.0)])  # re-read after cut
    assert ahead.digests() == behind.digests()


def test_a_prefill_folded_into_the_finish_reaches_the_same_state() -> None:
    def routed(rid: str) -> ev.RequestRouted:
        return ev.RequestRouted(request_id=rid, replica_id="ra", worker_id="w0", dp_rank=0,
                                isl_tokens=64, block_seq_hashes=[1, 2, 3, 4], overlap_blocks=1,
                                expected_osl=8, priority=0, ts=10.0)

    separate, folded = RouterState(), RouterState()
    for state in (separate, folded):
        state.apply(ROUTER, 1, [routed("a"), routed("b")])
    separate.apply(ROUTER, 2, [ev.PrefillCompleted("a", 11.0),
                               ev.RequestFinished("a", "ok", 1, 12.0)])
    folded.apply(ROUTER, 2, [ev.RequestFinished("a", "ok", 1, 12.0, prefill_ts=11.0)])
    assert folded.digests() == separate.digests()
    assert folded.load.active_prefill_tokens(("w0", 0)) == 48  # only b's prefill is left
    assert "a" not in folded.load
