"""Selection over candidate columns decides exactly as ``Selector.select`` over the objects.

Random candidates (dp ranks sharing a worker, integral and fractional loads, health weights
below 1), random cost weights, busy thresholds and routing modes: the same decision or refusal,
the same cost table, and the same draws taken from the random generator."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from replicas.core.candidate_columns import CandidateColumns, select_columns
from replicas.core.selection import (
    BusyThresholds,
    Candidate,
    Decision,
    RoutingConfig,
    RoutingMode,
    Selector,
)
from tests.unit.replicas.core.candidate_strategies import candidate_lists, load, small

candidates = candidate_lists(
    workers=st.integers(min_value=0, max_value=12), ranks=st.integers(min_value=1, max_value=3),
    tree_size=st.sampled_from([0, 5, 9]),  # few values: ties happen
    active_prefill_tokens=load, active_decode_blocks=load,
    kv_total_blocks=st.sampled_from([0, 100, 1000]),
    max_num_batched_tokens=st.sampled_from([256, 2048]),
    weight=st.sampled_from([1.0, 1.0, 0.5, 0.0]))


thresholds = st.builds(
    BusyThresholds,
    active_decode_blocks_threshold=st.one_of(st.none(), st.sampled_from([0.5, 2.0])),
    active_prefill_tokens_threshold=st.one_of(st.none(), st.sampled_from([1000, 4000])),
    active_prefill_tokens_threshold_frac=st.one_of(st.none(), st.sampled_from([0.5, 1.5])),
)


@settings(max_examples=120, deadline=None)
@given(cands=candidates, isl_blocks=small, weight=st.sampled_from([0, 1, 1.0, 8.0, 2.5]),
       queue_weight=st.sampled_from([None, 0.0, 1.0, 3]), th=thresholds,
       mode=st.sampled_from([RoutingMode.KV] * 4 + list(RoutingMode)),
       temperature=st.sampled_from([0.0, 0.0, 0.7]), seed=st.integers(0, 2**16),
       override=st.sampled_from([None, 2.0]))
def test_columns_decide_as_objects(cands: list[Candidate], isl_blocks: int, weight: float,
                                   queue_weight: float | None, th: BusyThresholds, mode: str,
                                   temperature: float, seed: int, override: float | None
                                   ) -> None:
    config = RoutingConfig(kv_overlap_score_weight=weight, prefill_queue_weight=queue_weight,
                           mode=mode, temperature=temperature, thresholds=th)
    isl = isl_blocks * config.block_size + seed % 7
    rng_objects, rng_columns = random.Random(seed), random.Random(seed)
    expected = Selector(config).select(cands, isl, rng_objects, overlap_weight=override)
    got = select_columns(Selector(config), CandidateColumns.from_candidates(cands), isl,
                         rng_columns, overlap_weight=override)
    assert type(got) is type(expected)
    if isinstance(expected, Decision):
        assert isinstance(got, Decision)
        assert (got.worker, got.overlap_blocks) == (expected.worker, expected.overlap_blocks)
    else:
        assert got.reason == expected.reason  # type: ignore[union-attr]
    assert len(got.costs) == len(expected.costs)
    assert got.costs == expected.costs
    assert got.costs.rows() == expected.costs.rows()
    assert rng_columns.random() == rng_objects.random()  # the same draws were taken


def test_request_thresholds_override_the_configured_ones() -> None:
    cands = [Candidate(("a", 0), 0, 0, 5000.0, 0.0, 1, 100, 256),
             Candidate(("b", 0), 9, 0, 0.0, 0.0, 1, 100, 256)]
    config = RoutingConfig(kv_overlap_score_weight=1.0, prefill_queue_weight=None)
    columns = CandidateColumns.from_candidates(cands)
    busy = BusyThresholds(active_prefill_tokens_threshold=1)
    for th in (None, busy, BusyThresholds(active_prefill_tokens_threshold=10_000)):
        expected = Selector(config).select(cands, 160, random.Random(1), thresholds=th)
        got = select_columns(Selector(config), columns, 160, random.Random(1), thresholds=th)
        assert got == expected


def test_rows_round_trip() -> None:
    cands = [Candidate(("a", 1), 3, 4, 5.5, 6.0, 7, 8, 9, 0.5)]
    assert CandidateColumns.from_candidates(cands).to_candidates() == tuple(cands)


def test_match_columns_rows_stay_one_list_until_the_rows_change() -> None:
    from eventlog.hashing import sequence_hashes
    from replicas.core import index_reference
    from replicas.core.index import PrefixIndex

    query = sequence_hashes([1, 2, 3])
    for index in (index_reference.PrefixIndex(), PrefixIndex()):
        index.store(("a", 0), None, [(10, 1), (11, 2)])
        index.store(("b", 0), None, [(20, 1)])
        first, again = index.match_columns(query), index.match_columns(query)
        assert first.workers is again.workers
        assert first.to_scores() == index.find_matches(query)
        index.store(("c", 0), None, [(30, 1), (31, 2), (32, 3)])
        changed = index.match_columns(query)
        assert changed.workers is not first.workers
        assert changed.to_scores() == index.find_matches(query)
        assert dict(zip(changed.workers, changed.overlap_blocks.tolist(), strict=True)) == {
            ("a", 0): 2, ("b", 0): 1, ("c", 0): 3}
