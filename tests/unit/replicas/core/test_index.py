"""Prefix index: Dynamo's radix-tree scenarios re-expressed, approximate mode, and properties."""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from eventlog.hashing import sequence_hashes
from replicas.core.index import OverlapScores, PrefixIndex, WorkerKey

W0: WorkerKey = ("w0", 0)
W1: WorkerKey = ("w1", 0)


def blocks(*tokens_hashes: int) -> list[tuple[int, int]]:
    """Engine block ids are tokens_hash * 100 (as in Dynamo's tests), so they differ from both."""
    return [(t * 100, t) for t in tokens_hashes]


def query(*tokens_hashes: int) -> list[int]:
    return sequence_hashes(list(tokens_hashes))


def scores(index: PrefixIndex, *tokens_hashes: int) -> dict[WorkerKey, int]:
    return index.find_matches(query(*tokens_hashes)).scores


def roundtrip(index: PrefixIndex) -> PrefixIndex:
    plain = msgspec.msgpack.decode(msgspec.msgpack.encode(index.to_plain()))
    return PrefixIndex.from_plain(plain)


def gaps(index: PrefixIndex) -> tuple[object, ...]:
    """What the index keeps besides its answers: digest, sizes, node count, holder bitmaps."""
    return (index.digest, index.total_blocks, index.node_count,
            sorted(index._tree_sizes().items()), sorted(index._dups[s].items()
                                                        for s in index._slots.values()),
            len(index._holders.rows_free) == index._holders.rows_used - _bitmap_nodes(index))


def _bitmap_nodes(index: PrefixIndex) -> int:
    _, holders = index._holders.nodes.items()
    return int((holders < 0).sum())


def assert_gap_bookkeeping_consistent(index: PrefixIndex) -> None:
    # from_plain rebuilds everything from the block columns; the incremental form must agree
    assert gaps(roundtrip(index)) == gaps(index)


def test_two_workers_share_prefix_and_roundtrip() -> None:
    index = PrefixIndex()
    assert index.store(W0, None, blocks(1, 2, 3)) == "ok"
    assert index.store(W1, None, blocks(1, 2, 4)) == "ok"
    result = index.find_matches(query(1, 2, 3))
    assert result == OverlapScores({W0: 3, W1: 2}, {W0: 3, W1: 3})
    assert scores(index, 1, 2, 4) == {W0: 2, W1: 3}
    assert scores(index, 9) == {}
    restored = roundtrip(index)
    assert restored.digest == index.digest
    for q in [(1, 2, 3), (1, 2, 4), (1,), (2,), (1, 2, 3, 4)]:
        assert restored.find_matches(query(*q)) == index.find_matches(query(*q))
    assert restored.counters == index.counters
    assert restored.total_blocks == index.total_blocks == 6


def test_mid_chain_removal_stops_matches_and_restore_resumes() -> None:
    index = PrefixIndex()
    index.store(W0, None, blocks(1, 2, 3, 4, 5))
    assert scores(index, 1, 2, 3, 4, 5) == {W0: 5}
    assert index.remove(W0, [300]) == 0
    assert scores(index, 1, 2, 3, 4, 5) == {W0: 2}
    assert index.tree_size(W0) == 4
    assert_gap_bookkeeping_consistent(index)  # block 4 is held without its parent
    assert index.store(W0, 200, blocks(3)) == "ok"  # block 3 again, under block 2
    assert_gap_bookkeeping_consistent(index)
    assert scores(index, 1, 2, 3) == {W0: 3}
    # flat membership: the worker never reported 4 and 5 removed, so they match again
    assert scores(index, 1, 2, 3, 4, 5) == {W0: 5}


def test_mid_chain_removal_only_affects_that_worker() -> None:
    index = PrefixIndex()
    index.store(W0, None, blocks(1, 2, 3, 4, 5))
    index.store(W1, None, blocks(1, 2, 3, 4, 5))
    index.remove(W1, [300])
    assert scores(index, 1, 2, 3, 4, 5) == {W0: 5, W1: 2}


def test_clear_one_dp_rank_keeps_the_others() -> None:
    index = PrefixIndex()
    for rank in range(3):
        index.store(("w", rank), None, blocks(1, 2, 3))
    assert scores(index, 1, 2, 3) == {("w", 0): 3, ("w", 1): 3, ("w", 2): 3}
    digest_before = index.digest
    index.clear(("w", 1))
    assert scores(index, 1, 2, 3) == {("w", 0): 3, ("w", 2): 3}
    assert index.tree_size(("w", 1)) == 0
    assert ("w", 1) not in index.find_matches(query(1)).tree_sizes
    assert index.digest != digest_before
    assert index.counters[("cleared", "ok")] == 1


def test_dp_ranks_score_separately() -> None:
    index = PrefixIndex()
    index.store(("w", 0), None, blocks(1, 2, 3))
    index.store(("w", 1), None, blocks(1, 2))
    index.store(("w", 2), None, blocks(1))
    assert scores(index, 1, 2, 3) == {("w", 0): 3, ("w", 1): 2, ("w", 2): 1}


def test_store_continues_under_a_parent() -> None:
    index = PrefixIndex()
    index.store(W0, None, blocks(1, 2, 3))
    assert index.store(W0, 300, blocks(4, 5)) == "ok"
    assert scores(index, 1, 2, 3, 4, 5) == {W0: 5}
    assert index.tree_size(W0) == 5


def test_unknown_parent_is_rejected_and_counted() -> None:
    index = PrefixIndex()
    assert index.store(W0, 12345, blocks(1, 2, 3)) == "parent_block_not_found"
    assert index.total_blocks == 0
    assert scores(index, 1, 2, 3) == {}
    index.store(W0, None, blocks(1))
    assert index.store(W0, 999, blocks(2)) == "parent_block_not_found"
    assert index.store(W1, 100, blocks(2)) == "parent_block_not_found"  # parent is per worker
    assert index.counters[("stored", "parent_block_not_found")] == 3
    assert index.total_blocks == 1


def test_unknown_removals_are_counted_and_the_rest_applies() -> None:
    index = PrefixIndex()
    index.store(W0, None, blocks(1, 2, 3))
    assert index.remove(W0, [300, 777, 888]) == 2
    assert index.counters[("removed", "block_not_found")] == 2
    assert scores(index, 1, 2, 3) == {W0: 2}
    assert index.remove(("nobody", 0), [100]) == 1
    assert index.counters[("removed", "block_not_found")] == 3


def test_remove_unknown_worker_changes_nothing() -> None:
    index = PrefixIndex()
    index.store(W0, None, blocks(1, 2, 3))
    before = (index.digest, index.to_plain())
    index.remove_worker("ghost")
    assert (index.digest, index.to_plain()) == before


def test_remove_worker_drops_every_rank() -> None:
    index = PrefixIndex()
    index.store(("w", 0), None, blocks(1, 2))
    index.store(("w", 1), None, blocks(1, 2))
    index.store(W1, None, blocks(1))
    index.remove_worker("w")
    assert scores(index, 1, 2) == {W1: 1}
    assert index.total_blocks == 1


def test_duplicate_block_ids_for_one_node_are_refcounted() -> None:
    index = PrefixIndex()
    index.store(W0, None, [(10, 1)])
    index.store(W0, None, [(11, 1)])  # same content under another engine id
    index.store(W0, None, [(10, 1)])  # re-announcement: no change
    assert index.tree_size(W0) == 2
    index.remove(W0, [10])
    assert scores(index, 1) == {W0: 1}
    index.remove(W0, [11])
    assert scores(index, 1) == {}


def test_digest_ignores_event_order_between_workers() -> None:
    a, b = PrefixIndex(), PrefixIndex()
    a.store(W0, None, blocks(1, 2))
    a.store(W1, None, blocks(1, 3))
    b.store(W1, None, blocks(1, 3))
    b.store(W0, None, blocks(1, 2))
    assert a.digest == b.digest
    b.remove(W0, [200])
    assert a.digest != b.digest


# --- approximate mode ----------------------------------------------------------------------


def test_approximate_prune_keeps_the_newest() -> None:
    index = PrefixIndex(approximate=True, max_tree_size=5, prune_target_ratio=0.4)
    for i in range(6):
        index.store_routed(W0, [1000 + i], now=float(i))
    assert index.total_blocks == 2
    assert scores(index, 1004) == {W0: 1}
    remaining = [i for i in range(6) if index.find_matches([1000 + i]).scores]
    assert remaining == [4, 5]
    assert_gap_bookkeeping_consistent(index)
    assert index.counters[("pruned", "ok")] == 4


def test_approximate_prune_drops_deepest_first_on_ties() -> None:
    index = PrefixIndex(approximate=True, max_tree_size=2, prune_target_ratio=0.5)
    chain = query(1, 2, 3)
    index.store_routed(W0, chain, now=0.0)
    assert index.total_blocks == 1
    assert index.find_matches(chain).scores == {W0: 1}
    assert_gap_bookkeeping_consistent(index)


def test_approximate_ttl_expires_in_event_time() -> None:
    index = PrefixIndex(approximate=True, ttl_secs=120.0)
    chain = query(1, 2, 3)
    index.store_routed(W0, chain, now=0.0)
    index.store_routed(W1, chain[:1], now=100.0)
    assert index.expire(119.0) == 0
    assert index.find_matches(chain).scores == {W0: 3, W1: 1}
    assert index.expire(121.0) == 3
    assert index.find_matches(chain).scores == {W1: 1}
    assert_gap_bookkeeping_consistent(index)
    restored = roundtrip(index)
    assert restored.digest == index.digest
    index.store_routed(W1, chain[:1], now=200.0)  # a later decision refreshes the entry
    assert index.expire(221.0) == 0
    assert index.find_matches(chain).scores == {W1: 1}
    assert restored.expire(221.0) == 1  # the restored copy kept the old expiry
    assert restored.find_matches(chain).scores == {}


# --- properties ----------------------------------------------------------------------------

WORKERS: list[WorkerKey] = [("a", 0), ("a", 1), ("b", 0)]
HASHES = st.integers(min_value=0, max_value=12)

# tokens_hash 0 is left out: chain_hash(0, t) == t, so a root block with tokens_hash 0 would make
# "child of that block" and "root" the same sequence hash, a collision real 64-bit hashes never hit
TOKENS = st.integers(min_value=1, max_value=12)
store_op = st.tuples(
    st.just("store"),
    st.sampled_from(WORKERS),
    st.one_of(st.none(), HASHES.map(lambda h: h * 100)),
    st.lists(st.tuples(HASHES.map(lambda h: h * 100), TOKENS), min_size=1, max_size=4),
)
remove_op = st.tuples(
    st.just("remove"),
    st.sampled_from(WORKERS),
    st.lists(HASHES.map(lambda h: h * 100), max_size=3),
    st.none(),
)
clear_op = st.tuples(st.just("clear"), st.sampled_from(WORKERS), st.none(), st.none())
ops = st.lists(st.one_of(store_op, store_op, remove_op, clear_op), max_size=30)


def apply(index: PrefixIndex, op: tuple[object, ...]) -> None:
    kind, worker, a, b = op
    if kind == "store":
        index.store(worker, a, b)  # type: ignore[arg-type]
    elif kind == "remove":
        index.remove(worker, a)  # type: ignore[arg-type]
    else:
        index.clear(worker)  # type: ignore[arg-type]


def model_scores(model: dict[WorkerKey, dict[int, int]], q: list[int]) -> dict[WorkerKey, int]:
    out = {}
    for worker, held in model.items():
        members = set(held.values())
        n = 0
        while n < len(q) and q[n] in members:
            n += 1
        if n:
            out[worker] = n
    return out


def apply_model(model: dict[WorkerKey, dict[int, int]], op: tuple[object, ...]) -> None:
    """The simplest possible index: per worker, engine id -> sequence hash."""
    kind, worker, a, b = op
    held = model.setdefault(worker, {})  # type: ignore[arg-type]
    if kind == "store":
        if a is None:
            parent = 0
        elif a in held:
            parent = held[a]
        else:
            return
        for block_hash, tokens_hash in b:  # type: ignore[attr-defined]
            parent = sequence_hashes([tokens_hash], parent)[0]
            held[block_hash] = parent
    elif kind == "remove":
        for block_hash in a:  # type: ignore[attr-defined]
            held.pop(block_hash, None)
    else:
        held.clear()


QUERIES = [query(*q) for q in [(1,), (1, 2), (1, 2, 3), (2, 3, 4), (1, 1, 1, 1), (5, 6, 7, 8)]]


@settings(max_examples=150, deadline=None)
@given(ops, st.lists(TOKENS, min_size=1, max_size=5))
def test_matches_agree_with_a_naive_model_and_survive_roundtrip(
    sequence: list[tuple[object, ...]], extra_query: list[int]
) -> None:
    index = PrefixIndex()
    model: dict[WorkerKey, dict[int, int]] = {}
    for op in sequence:
        apply(index, op)
        apply_model(model, op)
    queries = [*QUERIES, query(*extra_query)]
    for q in queries:
        assert index.find_matches(q).scores == model_scores(model, q)
    assert index.total_blocks == sum(len(h) for h in model.values())
    restored = roundtrip(index)
    assert restored.digest == index.digest
    assert restored.total_blocks == index.total_blocks
    for q in queries:
        assert restored.find_matches(q) == index.find_matches(q)
    assert gaps(restored) == gaps(index)


@settings(max_examples=100, deadline=None)
@given(ops, st.randoms(use_true_random=False))
def test_interleaving_of_workers_does_not_change_digest(
    sequence: list[tuple[object, ...]], rnd: object
) -> None:
    per_worker: dict[object, list[tuple[object, ...]]] = {}
    for op in sequence:
        per_worker.setdefault(op[1], []).append(op)
    # another interleaving that keeps each worker's own order
    lanes = [list(reversed(v)) for v in per_worker.values()]
    shuffled: list[tuple[object, ...]] = []
    while lanes:
        lane = rnd.choice(lanes)  # type: ignore[attr-defined]
        shuffled.append(lane.pop())
        if not lane:
            lanes.remove(lane)
    a, b = PrefixIndex(), PrefixIndex()
    for op in sequence:
        apply(a, op)
    for op in shuffled:
        apply(b, op)
    assert a.digest == b.digest
    for q in QUERIES:
        assert a.find_matches(q) == b.find_matches(q)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(WORKERS[:2]), st.integers(1, 6), st.booleans()),
                max_size=25))
def test_approximate_mode_agrees_with_replaying_its_live_entries(
    decisions: list[tuple[WorkerKey, int, bool]],
) -> None:
    """TTL and pruning in event time: the index matches a rebuild from its surviving entries."""
    index = PrefixIndex(approximate=True, ttl_secs=10.0, max_tree_size=8, prune_target_ratio=0.5)
    chain = query(1, 2, 3, 4, 5, 6)
    now = 0.0
    for worker, length, later in decisions:
        now += 4.0 if later else 0.5
        index.store_routed(worker, chain[:length], now)
        assert index.total_blocks <= 8
    assert_gap_bookkeeping_consistent(index)
    naive: dict[WorkerKey, set[int]] = {}
    for (slot, seq), _ in index._expiry.items():
        naive.setdefault(index._keys[slot], set()).add(seq)  # type: ignore[arg-type]
    expected = {}
    for worker, held in naive.items():
        n = 0
        while n < len(chain) and chain[n] in held:
            n += 1
        if n:
            expected[worker] = n
    assert index.find_matches(chain).scores == expected


def test_degenerate_self_referencing_chain_does_not_corrupt_the_index() -> None:
    # tokens_hash 0 under a root with tokens_hash 0 has sequence hash 0 again (its own parent)
    index = PrefixIndex()
    index.store(W0, None, [(0, 0), (100, 0), (0, 1), (100, 0)])
    index.remove(W0, [0, 100])
    assert index.total_blocks == 0
    assert index.find_matches(query(0, 1)).scores == {}
    assert roundtrip(index).digest == index.digest


def test_reannounced_blocks_change_nothing_whatever_their_hash_size() -> None:
    # store() tells a new block id by object identity; CPython shares the objects of small
    # ints, so a root with a tiny sequence hash is the case that must not look new again
    for first in (0, 1, 7, 256, 257, 2**63 + 5):
        index = PrefixIndex()
        chain = [(11, first), (12, 3), (13, 4)]
        assert index.store(W0, None, chain) == "ok"
        before = (index.digest, index.total_blocks, gaps(index), index.find_matches(
            sequence_hashes([first, 3, 4])))
        assert index.store(W0, None, chain) == "ok"
        assert index.store(W0, None, chain[:1]) == "ok"
        assert index.store(W0, 11, chain[1:]) == "ok"
        after = (index.digest, index.total_blocks, gaps(index), index.find_matches(
            sequence_hashes([first, 3, 4])))
        assert after == before
        assert index.remove(W0, [11, 12, 13]) == 0
        assert index.total_blocks == 0 and index.digest == PrefixIndex().digest
