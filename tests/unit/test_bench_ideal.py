"""The ideal (global LRU) prefix hit rate, checked against hand-computed traces."""

from __future__ import annotations

import pytest

from bench.ideal import cluster_capacity_blocks, ideal_hit_rate, ideal_rates
from bench.trace import TraceRecord


def rec(*ids: int, tail: int = 512) -> TraceRecord:
    return TraceRecord(0.0, (len(ids) - 1) * 512 + tail, 1, ids)


def test_infinite_cache_counts_prefix_hits_only() -> None:
    trace = [rec(1, 2, 3), rec(1, 2, 4), rec(9, 2, 3)]
    result = ideal_hit_rate(trace, None)
    # r0: 0 hits; r1: 1,2 hit then 4 misses; r2: 9 misses first -> 2,3 do not count
    assert (result.hit_blocks, result.total_blocks) == (2, 9)
    assert result.block_rate == pytest.approx(2 / 9)


def test_lru_eviction_with_small_capacity() -> None:
    # capacity 3. Touch order within a request is last-to-first, so the head is most recent.
    trace = [
        rec(1, 2),        # miss, miss            cache (LRU->MRU): 2 1
        rec(3, 4),        # miss, miss            cache: 1 4 3 (2 evicted)
        rec(1, 2),        # 1 hit, 2 miss -> 1    cache: 4 3 2 1 -> evict 4: 3 2 1
        rec(3, 4),        # 3 hit, 4 miss -> 1    cache: 2 1 4 3 -> evict 2: 1 4 3
        rec(1, 5),        # 1 hit -> 1            cache: 4 3 5 1 -> evict 4: 3 5 1
        rec(3, 4),        # 3 hit, 4 miss -> 1
    ]
    result = ideal_hit_rate(trace, 3)
    assert result.hit_blocks == 4
    assert result.total_blocks == 12
    assert ideal_hit_rate(trace, None).hit_blocks == 7  # 2 + 2 + 1 + 2
    assert ideal_hit_rate(trace, 0).hit_blocks == 0


def test_token_rate_weights_partial_tails() -> None:
    trace = [rec(1, 2, tail=100), rec(1, 2, tail=100)]
    result = ideal_hit_rate(trace, None)
    assert result.hit_tokens == 612 and result.total_tokens == 1224
    assert result.token_rate == pytest.approx(0.5)


def test_ideal_rates_and_capacity_conversion() -> None:
    assert set(ideal_rates([rec(1)], None)) == {"infinite"}
    assert set(ideal_rates([rec(1)], 10)) == {"infinite", "finite"}
    # 8 workers x 2000 blocks x 16 tokens / 32 tokens per trace block = 8000 trace blocks
    assert cluster_capacity_blocks(workers=8, gpu_blocks_per_worker=2000, engine_block_size=16,
                                   trace_block_tokens=32) == 8000
    with pytest.raises(ValueError):
        ideal_hit_rate([rec(1)], -1)
