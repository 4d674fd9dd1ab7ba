"""The compact index's compiled prefix match (``_fastindex_match.c``) against its Python code.

Over random indexes (chains sharing prefixes over a small token alphabet, blocks removed from the
middle of chains, more than 64 and 1,024 slots) and random queries (prefixes of what was stored,
extended, diverging, with a first block nobody holds, empty), the kernel's
``prefix_match`` gives ``PrefixIndex._match_python``'s slots and lengths in the same order, and
``find_matches`` / ``match_columns`` answer alike with the kernel on and off. The compact form's
property tests against the reference form (``test_index_compact.py``) run with the kernel too.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eventlog.hashing import sequence_hashes
from replicas.core import index_kernel
from replicas.core.index import PrefixIndex
from replicas.core.index_common import U64, WorkerKey
from tests.unit.replicas.core.kernel_switch import kernel
from tests.unit.replicas.core.test_index_compact import KEYS, MANY

pytestmark = pytest.mark.skipif(not index_kernel.available(),
                                reason="the compiled index kernel is not built here")

ALPHABET = st.integers(min_value=1, max_value=3)  # small, so that chains share prefixes
NOBODY = 99  # a token no store uses: a query starting with it has a first block nobody holds


def compiled_match(index: PrefixIndex, query: object) -> object:
    return index_kernel.active().prefix_match(index._holders, query)  # type: ignore[union-attr]


def check_query(index: PrefixIndex, tokens: list[int]) -> None:
    query = sequence_hashes(tokens) if tokens else []
    expected = index._match_python(query)
    with kernel(True):
        for form in (query, tuple(query), np.array(query, dtype=U64)):
            got = compiled_match(index, form)
            assert got == expected, (tokens, form)
        # the same answer written by slot (match_columns)
        by_slot = np.zeros(len(index._keys), dtype=np.int64)
        count = index_kernel.active().prefix_match(  # type: ignore[union-attr]
            index._holders, query, by_slot)
        assert count == len(expected[0])
        assert dict(enumerate(by_slot.tolist())) == {
            s: dict(zip(*expected, strict=True)).get(s, 0) for s in range(len(index._keys))}
        on = index.find_matches(query), index.match_columns(query).to_scores()
    with kernel(False):
        off = index.find_matches(query), index.match_columns(query).to_scores()
    assert on == off
    assert on[0] == on[1]


@st.composite
def indexes(draw: st.DrawFn) -> tuple[PrefixIndex, list[list[int]]]:
    """An index built with the kernel (or not) from chains over a small alphabet, some blocks
    then removed; and the token chains stored."""
    keys: list[WorkerKey] = draw(st.sampled_from([KEYS, MANY]))
    index = PrefixIndex()
    with kernel(draw(st.booleans())):
        if keys is MANY:  # every worker a slot, in key order: holders spread over three words
            for i, worker in enumerate(keys):
                index.store(worker, None, [(10**6 + i, 10**6 + i)])
        stored: list[tuple[WorkerKey, list[int], list[int]]] = []
        next_id = 0
        for _ in range(draw(st.integers(0, 30))):
            worker = draw(st.sampled_from(keys))
            tokens = draw(st.lists(ALPHABET, min_size=1, max_size=10))
            ids = list(range(next_id, next_id + len(tokens)))
            next_id += len(tokens)
            index.store(worker, None, list(zip(ids, tokens, strict=True)))
            stored.append((worker, ids, tokens))
        for worker, ids, _ in stored:  # gaps: a worker's match stops at a block it dropped
            dropped = draw(st.lists(st.sampled_from(ids), max_size=2))
            if dropped:
                index.remove(worker, dropped)
    return index, [tokens for _, _, tokens in stored]


@st.composite
def queries(draw: st.DrawFn, chains: list[list[int]]) -> list[int]:
    shape = draw(st.sampled_from(["prefix", "extended", "random", "nobody", "empty"]))
    if shape == "empty":
        return []
    if shape == "random" or not chains:
        return draw(st.lists(ALPHABET, min_size=1, max_size=12))
    if shape == "nobody":
        return [NOBODY, *draw(st.lists(ALPHABET, max_size=6))]
    chain = draw(st.sampled_from(chains))
    cut = draw(st.integers(1, len(chain)))
    tail = draw(st.lists(ALPHABET, max_size=4)) if shape == "extended" else []
    return chain[:cut] + tail


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_compiled_and_python_matches_agree(data: st.DataObject) -> None:
    index, chains = data.draw(indexes())
    for _ in range(6):
        check_query(index, data.draw(queries(chains)))


def test_shapes_of_the_walk() -> None:
    """One of each by hand: a single holder's run ending at the query's end, at a block nobody
    holds, at another single holder, at a row without it; a row narrowing to one holder and
    widening again; an empty index."""
    a, b, c = KEYS[0], KEYS[1], KEYS[2]
    index = PrefixIndex()
    check_query(index, [1, 2])
    index.store(a, None, [(1, 1), (2, 2), (3, 3), (4, 4)])
    index.store(b, None, [(1, 1), (2, 2), (3, 3), (5, 4), (6, 5)])
    index.store(c, None, [(1, 1), (2, 2)])
    index.store(c, None, [(7, 2)])
    for tokens in ([1], [1, 2], [1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6],
                   [1, 2, 9], [2], [2, 2], [9], [1, 1]):
        check_query(index, tokens)
    index.remove(b, [2])  # b's run now ends at its second block; a and c go on
    for tokens in ([1, 2], [1, 2, 3], [1, 2, 3, 4, 5]):
        check_query(index, tokens)
    # every slot still matching leaves at once: the next block's row holds none of them
    d = KEYS[3]
    index.store(d, None, [(8, 1), (9, 2), (10, 3)])
    index.store(c, None, [(11, 3)])
    index.remove(c, [11])
    index.store(c, 7, [(12, 3), (13, 6)])  # c and d hold [1, 2, 3]; a no longer does
    index.remove(a, [3])
    index.store(a, None, [(14, 1), (15, 2)])
    for tokens in ([1, 2, 3], [1, 2, 3, 6]):
        check_query(index, tokens)
    shared = PrefixIndex()
    for worker in (a, b):
        shared.store(worker, None, [(1, 1), (2, 2)])
    for worker in (c, d):
        shared.store(worker, None, [(3, 1), (4, 2), (5, 3)])
        shared.remove(worker, [3, 4])
    check_query(shared, [1, 2, 3])  # {a, b} at blocks 1-2, then {c, d} alone: a and b stop


def test_a_long_query_and_bitmaps_wider_than_the_stack_buffers() -> None:
    """More hashes than the kernel converts on its stack (1,024), and more slots than its
    running set keeps there (1,024: bitmaps of 18 words)."""
    with kernel(True):
        index = PrefixIndex()
        chain = [(i, 1 + i % 3) for i in range(1500)]
        index.store(KEYS[0], None, chain)
        index.store(KEYS[1], None, chain[:1200])
        keys = [(f"x{i}", 0) for i in range(1100)]
        for i, worker in enumerate(keys):  # everyone the first 2 blocks, half of them 3
            index.store(worker, None, chain[:2 + (i % 2)])
    tokens = [t for _, t in chain]
    for cut in (1, 2, 3, 4, 1100, 1200, 1300, 1500):
        check_query(index, tokens[:cut])
    check_query(index, [*tokens, 7, 7])


def test_hashes_the_kernel_does_not_take_go_to_python() -> None:
    """A hash outside u64, a float, an array of another type or shape: the kernel declines (None)
    and the Python code answers, or fails, as it does without the kernel."""
    index = PrefixIndex()
    with kernel(True):
        index.store(KEYS[0], None, [(1, 1), (2, 2)])
    good = sequence_hashes([1, 2])
    column = np.array(good, dtype=U64)
    for query in ([-1, *good], [*good, 2**64], [float(good[0])], column.view(np.int64),
                  np.array([good, good], dtype=U64), column.astype(np.uint32), "ab"):
        with kernel(True):
            assert compiled_match(index, query) is None
            on = outcome(index, query)
        with kernel(False):
            assert on == outcome(index, query)
    with kernel(True):  # a strided array is copied by nobody: declined too, answered alike
        strided = np.array([good[0], 0, good[1], 0], dtype=U64)[::2]
        assert compiled_match(index, strided) is None
        assert index.find_matches(strided).scores == {KEYS[0]: 2}


def test_a_by_slot_array_of_another_type_or_too_short_is_refused() -> None:
    index = PrefixIndex()
    with kernel(True):
        for worker in KEYS:
            index.store(worker, None, [(1, 1)])
        query = sequence_hashes([1])
        match = index_kernel.active().prefix_match  # type: ignore[union-attr]
        with pytest.raises(TypeError):
            match(index._holders, query, np.zeros(len(KEYS), dtype=np.int32))
        with pytest.raises(TypeError):
            match(index._holders, query, np.zeros((len(KEYS), 1), dtype=np.int64))
        with pytest.raises(IndexError):
            match(index._holders, query, np.zeros(len(KEYS) - 1, dtype=np.int64))
        assert match(index._holders, query, np.zeros(len(KEYS), dtype=np.int64)) == len(KEYS)


def outcome(index: PrefixIndex, query: object) -> object:
    try:
        return index.find_matches(query).scores  # type: ignore[arg-type]
    except (OverflowError, TypeError, ValueError) as exc:
        return type(exc)
