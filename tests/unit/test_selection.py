"""Selector: the seed's cost example, temperature, busy filtering, dp ranks and the other modes."""

from __future__ import annotations

import dataclasses
import math
import random
from collections import Counter

import pytest

from replicas.core.selection import (
    BusyThresholds,
    Candidate,
    CostTerms,
    Decision,
    Overloaded,
    RoutingConfig,
    Selector,
    busy_workers,
    cost_terms,
)

BS = 16
ISL = 10 * BS  # a 10-block prompt


def cand(
    worker: str,
    *,
    rank: int = 0,
    overlap: int = 0,
    tree: int = 0,
    prefill: int = 0,
    decode: int = 0,
    new: int = 0,
    kv_total: int = 1000,
    mnbt: int = 1000,
    weight: float = 1.0,
) -> Candidate:
    return Candidate(
        worker=(worker, rank),
        overlap_blocks=overlap,
        tree_size=tree,
        active_prefill_tokens=prefill,
        active_decode_blocks=decode,
        new_request_blocks=new,
        kv_total_blocks=kv_total,
        max_num_batched_tokens=mnbt,
        weight=weight,
    )


def seed_example() -> list[Candidate]:
    """Dynamo's router guide example: cached 2/5/8 blocks, prefill 8/5/2, decode 10/5/9 blocks."""
    return [
        cand("w1", overlap=2, decode=2, new=8),  # prefill (160-32)/16 = 8, decode 2+8 = 10
        cand("w2", overlap=5, decode=0, new=5),  # prefill 5, decode 5
        cand("w3", overlap=8, decode=7, new=2),  # prefill 2, decode 9
    ]


def select(cands, config=None, seed=0, **kw) -> Decision | Overloaded:
    return Selector(config or RoutingConfig.dynamo()).select(cands, ISL, random.Random(seed), **kw)


def test_seed_example_picks_worker_2_with_the_seed_costs() -> None:
    d = select(seed_example())
    assert isinstance(d, Decision)
    assert d.worker == ("w2", 0)
    assert d.overlap_blocks == 5
    assert tuple(d.costs) == (
        CostTerms(("w1", 0), 2, 8.0, 10, 18.0, False),
        CostTerms(("w2", 0), 5, 5.0, 5, 10.0, False),
        CostTerms(("w3", 0), 8, 2.0, 9, 11.0, False),
    )
    assert d.costs == d.costs.as_tuple() and len(d.costs) == 3 and d.costs[1].cost == 10.0


def test_active_prefill_tokens_add_to_prefill_blocks() -> None:
    d = select([cand("w1", overlap=2, prefill=32, decode=1)])
    assert isinstance(d, Decision)
    (t,) = d.costs
    assert t.prefill_blocks == (32 + 160 - 32) / 16
    # overlap beyond the prompt never gives negative prefill
    d = select([cand("w1", overlap=20)])
    assert d.costs[0].prefill_blocks == 0.0


def test_costs_table_matches_eager_formula_and_ignores_later_mutation() -> None:
    rng = random.Random(7)
    cands = [
        cand(f"w{i}", overlap=rng.randrange(12), tree=rng.randrange(50),
             prefill=rng.randrange(900), decode=rng.randrange(300), new=rng.randrange(12),
             weight=rng.choice([1.0, 0.5]))
        for i in range(40)
    ]
    d = select(cands, RoutingConfig.dynamo(kv_overlap_score_weight=1.7))
    assert isinstance(d, Decision)
    eager = tuple(cost_terms(c, ISL, 1.7, BS) for c in cands)
    cands.clear()  # the decision must not depend on the caller's list afterwards
    assert d.costs == eager
    assert min(t.cost for t in eager) == next(t.cost for t in eager if t.worker == d.worker)


def test_temperature_zero_is_deterministic() -> None:
    cands = seed_example()
    picks = {select(cands, seed=s).worker for s in range(200)}
    assert picks == {("w2", 0)}


def test_high_temperature_spreads_picks() -> None:
    cfg = RoutingConfig.dynamo(temperature=5.0)
    sel = Selector(cfg)
    rng = random.Random(1234)
    counts = Counter(sel.select(seed_example(), ISL, rng).worker for _ in range(600))
    assert set(counts) == {("w1", 0), ("w2", 0), ("w3", 0)}
    assert counts[("w2", 0)] > counts[("w1", 0)]  # cheaper stays likelier


def test_temperature_follows_softmax_of_normalised_costs() -> None:
    cfg = RoutingConfig.dynamo(temperature=0.5)
    sel = Selector(cfg)
    rng = random.Random(99)
    n = 4000
    counts = Counter(sel.select(seed_example(), ISL, rng).worker for _ in range(n))
    costs = {"w1": 18.0, "w2": 10.0, "w3": 11.0}
    span = 8.0
    z = {w: math.exp(-(c / span) / 0.5) for w, c in costs.items()}
    total = sum(z.values())
    for w, v in z.items():
        assert abs(counts[(w, 0)] / n - v / total) < 0.03


def test_equal_costs_at_temperature_are_uniform() -> None:
    cands = [cand("a"), cand("b"), cand("c")]
    sel = Selector(RoutingConfig.dynamo(temperature=1.0))
    rng = random.Random(5)
    counts = Counter(sel.select(cands, ISL, rng).worker for _ in range(900))
    assert all(250 < counts[(w, 0)] < 350 for w in "abc")


def test_tie_goes_to_smaller_tree_then_random() -> None:
    cands = [cand("big", tree=100), cand("small", tree=3), cand("mid", tree=50)]
    assert {select(cands, seed=s).worker for s in range(30)} == {("small", 0)}
    tied = [cand("x", tree=3), cand("y", tree=3), cand("z", tree=9)]
    assert {select(tied, seed=s).worker for s in range(60)} == {("x", 0), ("y", 0)}
    # the random tie-break does not depend on candidate order
    for s in range(20):
        assert select(tied, seed=s).worker == select(tied[::-1], seed=s).worker


def test_overlap_weight_override_changes_the_pick() -> None:
    # w2 has the whole prompt cached but more decode load; w1 has nothing cached.
    cands = [cand("w1", overlap=0, decode=0, new=10), cand("w2", overlap=10, decode=15, new=0)]
    # cost(w1) = w * 10 + 10, cost(w2) = 15
    assert select(cands).worker == ("w2", 0)
    d = select(cands, overlap_weight=0.0)
    assert isinstance(d, Decision) and d.worker == ("w1", 0)
    assert [t.cost for t in d.costs] == [10.0, 15.0]
    # the config weight is what the override replaces
    assert select(cands, RoutingConfig.dynamo(kv_overlap_score_weight=0.4)).worker == ("w1", 0)
    assert select(cands, RoutingConfig.dynamo(kv_overlap_score_weight=0.4),
                  overlap_weight=1.0).worker == ("w2", 0)


def test_suspicious_worker_looks_twice_as_expensive() -> None:
    cands = [cand("ok", decode=10), cand("sus", decode=6, weight=0.5)]
    d = select(cands)
    assert isinstance(d, Decision)
    assert d.worker == ("ok", 0)
    # prefill 10 + decode: 20 for "ok"; (10 + 6) / 0.5 = 32 for "sus" (16 if it were healthy)
    assert [t.cost for t in d.costs] == [20.0, 32.0]


def test_no_candidates_is_overloaded() -> None:
    r = select([])
    assert isinstance(r, Overloaded) and r.reason == "no workers" and tuple(r.costs) == ()


@pytest.mark.parametrize(
    ("thresholds", "hot"),
    [
        # 900/1000 blocks in use > 0.85
        (BusyThresholds(active_decode_blocks_threshold=0.85), cand("w2", overlap=9, decode=900)),
        # 12,000 prefill tokens > 10,000
        (BusyThresholds(active_prefill_tokens_threshold=10_000),
         cand("w2", overlap=9, prefill=12_000)),
        # 4,100 > 4.0 x 1,000 max_num_batched_tokens
        (BusyThresholds(active_prefill_tokens_threshold_frac=4.0),
         cand("w2", overlap=9, prefill=4_100)),
    ],
)
def test_each_busy_threshold_excludes_a_worker(thresholds: BusyThresholds, hot: Candidate) -> None:
    cool = cand("w1", decode=1)
    # Without thresholds random mode does use the hot worker...
    rnd = RoutingConfig.dynamo(mode="random")
    assert ("w2", 0) in {select([cool, hot], rnd, seed=s).worker for s in range(10)}
    d = select([cool, hot], RoutingConfig.dynamo(thresholds=thresholds))
    assert isinstance(d, Decision) and d.worker == ("w1", 0)
    assert [t.busy for t in d.costs] == [False, True]
    assert busy_workers([cool, hot], thresholds) == {"w2"}
    # ... and excluded in every mode
    for mode in ("round-robin", "random", "least-loaded"):
        cfg = RoutingConfig.dynamo(mode=mode, thresholds=thresholds)
        assert {select([cool, hot], cfg, seed=s).worker for s in range(10)} == {("w1", 0)}


def test_threshold_boundary_is_strictly_greater() -> None:
    t = BusyThresholds(active_decode_blocks_threshold=0.85, active_prefill_tokens_threshold=100)
    assert busy_workers([cand("w", decode=850, prefill=100)], t) == set()
    assert busy_workers([cand("w", decode=851)], t) == {"w"}


def test_dp_rank_aggregation() -> None:
    t = BusyThresholds(active_prefill_tokens_threshold=100)
    cfg = RoutingConfig.dynamo(thresholds=t)
    # w1: rank 0 busy but cheapest, rank 1 free; w2 free but expensive
    cands = [
        cand("w1", rank=0, overlap=10, prefill=150),
        cand("w1", rank=1, prefill=0, decode=30),
        cand("w2", prefill=0, decode=50),
    ]
    d = select(cands, cfg)
    assert isinstance(d, Decision)
    # one busy rank does not exclude the worker: its busy rank stays usable too
    assert d.worker == ("w1", 0)
    assert not any(x.busy for x in d.costs)
    assert busy_workers(cands, t) == set()
    # all ranks of w1 busy: w1 is excluded entirely
    cands[1] = cand("w1", rank=1, prefill=101, decode=30)
    d = select(cands, cfg)
    assert isinstance(d, Decision) and d.worker == ("w2", 0)
    assert [x.busy for x in d.costs] == [True, True, False]
    assert busy_workers(cands, t) == {"w1"}


def test_all_busy_is_overloaded_with_costs() -> None:
    t = BusyThresholds(active_prefill_tokens_threshold=10)
    cands = [cand("w1", prefill=11), cand("w2", rank=0, prefill=50), cand("w2", rank=1, prefill=20)]
    for mode in ("kv", "round-robin", "random", "least-loaded"):
        r = select(cands, RoutingConfig.dynamo(mode=mode, thresholds=t))
        assert isinstance(r, Overloaded)
        assert r.reason == "all workers busy"
        assert [x.busy for x in r.costs] == [True, True, True]


def test_thresholds_can_change_at_runtime() -> None:
    sel = Selector(RoutingConfig.dynamo())
    cands = [cand("w1", prefill=500), cand("w2", prefill=600)]
    assert isinstance(sel.select(cands, ISL, random.Random(0)), Decision)
    sel.config = dataclasses.replace(
        sel.config, thresholds=BusyThresholds(active_prefill_tokens_threshold=100)
    )
    assert isinstance(sel.select(cands, ISL, random.Random(0)), Overloaded)


def test_per_request_thresholds_apply_to_that_request_only() -> None:
    sel = Selector(RoutingConfig.dynamo())
    cands = [cand("w1", prefill=500), cand("w2", prefill=600)]
    tight = BusyThresholds(active_prefill_tokens_threshold=100)
    assert isinstance(sel.select(cands, ISL, random.Random(0), thresholds=tight), Overloaded)
    assert sel.config == RoutingConfig.dynamo()  # nothing of the request stays on the selector
    assert isinstance(sel.select(cands, ISL, random.Random(0)), Decision)


def test_round_robin_cycles_in_worker_order_and_skips_busy() -> None:
    sel = Selector(RoutingConfig.dynamo(mode="round-robin"))
    rng = random.Random(0)
    cands = [cand("c"), cand("a"), cand("b", overlap=10)]  # overlap is irrelevant here
    picks = [sel.select(cands, ISL, rng).worker[0] for _ in range(7)]
    assert picks == ["a", "b", "c", "a", "b", "c", "a"]
    # b goes busy: the cycle continues without it
    sel.config = RoutingConfig.dynamo(
        mode="round-robin", thresholds=BusyThresholds(active_prefill_tokens_threshold=10)
    )
    cands = [cand("c"), cand("a"), cand("b", prefill=11)]
    picks = [sel.select(cands, ISL, rng).worker[0] for _ in range(4)]
    assert picks == ["c", "a", "c", "a"]


def test_random_mode_uses_every_worker() -> None:
    sel = Selector(RoutingConfig.dynamo(mode="random"))
    rng = random.Random(3)
    cands = [cand(w, overlap=10 if w == "a" else 0) for w in "abcd"]
    counts = Counter(sel.select(cands, ISL, rng).worker[0] for _ in range(400))
    assert set(counts) == set("abcd")


def test_least_loaded_ignores_overlap() -> None:
    cfg = RoutingConfig.dynamo(mode="least-loaded")
    cands = [
        cand("cached", overlap=10, decode=20),  # load 20
        cand("busyish", decode=5, prefill=16 * 10),  # load 5 + 10 = 15
        cand("idle", decode=12, prefill=16),  # load 12 + 1 = 13
    ]
    assert {select(cands, cfg, seed=s).worker for s in range(10)} == {("idle", 0)}
    assert select(cands).worker == ("cached", 0)  # kv mode prefers the cache


def test_unknown_mode_is_rejected() -> None:
    with pytest.raises(ValueError):
        RoutingConfig.dynamo(mode="sticky")


def test_ledger_rows_carry_the_same_terms_as_the_decision() -> None:
    """What RequestRouted.candidates records equals the cost terms the selector used."""
    import random as _random

    from replicas.core.selection import Candidate, RoutingConfig, Selector

    cands = [Candidate(("a", 0), 3, 10, 40, 7, 2, 100, 8192),
             Candidate(("b", 0), 0, 5, 0, 1, 5, 100, 8192, weight=0.5)]
    for q in (None, 1.0):
        cfg = RoutingConfig.dynamo(kv_overlap_score_weight=2.0, prefill_queue_weight=q)
        d = Selector(cfg).select(cands, 80, _random.Random(0))
        rows = d.costs.rows()
        assert [(r[0], r[1], r[2], r[3], r[4], r[5], r[6]) for r in rows] == [
            (t.worker[0], t.worker[1], t.overlap_blocks, t.prefill_blocks,
             float(t.decode_blocks), t.cost, t.busy) for t in d.costs]
        assert d.worker == min(d.costs, key=lambda t: t.cost).worker
