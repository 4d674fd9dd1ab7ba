"""A decision's recorded cost rows, bounded: the chosen candidate's row and the cheapest others'.

``CostTable.rows(limit, chosen)`` is what a ``RequestRouted`` carries with
``--decision-candidates K``: at most K rows, cheapest first, equal costs in candidate order, the
chosen row always among them; over candidate columns the same rows as over the objects."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replicas.core.candidate_columns import CandidateColumns, select_columns
from replicas.core.load import WorkerKey
from replicas.core.selection import (
    Candidate,
    CostRow,
    Decision,
    RoutingConfig,
    RoutingMode,
    Selector,
    cheapest_first,
)
from tests.unit.replicas.core.candidate_strategies import candidate_lists, load

BS = 16
ISL = 10 * BS


def cand(worker: str, *, overlap: int = 0, prefill: float = 0.0, decode: float = 0.0,
         rank: int = 0) -> Candidate:
    return Candidate((worker, rank), overlap, 0, prefill, decode, 0, 1000, 1000)


def reference(full: list[CostRow], limit: int, chosen: WorkerKey | None) -> list[CostRow]:
    """The chosen row and the ``limit`` - 1 cheapest others, cheapest first, ties in order."""
    def key(i: int) -> tuple[bool, float, int]:
        cost = full[i][5]
        return (math.isnan(cost), 0.0 if math.isnan(cost) else cost, i)

    order = sorted(range(len(full)), key=key)
    mine = [i for i in order if (full[i][0], full[i][1]) == chosen]
    others = [i for i in order if (full[i][0], full[i][1]) != chosen]
    kept = mine + others[:limit - len(mine)] if limit > len(mine) else mine[:limit]
    return [full[i] for i in sorted(kept, key=key)]


def test_cheapest_first_orders_ties_by_index_and_nan_last() -> None:
    cost = np.array([3.0, 1.0, 2.0, 1.0, 1.0, 0.5])
    assert cheapest_first(cost, 2) == [5, 1]
    assert cheapest_first(cost, 3) == [5, 1, 3]  # a tie at the boundary: the lower index
    assert cheapest_first(cost, 10) == [5, 1, 3, 4, 2, 0]
    with_nan = np.array([np.nan, 2.0, np.inf, 1.0])
    assert cheapest_first(with_nan, 3) == [3, 1, 2]
    assert cheapest_first(with_nan, 4) == [3, 1, 2, 0]


def test_limit_zero_keeps_every_row_in_candidate_order() -> None:
    cands = [cand("c", decode=9), cand("a", decode=1), cand("b", decode=5)]
    d = Selector(RoutingConfig.dynamo()).select(cands, ISL, random.Random(0))
    assert [r[0] for r in d.costs.rows()] == ["c", "a", "b"]
    assert d.costs.rows(0, d.worker) == d.costs.rows()


def test_bounded_rows_are_the_cheapest_first() -> None:
    cands = [cand(f"w{i}", decode=float(d)) for i, d in enumerate([7, 3, 9, 1, 3, 5])]
    d = Selector(RoutingConfig.dynamo()).select(cands, ISL, random.Random(0))
    assert isinstance(d, Decision) and d.worker == ("w3", 0)
    rows = d.costs.rows(3, d.worker)
    assert [r[0] for r in rows] == ["w3", "w1", "w4"]  # w1 and w4 tie: candidate order
    full = {r[0]: r for r in d.costs.rows()}
    assert rows == [full["w3"], full["w1"], full["w4"]]  # the same terms as every row's
    assert [r[0] for r in d.costs.rows(100, d.worker)] == ["w3", "w1", "w4", "w5", "w0", "w2"]


def test_the_chosen_row_is_kept_when_it_is_not_among_the_cheapest() -> None:
    # Round robin picks the first worker in order, the dearest one here.
    cands = [cand("a", decode=50.0), cand("b", decode=1.0), cand("c", decode=2.0),
             cand("d", decode=3.0)]
    config = RoutingConfig.dynamo(mode=RoutingMode.ROUND_ROBIN)
    d = Selector(config).select(cands, ISL, random.Random(0))
    assert isinstance(d, Decision) and d.worker == ("a", 0)
    assert [r[0] for r in d.costs.rows(3, d.worker)] == ["b", "c", "a"]
    assert [r[0] for r in d.costs.rows(1, d.worker)] == ["a"]
    assert [r[0] for r in d.costs.rows(3)] == ["b", "c", "d"]  # no chosen one: refused


def test_columns_build_only_the_rows_they_keep(monkeypatch: pytest.MonkeyPatch) -> None:
    n = 256
    cands = [cand(f"w{i:03d}", overlap=i % 5, prefill=float(i * 37 % 101)) for i in range(n)]
    columns = CandidateColumns.from_candidates(cands)
    built: list[int] = []
    row = CandidateColumns.row

    def counting_row(self: CandidateColumns, i: int) -> Candidate:
        built.append(i)
        return row(self, i)

    monkeypatch.setattr(CandidateColumns, "row", counting_row)
    config = RoutingConfig(kv_overlap_score_weight=8.0, prefill_queue_weight=1.0)
    d = select_columns(Selector(config), columns, ISL, random.Random(0))
    assert isinstance(d, Decision)
    rows = d.costs.rows(8, d.worker)
    assert len(rows) == 8 and len(built) == 8
    assert (rows[0][0], rows[0][1]) == d.worker


candidates = candidate_lists(
    workers=st.integers(min_value=1, max_value=40), ranks=st.integers(min_value=1, max_value=2),
    tree_size=st.sampled_from([0, 5]),
    # A third of the ranks at exactly 100 prompt tokens in flight, the rest at any load.
    active_prefill_tokens=st.sampled_from([0, 0, 100.0]).flatmap(
        lambda v: st.just(v) if v else load),
    active_decode_blocks=st.sampled_from([0.0, 8.0]),  # few values: ties
    kv_total_blocks=st.just(1000), max_num_batched_tokens=st.just(2048),
    weight=st.sampled_from([1.0, 1.0, 0.5]))


@settings(max_examples=150, deadline=None)
@given(cands=candidates, limit=st.sampled_from([1, 2, 3, 8, 16]),
       mode=st.sampled_from([RoutingMode.KV, RoutingMode.KV, RoutingMode.ROUND_ROBIN,
                             RoutingMode.RANDOM]),
       queue_weight=st.sampled_from([None, 1.0]), seed=st.integers(0, 2**16))
def test_bounded_rows_agree_with_the_reference_over_objects_and_columns(
        cands: list[Candidate], limit: int, mode: str, queue_weight: float | None,
        seed: int) -> None:
    config = RoutingConfig(kv_overlap_score_weight=8.0, prefill_queue_weight=queue_weight,
                           mode=mode)
    by_objects = Selector(config).select(cands, ISL + seed % 7, random.Random(seed))
    by_columns = select_columns(Selector(config), CandidateColumns.from_candidates(cands),
                                ISL + seed % 7, random.Random(seed))
    assert isinstance(by_objects, Decision) and isinstance(by_columns, Decision)
    chosen = by_objects.worker
    want = reference(by_objects.costs.rows(), limit, chosen)
    assert by_objects.costs.rows(limit, chosen) == want
    assert by_columns.costs.rows(limit, chosen) == want
    assert len(want) == min(limit, len(cands))
    assert any((r[0], r[1]) == chosen for r in want)


def test_a_nan_cost_sorts_last_over_objects_too() -> None:
    cands = [cand("a", decode=2.0), cand("b", decode=math.nan), cand("c", decode=1.0),
             cand("d", decode=1.0)]
    d = Selector(RoutingConfig.dynamo()).select(cands, ISL, random.Random(0))
    assert isinstance(d, Decision)
    assert [r[0] for r in d.costs.rows(4, d.worker)] == ["c", "d", "a", "b"]
    assert [r[0] for r in d.costs.rows(2, ("b", 0))] == ["c", "b"]
