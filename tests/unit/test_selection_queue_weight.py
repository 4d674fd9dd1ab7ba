"""RoutingConfig.prefill_queue_weight: the overlap weight prices cache hits, not the queue."""

from __future__ import annotations

import random

import pytest

from replicas.core.selection import Candidate, Decision, RoutingConfig, Selector, cost_terms

BS = 16
ISL = 40 * BS  # a 40-block prompt


def cand(worker: str, *, overlap: int = 0, prefill: int = 0, decode: int = 0,
         new: int = 40) -> Candidate:
    return Candidate(worker=(worker, 0), overlap_blocks=overlap, tree_size=0,
                     active_prefill_tokens=prefill, active_decode_blocks=decode,
                     new_request_blocks=new, kv_total_blocks=4000, max_num_batched_tokens=8192)


def busy_cached_vs_idle() -> list[Candidate]:
    """'cached' holds 30 of the 40 blocks but is prefilling another 40-block request (40 blocks
    queued, 40 decode blocks); 'idle' holds only the shared first block and nothing runs there."""
    return [cand("cached", overlap=30, prefill=40 * BS, decode=40),
            cand("idle", overlap=2)]


def pick(cands: list[Candidate], **cfg: float | None) -> str:
    d = Selector(RoutingConfig.dynamo(block_size=BS, **cfg)).select(cands, ISL, random.Random(0))  # type: ignore[arg-type]
    assert isinstance(d, Decision)
    return d.worker[0]


def test_default_is_dynamos_formula_where_a_higher_weight_also_scales_the_queue() -> None:
    # cached: w*(40+10) + 80 ; idle: w*38 + 40. The weight cannot make the cache win.
    for w in (1.0, 4.0, 16.0):
        assert pick(busy_cached_vs_idle(), kv_overlap_score_weight=w) == "idle"


def test_split_queue_weight_lets_the_overlap_weight_price_the_hit() -> None:
    # cached: 8*10 + 1*40 + 80 = 200 ; idle: 8*38 + 40 = 344.
    assert pick(busy_cached_vs_idle(), kv_overlap_score_weight=8.0,
                prefill_queue_weight=1.0) == "cached"
    # ... and the queue still counts: a deep enough queue sends the request elsewhere.
    deep = [cand("cached", overlap=30, prefill=400 * BS, decode=40), cand("idle", overlap=2)]
    assert pick(deep, kv_overlap_score_weight=8.0, prefill_queue_weight=1.0) == "idle"


def test_queue_weight_equal_to_overlap_weight_is_the_default_formula() -> None:
    rng = random.Random(7)
    for _ in range(200):
        c = cand("w", overlap=rng.randrange(0, 45), prefill=rng.randrange(0, 5000),
                 decode=rng.randrange(0, 300), new=rng.randrange(0, 41))
        w = rng.choice([0.5, 1.0, 3.0])
        a = cost_terms(c, ISL, w, BS)
        b = cost_terms(c, ISL, w, BS, queue_weight=w)
        assert a.cost == pytest.approx(b.cost)
        assert (a.prefill_blocks, a.decode_blocks) == (b.prefill_blocks, b.decode_blocks)


def test_ledger_rows_use_the_same_formula_as_the_pick() -> None:
    cands = busy_cached_vs_idle()
    d = Selector(RoutingConfig.dynamo(block_size=BS, kv_overlap_score_weight=8.0,
                               prefill_queue_weight=1.0)).select(cands, ISL, random.Random(0))
    assert isinstance(d, Decision)
    rows = {r[0]: r[5] for r in d.costs.rows()}
    assert rows == {"cached": pytest.approx(200.0), "idle": pytest.approx(344.0)}
    assert [t.cost for t in d.costs] == [pytest.approx(200.0), pytest.approx(344.0)]


def test_negative_queue_weight_is_rejected() -> None:
    with pytest.raises(ValueError):
        RoutingConfig.dynamo(prefill_queue_weight=-1.0)
