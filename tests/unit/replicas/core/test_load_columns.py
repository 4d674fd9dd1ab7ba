"""The load columns (load_columns.py) beside ``ActiveLoad``'s per-rank answers: figures by slot,
holder bitmasks and the grouped prefix search at more ranks than a machine word has bits, slots
given back and reused, a snapshot restored, and ``SlotRows`` following the slots' journal."""

from __future__ import annotations

import random

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from replicas.core.load import MILLI, ActiveLoad, OutputTracking
from replicas.core.load_columns import LoadColumns, SlotRows

CHAINS = [[10 * c + j for j in range(12)] for c in range(5)]  # 5 prompts of 12 blocks
RANKS = [(f"w{i:03d}", i % 2) for i in range(90)]


def answers(load: ActiveLoad, query: list[int]) -> dict[tuple[str, int], int]:
    """Each rank's active prefix of ``query`` as the grouped search gives it (0s left out)."""
    columns = load.columns
    out: dict[tuple[str, int], int] = {}
    for mask, length in load.prefix_groups(query):
        for slot in range(mask.bit_length()):
            if mask >> slot & 1:
                key = columns.keys[slot]
                assert key is not None and key not in out
                out[key] = length
    return out


def expected(load: ActiveLoad, query: list[int]) -> dict[tuple[str, int], int]:
    return {w: n for w in load.workers() if (n := load.active_prefix_len(w, query))}


def check(load: ActiveLoad, queries: list[list[int]]) -> None:
    columns = load.columns
    for slot, key in enumerate(columns.keys):
        if key is None:
            assert columns.prefill[slot] == columns.blocks[slot] == columns.milli[slot] == 0
            continue
        assert columns.prefill[slot] == load.active_prefill_tokens(key)
        assert columns.blocks[slot] + columns.milli[slot] / MILLI == \
            load.active_decode_blocks(key)
    assert {k for k in columns.keys if k is not None} == load.workers()
    for query in queries:
        assert answers(load, query) == expected(load, query)


operation = st.one_of(
    st.tuples(st.just("add"), st.integers(0, 59), st.sampled_from(range(len(RANKS))),
              st.integers(0, 4), st.integers(0, 12)),
    st.tuples(st.just("finish"), st.integers(0, 59)),
    st.tuples(st.just("restore")),
)


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(operation, max_size=120), seed=st.integers(0, 2**16))
def test_grouped_search_answers_as_each_rank_at_90_ranks(ops: list[tuple], seed: int) -> None:
    rng = random.Random(seed)
    load = ActiveLoad()
    queries = [chain[:n] for chain in CHAINS for n in (0, 1, 5, 12)]
    # shuffled queries: membership is not monotone along them
    queries += [rng.sample(CHAINS[0] + CHAINS[1], 12) for _ in range(4)]
    for op in ops:
        if op[0] == "add":
            _, rid, rank, chain, n = op
            load.add(f"r{rid}", "A", RANKS[rank], 16 * n, CHAINS[chain][:n], 1.0)
        elif op[0] == "finish":
            load.finish(f"r{op[1]}")
        else:
            load = ActiveLoad.from_plain(load.to_plain())
    check(load, queries)


def test_a_finish_leaves_the_other_requests_output_blocks_in_the_column() -> None:
    load = ActiveLoad()
    track = OutputTracking(isl_tokens=8, block_size=4)
    for rid in ("a", "b"):
        load.add(rid, "A", ("w", 0), 8, [1, 2], 1.0, output=track)
    load.output_progress("a", 9)
    load.output_progress("b", 5)
    load.finish("a")
    check(load, [[1, 2]])
    assert load.columns.milli[load.columns.keys.index(("w", 0))] == MILLI


def test_slot_rows_follow_the_slots_through_reuse_and_a_trimmed_journal() -> None:
    columns = LoadColumns()
    row_of = {RANKS[i]: 3 * i for i in range(0, len(RANKS), 2)}  # odd ranks have no row
    rows = SlotRows(row_of)
    held: dict[tuple[str, int], int] = {}
    rng = random.Random(7)
    peak = 0

    def agree() -> None:
        slots, at = rows.sync(columns)
        want = sorted((held[k], row_of[k]) for k in held if k in row_of)
        assert sorted(zip(slots.tolist(), at.tolist(), strict=True)) == want

    for step in range(3000):
        key = rng.choice(RANKS)
        if key in held:
            columns.release(held.pop(key))
        else:
            held[key] = columns.assign(key)
            peak = max(peak, len(held))
        if step % (1 if step < 200 else 997) == 0:  # in step, then far behind the journal
            agree()
    assert columns.changes_base > 0  # the journal was trimmed meanwhile
    agree()
    assert len(columns.keys) == peak  # a free slot is reused before a new one is made


def test_columns_grow_past_their_first_capacity() -> None:
    load = ActiveLoad()
    for i, key in enumerate(RANKS):
        load.add(f"r{i}", "A", key, i, CHAINS[i % 5][: 1 + i % 12], 1.0)
    columns = load.columns
    assert len(columns.prefill) >= len(RANKS) and columns.prefill_view.nbytes >= 8 * len(RANKS)
    assert np.array_equal(columns.prefill[: len(RANKS)], np.arange(len(RANKS)))
    check(load, [chain[:12] for chain in CHAINS])
