"""``build_candidate_columns`` gives ``build_candidates``' rows as columns, on real states.

Random fleets (models, LoRA adapters, dp ranks, disaggregated roles, health), cached blocks,
requests in flight, this replica's pending decisions, excluded workers, every decision phase and
the tracking switches: the same rows in the same order with the same values."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from eventlog import events as ev
from eventlog.hashing import prompt_hashes, tokens_hashes
from eventlog.names import CONTROL, KV, ROUTER
from replicas.core import disagg
from replicas.core.candidate_columns import CandidateColumns
from replicas.core.candidates import (
    CandidateRowCache,
    build_candidate_columns,
    build_candidates,
)
from replicas.core.overlay import Overlay, PendingDecision
from replicas.core.state import RouterState, StateConfig

BS = 4
TOKENS = list(range(100, 100 + 8 * BS))  # an 8-block prompt every cache and request shares
HASHES = tokens_hashes(TOKENS, BS)
SEQ = prompt_hashes(TOKENS, BS)

worker = st.fixed_dictionaries({
    "model": st.sampled_from(["m", "m", "other"]),
    "loras": st.sampled_from([[], ["sql"]]),
    "dp": st.integers(1, 3),
    "role": st.sampled_from(["both", *disagg.ROLES]),
    "health": st.sampled_from([None, "healthy", "suspicious", "unhealthy"]),
    "cached": st.lists(st.integers(0, 8), max_size=3),  # blocks cached per rank, first ranks
    "inflight": st.lists(st.tuples(st.integers(0, 2), st.integers(0, 8), st.integers(1, 200)),
                         max_size=3),  # (rank, prompt blocks, isl)
    "pending": st.lists(st.tuples(st.integers(0, 2), st.integers(0, 50), st.integers(0, 5)),
                        max_size=2),  # (rank, prefill tokens, new blocks)
    "excluded": st.booleans(),
})


def build(workers: list[dict[str, object]], form: str
          ) -> tuple[RouterState, Overlay, frozenset[str]]:
    s = RouterState(StateConfig(block_size=BS, index_form=form))
    s.apply(KV, 1, [ev.WorkerRegistered(f"w{i}", f"http://w{i}", w["model"], BS, 100 + i,
                                        256 * (i + 1), 1.0, dp_size=w["dp"],  # type: ignore[arg-type]
                                        loras=w["loras"], role=w["role"])  # type: ignore[arg-type]
                    for i, w in enumerate(workers)])
    kv, router, control, n = 2, 1, 1, 0
    overlay = Overlay()
    for i, w in enumerate(workers):
        wid = f"w{i}"
        for rank, blocks in enumerate(w["cached"][: w["dp"]]):  # type: ignore[index,misc]
            if blocks:
                pairs = [(1000 * i + 10 * rank + j, h) for j, h in enumerate(HASHES[:blocks])]
                s.apply(KV, kv, [ev.BlocksStored(wid, rank + 1, rank, None, pairs, 2.0)])
                kv += 1
        if w["health"] is not None:
            s.apply(CONTROL, control, [ev.WorkerHealthChanged(wid, w["health"], "test", 2.0)])
            control += 1
        for rank, blocks, isl in w["inflight"]:  # type: ignore[attr-defined]
            n += 1
            s.apply(ROUTER, router, [ev.RequestRouted(f"q{n}", "r", wid, rank % w["dp"], isl,
                                                      SEQ[:blocks], 0, 8, 0, 3.0)])
            router += 1
        for rank, tokens, blocks in w["pending"]:  # type: ignore[attr-defined]
            n += 1
            overlay.add(f"p{n}", PendingDecision((wid, rank % w["dp"]), prefill_tokens=tokens,
                                                 new_blocks=blocks))
    excluded = frozenset(f"w{i}" for i, w in enumerate(workers) if w["excluded"])
    return s, overlay, excluded


@settings(max_examples=80, deadline=None)
@given(workers=st.lists(worker, max_size=6), model=st.sampled_from(["m", "sql", "other"]),
       prompt_blocks=st.integers(0, 8), phase=st.sampled_from(disagg.PHASES),
       reuse=st.booleans(), track_blocks=st.booleans(), track_prefill=st.booleans(),
       form=st.sampled_from(["reference", "compact"]))
def test_columns_equal_the_objects(workers: list[dict[str, object]], model: str,
                                   prompt_blocks: int, phase: disagg.Phase, reuse: bool,
                                   track_blocks: bool, track_prefill: bool, form: str) -> None:
    state, overlay, excluded = build(workers, form)
    seq = SEQ[:prompt_blocks]
    options = {"exclude": excluded, "overlay": overlay, "phase": phase,
               "assume_kv_reuse": reuse, "track_active_blocks": track_blocks,
               "track_prefill_tokens": track_prefill}
    expected = CandidateColumns.from_candidates(build_candidates(state, model, seq, **options))
    assert_equal(build_candidate_columns(state, model, seq, **options),  # type: ignore[arg-type]
                 expected)
    rows = CandidateRowCache().get(state, model, excluded, phase)
    assert_equal(build_candidate_columns(state, model, seq, rows=rows,  # type: ignore[arg-type]
                                         **options), expected)


def assert_equal(got: CandidateColumns, expected: CandidateColumns) -> None:
    assert got.workers == expected.workers
    for name in ("overlap_blocks", "tree_size", "active_prefill_tokens", "active_decode_blocks",
                 "new_request_blocks", "kv_total_blocks", "max_num_batched_tokens", "weight"):
        a, b = getattr(got, name), getattr(expected, name)
        assert a.dtype == b.dtype and np.array_equal(a, b), name


def test_rows_are_rebuilt_when_the_roster_moves() -> None:
    one = {"model": "m", "loras": [], "dp": 2, "role": "both", "health": None,
           "cached": [3], "inflight": [], "pending": [], "excluded": False}
    state, _, _ = build([one, one], "reference")
    cache = CandidateRowCache()
    before = cache.get(state, "m")
    assert cache.get(state, "m") is before  # kept while nothing moved
    assert [k for k, _ in before.workers] == ["w0", "w0", "w1", "w1"]
    state.apply(CONTROL, 1, [ev.WorkerHealthChanged("w0", "unhealthy", "test", 3.0)])
    after = cache.get(state, "m")
    assert after is not before and [k for k, _ in after.workers] == ["w1", "w1"]
    # rows from before the change are not used even when passed in
    got = build_candidate_columns(state, "m", SEQ, rows=before)
    assert_equal(got, CandidateColumns.from_candidates(build_candidates(state, "m", SEQ)))
    state.apply(KV, 9, [ev.WorkerRetired("w1", "shutdown", 4.0)])
    assert cache.get(state, "m").workers == []


def test_kept_rows_follow_the_index_when_its_rows_move() -> None:
    """One ``CandidateRows`` kept across decisions (as the dispatcher keeps it) while the
    index's rows change under it without a roster change: blocks stored by a rank that held
    none (a row added before the others), then every block of a rank removed (its row gone).
    Each decision equals one built from scratch, in both index forms."""
    one = {"model": "m", "loras": [], "dp": 2, "role": "both", "health": None,
           "cached": [], "inflight": [], "pending": [], "excluded": False}
    for form in ("reference", "compact"):
        state, _, _ = build([dict(one, cached=[0, 5]), dict(one, cached=[3])], form)
        rows = CandidateRowCache().get(state, "m")
        assert_kept_rows_right(state, rows)
        assert_kept_rows_right(state, rows)  # the kept places again
        pairs = [(7000 + j, h) for j, h in enumerate(HASHES[:6])]
        state.apply(KV, 50, [ev.BlocksStored("w0", 9, 0, None, pairs, 3.0)])  # w0 rank 0: a row
        assert_kept_rows_right(state, rows)
        state.apply(KV, 51, [ev.BlocksRemoved("w1", 9, 0, [1000 + j for j in range(3)], 3.0)])
        assert_kept_rows_right(state, rows)
        assert CandidateRowCache().get(state, "m").workers == rows.workers  # same roster


def assert_kept_rows_right(state: RouterState, rows: object) -> None:
    got = build_candidate_columns(state, "m", SEQ, rows=rows)  # type: ignore[arg-type]
    assert_equal(got, CandidateColumns.from_candidates(build_candidates(state, "m", SEQ)))
