"""The compact index (index.py) against the reference form (index_reference.py): over random event
sequences both give the same find_matches, tree sizes, digests and counters, and every snapshot
either form writes restores into the compact form with the same answers."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eventlog.hashing import sequence_hashes
from replicas.core import index_reference
from replicas.core.index import PrefixIndex
from replicas.core.index_common import WorkerKey

Index = PrefixIndex | index_reference.PrefixIndex

# every test twice: the index's Python code, then its compiled kernel (conftest.py)
pytestmark = pytest.mark.usefixtures("each_index_kernel")


class ArraysAlways(PrefixIndex):
    """The compact form with every event applied as arrays (the default applies events of a
    few blocks one block at a time): both paths must give the reference's answers."""

    small_event = 0


COMPACT_FORMS = [PrefixIndex, ArraysAlways]

# Small universes, so that events collide: re-announced ids, ids reused for other content, one
# content under two ids, the same id twice in one event, removals of unknown ids.
IDS = st.integers(min_value=0, max_value=10).map(lambda h: h * 100 + 7)
TOKENS = st.integers(min_value=1, max_value=6)
BIG = st.integers(min_value=2**63, max_value=2**64 - 1)  # hashes at the top of the u64 range


def workers(count: int) -> list[WorkerKey]:
    return [(f"w{i % max(count // 2, 1)}", i // max(count // 2, 1)) for i in range(count)]


def op_strategy(keys: list[WorkerKey]) -> st.SearchStrategy[tuple[object, ...]]:
    worker = st.sampled_from(keys)
    store = st.tuples(st.just("store"), worker, st.one_of(st.none(), st.none(), IDS),
                      st.lists(st.tuples(st.one_of(IDS, IDS, BIG), TOKENS), min_size=1,
                               max_size=6))
    remove = st.tuples(st.just("remove"), worker, st.lists(IDS, max_size=5), st.none())
    clear = st.tuples(st.just("clear"), worker, st.none(), st.none())
    retire = st.tuples(st.just("retire"), worker, st.none(), st.none())
    return st.one_of(store, store, store, remove, remove, clear, retire)


def apply(index: Index, op: tuple[object, ...]) -> object:
    kind, worker, a, b = op
    if kind == "store":
        return index.store(worker, a, b)  # type: ignore[arg-type]
    if kind == "remove":
        return index.remove(worker, a)  # type: ignore[arg-type]
    if kind == "clear":
        return index.clear(worker)  # type: ignore[arg-type]
    return index.remove_worker(worker[0])  # type: ignore[index]


QUERIES = [sequence_hashes(list(q)) for q in
           [(1,), (1, 2), (1, 2, 3), (2, 3, 4), (1, 1, 1, 1), (3, 3), (6, 5, 4, 3, 2, 1),
            (1, 2, 3, 4, 5, 6)]]


def answers(index: Index, keys: list[WorkerKey], queries: list[list[int]]) -> tuple[object, ...]:
    return (index.digest, index.total_blocks, index.node_count, sorted(index.counters.items()),
            [index.find_matches(q) for q in queries], [index.tree_size(k) for k in keys],
            # the columns answer too: the same scores once turned back into dicts
            [index.match_columns(q).to_scores() for q in queries])


def through_msgpack(index: Index) -> object:
    return msgspec.msgpack.decode(msgspec.msgpack.encode(index.to_plain()))


def check_agree(ops: list[tuple[object, ...]], keys: list[WorkerKey],
                extra: list[list[int]]) -> None:
    for form in COMPACT_FORMS:
        check_form_agrees(form, ops, keys, extra)


def check_form_agrees(form: type[PrefixIndex], ops: list[tuple[object, ...]],
                      keys: list[WorkerKey], extra: list[list[int]]) -> None:
    compact, reference = form(), index_reference.PrefixIndex()
    queries = [*QUERIES, *(sequence_hashes(q) for q in extra if q)]
    for op in ops:
        assert apply(compact, op) == apply(reference, op), op
    expected = answers(reference, keys, queries)
    assert answers(compact, keys, queries) == expected
    # snapshots: the reference's (v2), and the compact form's own (v3), both restore the same
    for plain in (through_msgpack(reference), through_msgpack(compact)):
        restored = form.from_plain(plain)
        assert answers(restored, keys, queries) == expected
        # and the restored index keeps applying events like the reference does
        again = index_reference.PrefixIndex.from_plain(through_msgpack(reference))
        for op in ops[-3:]:
            assert apply(restored, op) == apply(again, op)
        assert answers(restored, keys, queries) == answers(again, keys, queries)


KEYS = workers(4)


@settings(max_examples=250, deadline=None)
@given(st.lists(op_strategy(KEYS), max_size=40), st.lists(st.lists(TOKENS, max_size=6),
                                                          max_size=3))
def test_compact_and_reference_agree(ops: list[tuple[object, ...]],
                                     extra: list[list[int]]) -> None:
    check_agree(ops, KEYS, extra)


MANY = workers(140)  # three bitmap words: slots past 64 and 128


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(MANY), st.integers(1, 5), st.booleans()),
                min_size=150, max_size=300))
def test_agree_with_more_workers_than_a_word(events: list[tuple[WorkerKey, int, bool]]) -> None:
    """Many workers sharing one prefix (nodes held by many, held by one again, bitmaps reused)."""
    ops: list[tuple[object, ...]] = []
    chain = [(1, 1), (2, 2), (3, 3), (4, 4), (5, 5)]
    for worker, depth, drop in events:
        if drop:
            ops.append(("remove", worker, [depth], None))
        else:
            ops.append(("store", worker, None, chain[:depth]))
    check_agree(ops, MANY, [[1, 2, 3, 4, 5]])


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(KEYS), st.integers(1, 6), st.integers(0, 3),
                          st.sampled_from(["route", "route", "route", "clear", "retire"])),
                max_size=30))
def test_approximate_mode_agrees(decisions: list[tuple[WorkerKey, int, int, str]]) -> None:
    compact = ArraysAlways(approximate=True, ttl_secs=10.0, max_tree_size=12,
                          prune_target_ratio=0.5)
    reference = index_reference.PrefixIndex(approximate=True, ttl_secs=10.0, max_tree_size=12,
                                            prune_target_ratio=0.5)
    chains = [sequence_hashes([1, 2, 3, 4, 5, 6]), sequence_hashes([1, 2, 9, 9, 9, 9])]
    now = 0.0
    for worker, length, step, kind in decisions:
        now += step * 2.5
        for index in (compact, reference):
            if kind == "route":
                index.store_routed(worker, chains[length % 2][:length], now)
            elif kind == "clear":
                index.clear(worker)
            else:
                index.remove_worker(worker[0])
        assert answers(compact, KEYS, chains) == answers(reference, KEYS, chains)
    restored = PrefixIndex.from_plain(through_msgpack(reference))
    again = PrefixIndex.from_plain(through_msgpack(compact))
    for index in (restored, again, reference):
        index.expire(now + 5.0)
    assert answers(restored, KEYS, chains) == answers(reference, KEYS, chains)
    assert answers(again, KEYS, chains) == answers(reference, KEYS, chains)


def test_snapshot_bytes_a_pair_owners_and_others() -> None:
    """v6: an id (8 bytes) and an own bit a row; a row owning its node adds its sequence hash
    (8), any other row its node's owner as an ordinal (4); and a bit per block-table cell."""
    index = PrefixIndex()
    for w in range(4):  # the same chain on four workers: 1000 nodes, each held by four rows
        index.store((f"w{w}", 0), None, [(w * 10_000 + i, i + 1) for i in range(1000)])
    index.store(("w4", 0), None, [(50_000 + i, 7_000 + i) for i in range(1001)])  # its own
    columns = index.to_plain()["columns"]
    rows, owners = 5001, 2001
    assert len(columns["ids"]) == 8 * rows  # type: ignore[index]
    assert len(columns["own"]) == (rows + 7) // 8  # type: ignore[index]
    assert len(columns["seqs"]) == 8 * owners  # type: ignore[index]
    assert "codes" not in columns  # type: ignore[operator]
    assert len(columns["refs"]) == 4 * (rows - owners)  # type: ignore[index]
    refs = np.frombuffer(columns["refs"], dtype="<u4")  # type: ignore[index]
    # the first worker's rows own the chain (ordinals 0-999); each other worker names each once
    assert [sorted(refs[k * 1000:(k + 1) * 1000].tolist()) for k in range(3)] == [
        list(range(1000))] * 3
    cells = sum(t.keys.size for t in index._blocks)
    assert len(columns["occ"]) == cells // 8  # type: ignore[index]


def test_hand_picked_sequences_agree() -> None:
    """Cases random sequences reach only now and then, each in small and in large events."""
    a, b = KEYS[0], KEYS[1]
    long_chain = [(1000 + i, 1 + i % 5) for i in range(40)]
    cases: list[list[tuple[object, ...]]] = [
        # one content under two ids, then one id removed (the node stays held)
        [("store", a, None, [(7, 1)]), ("store", a, None, [(107, 1)]), ("remove", a, [7], None)],
        [("store", a, None, long_chain), ("store", a, None, [(5, 1), (6, 2)]),
         ("remove", a, [1000, 1001, 1002, 5], None), ("remove", a, [6, 1003], None)],
        # an id reused for other content inside a long event, and the same id twice in one
        [("store", a, None, long_chain), ("store", a, None, [(1000, 9), *long_chain[1:30]]),
         ("store", b, None, [(3, 1), (3, 2), (4, 3)]), ("remove", b, [3, 3, 4], None)],
        # two workers share, one leaves: the bitmap goes back to one holder
        [("store", a, None, long_chain), ("store", b, None, long_chain),
         ("retire", b, None, None), ("store", b, None, long_chain[:3]),
         ("remove", a, [1000 + i for i in range(40)], None)],
    ]
    for ops in cases:
        check_agree(ops, KEYS, [[1, 2, 3, 4, 5, 1, 2, 3]])


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_match_columns_follow_every_event(data: st.DataObject) -> None:
    """Queried after each event (its cached rows and sizes must follow every change, including a
    slot given to another worker), ``match_columns`` gives ``find_matches``' answer."""
    keys = workers(data.draw(st.integers(min_value=1, max_value=8)))
    ops = data.draw(st.lists(op_strategy(keys), max_size=25))
    # queried after some events only: a slot freed and given to another worker in between
    ask = data.draw(st.lists(st.booleans(), min_size=len(ops), max_size=len(ops)))
    for form in (index_reference.PrefixIndex, PrefixIndex):
        index = form()
        for op, query in zip(ops, ask, strict=True):
            apply(index, op)
            for q in QUERIES[:4] if query else ():
                assert index.match_columns(q).to_scores() == index.find_matches(q)


def test_match_columns_after_a_slot_changes_hands_between_queries() -> None:
    q = QUERIES[2]
    for form in (index_reference.PrefixIndex, PrefixIndex):
        index = form()
        index.store(("a", 0), None, [(1, 1), (2, 2)])
        index.store(("b", 0), None, [(3, 1)])
        assert index.match_columns(q).to_scores() == index.find_matches(q)
        index.remove_worker("a")  # frees a's slot ...
        index.store(("c", 0), None, [(4, 1), (5, 2), (6, 3)])  # ... and c takes it
        columns = index.match_columns(q)
        assert columns.to_scores() == index.find_matches(q)
        assert sorted(columns.workers) == [("b", 0), ("c", 0)]


def test_match_columns_follow_approximate_mode_expiry() -> None:
    q = QUERIES[2]
    for form in (index_reference.PrefixIndex, PrefixIndex):
        index = form(approximate=True, ttl_secs=10.0)
        index.store_routed(("a", 0), q, now=1.0)
        assert index.match_columns(q).to_scores() == index.find_matches(q)
        index.store_routed(("b", 0), q[:2], now=5.0)
        assert dict(zip(index.match_columns(q).workers,
                        index.match_columns(q).overlap_blocks.tolist(), strict=True)) == {
            ("a", 0): 3, ("b", 0): 2}
        index.expire(12.0)  # a's entries expire; b's stay
        columns = index.match_columns(q)
        assert columns.to_scores() == index.find_matches(q)
        assert columns.workers == [("b", 0)]
