"""A run of KV events applied at once (index_run.py) against the same events one by one: the same
block maps, holders, repeated nodes, digest sums, counters, statuses and answers, over random
sequences with colliding ids and contents (re-announced ids, ids reused for other content, one
content under two ids, unknown parents and ids, the same id twice in one event) cut into runs at
random, clears and worker removals between runs."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replicas.core import index_reference, index_run
from replicas.core.index import PrefixIndex
from replicas.core.index_common import WorkerKey
from replicas.core.index_run import REMOVE, STORE, KvOp
from tests.unit.replicas.core.test_index_compact import (
    KEYS,
    MANY,
    QUERIES,
    answers,
    op_strategy,
    through_msgpack,
)

Index = PrefixIndex | index_reference.PrefixIndex

# every test twice: the index's Python code, then its compiled kernel (conftest.py)
pytestmark = pytest.mark.usefixtures("each_index_kernel")


@contextmanager
def few_keys(n: int) -> Iterator[None]:
    """Run with another threshold between the one-key and the array methods."""
    saved = index_run._FEW_KEYS
    index_run._FEW_KEYS = n
    try:
        yield
    finally:
        index_run._FEW_KEYS = saved


def as_kv_op(op: tuple[object, ...]) -> KvOp | None:
    kind, worker, a, b = op
    if kind == "store":
        return (STORE, worker, a, b)  # type: ignore[return-value]
    if kind == "remove":
        return (REMOVE, worker, a, None)  # type: ignore[return-value]
    return None


def apply_in_runs(index: Index, ops: list[tuple[object, ...]], cuts: list[bool]) -> list[object]:
    """Stores and removals in runs (a new run where ``cuts`` says so, and at every clear or
    worker removal, which are applied between runs); every op's result, in order."""
    results: list[object] = []
    run: list[KvOp] = []
    for op, cut in zip(ops, cuts, strict=True):
        kv = as_kv_op(op)
        if run and (cut or kv is None):
            results.extend(index.apply_run(run))
            run = []
        if kv is not None:
            run.append(kv)
        elif op[0] == "clear":
            results.append(index.clear(op[1]))  # type: ignore[arg-type]
        else:
            results.append(index.remove_worker(op[1][0]))  # type: ignore[index]
    results.extend(index.apply_run(run))
    return results


def apply_each(index: Index, ops: list[tuple[object, ...]]) -> list[object]:
    results: list[object] = []
    for kind, worker, a, b in ops:
        if kind == "store":
            results.append(index.store(worker, a, b))  # type: ignore[arg-type]
        elif kind == "remove":
            results.append(index.remove(worker, a))  # type: ignore[arg-type]
        elif kind == "clear":
            results.append(index.clear(worker))  # type: ignore[arg-type]
        else:
            results.append(index.remove_worker(worker[0]))  # type: ignore[index]
    return results


def holders(index: PrefixIndex) -> set[tuple[int, int]]:
    """Every (sequence hash, slot) membership the node table and its bitmaps say."""
    seqs, vals = index._holders.nodes.items()
    out: set[tuple[int, int]] = set()
    for seq, v in zip(seqs.tolist(), vals.tolist(), strict=True):
        if v >= 0:
            out.add((seq, v))
            continue
        bits = np.unpackbits(index._holders.rows[-2 - v].view(np.uint8), bitorder="little")
        row_slots = np.flatnonzero(bits).tolist()
        assert len(row_slots) > 1, "a bitmap with one holder should be a plain slot"
        out.update((seq, s) for s in row_slots)
    return out


def inner_state(index: PrefixIndex) -> tuple[object, ...]:
    """What the compact index keeps, cell placement aside."""
    live = sorted(index._slots.items())
    blocks = {s: sorted(zip(*(c.tolist() for c in index._blocks[s].items()), strict=True))
              for _, s in live}
    return (live, sorted(index._free), blocks, {s: index._dups[s] for _, s in live},
            {s: index._sums[s] for _, s in live}, holders(index), index._total,
            [index._blocks[s].size for _, s in live])


def check_runs_equal_one_by_one(ops: list[tuple[object, ...]], cuts: list[bool],
                                keys: list[WorkerKey], extra: list[list[int]]) -> None:
    queries = [*QUERIES, *extra]
    for threshold in (index_run._FEW_KEYS, 0):
        with few_keys(threshold):
            one, runs = PrefixIndex(), PrefixIndex()
            assert apply_in_runs(runs, ops, cuts) == apply_each(one, ops)
            assert inner_state(runs) == inner_state(one)
            expected = answers(one, keys, queries)
            assert answers(runs, keys, queries) == expected
            # and the reference form agrees, in runs too
            reference = index_reference.PrefixIndex()
            apply_in_runs(reference, ops, cuts)
            assert answers(reference, keys, queries) == expected
            # a snapshot of the index built in runs restores to the same answers, and the two
            # keep applying events alike
            restored = PrefixIndex.from_plain(through_msgpack(runs))
            assert answers(restored, keys, queries) == expected
            tail = ops[-4:]
            assert apply_in_runs(restored, tail, [False] * len(tail)) == apply_each(one, tail)
            assert inner_state(restored) == inner_state(one)


@settings(max_examples=250, deadline=None)
@given(st.data())
def test_runs_equal_one_by_one(data: st.DataObject) -> None:
    ops = data.draw(st.lists(op_strategy(KEYS), max_size=60))
    cuts = data.draw(st.lists(st.booleans(), min_size=len(ops), max_size=len(ops)))
    check_runs_equal_one_by_one(ops, cuts, KEYS, [])


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_runs_with_more_workers_than_a_word(data: st.DataObject) -> None:
    """Many slots sharing one prefix: nodes several slots take or leave in one run (slot by
    slot) or one slot takes or leaves in a run (all pairs at once), bitmaps across words, rows
    back to one holder."""
    events = data.draw(st.lists(st.tuples(st.sampled_from(MANY), st.integers(1, 5),
                                          st.booleans()), min_size=100, max_size=250))
    cuts = data.draw(st.lists(st.sampled_from([True, False, False]), min_size=len(events),
                              max_size=len(events)))
    chain = [(1, 1), (2, 2), (3, 3), (4, 4), (5, 5)]
    ops: list[tuple[object, ...]] = [
        ("remove", worker, [depth, depth + 1], None) if drop
        else ("store", worker, None, chain[:depth]) for worker, depth, drop in events]
    check_runs_equal_one_by_one(ops, cuts, MANY[:8], [[1, 2, 3, 4, 5]])


def test_a_chain_extended_and_evicted_inside_one_run() -> None:
    """The catch-up tail's shape: each event names the block the one before stored as its
    parent, and removals reach blocks stored earlier in the same run."""
    a, b = KEYS[0], KEYS[1]
    ops: list[tuple[object, ...]] = [("store", a, None, [(i, i + 1) for i in range(40)]),
                                     ("store", b, None, [(i, i + 1) for i in range(40)])]
    tip = {a: 39, b: 39}
    for step in range(60):
        worker = a if step % 3 else b
        new = [(10_000 + 10 * step + j, step + j) for j in range(4)]
        ops.append(("store", worker, tip[worker], new))
        tip[worker] = new[-1][0]
        ops.append(("remove", worker, [step, 10_000 + 10 * step, 77_777], None))
    ops.append(("store", a, 123_456, [(5, 5)]))  # an unknown parent
    check_runs_equal_one_by_one(ops, [False] * len(ops), KEYS, [list(range(1, 9))])
