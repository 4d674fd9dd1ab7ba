"""The ideal prefix hit rate of a trace: what one perfect, global cache would achieve.

A router spreads requests over workers that each hold a slice of the fleet's cache; the best it can
ever do is as if every worker's blocks formed one LRU cache shared by all requests. Computed
offline, in trace-block units (one block per hash id), with prefix semantics: a request's hits are
its leading blocks already cached, stopping at the first miss (an engine cannot reuse a block whose
parent it must recompute). The infinite-cache figure is the trace's reuse ceiling.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bench.trace import TRACE_BLOCK_SIZE, TraceRecord


@dataclass(frozen=True, slots=True)
class IdealHitRate:
    capacity_blocks: int | None     # None = infinite cache
    hit_blocks: int
    total_blocks: int
    hit_tokens: int                 # trace tokens covered by hit blocks (partial tails count less)
    total_tokens: int

    @property
    def block_rate(self) -> float:
        return self.hit_blocks / self.total_blocks if self.total_blocks else 0.0

    @property
    def token_rate(self) -> float:
        return self.hit_tokens / self.total_tokens if self.total_tokens else 0.0

    def to_json(self) -> dict[str, Any]:
        return {"capacity_blocks": self.capacity_blocks, "hit_blocks": self.hit_blocks,
                "total_blocks": self.total_blocks, "block_rate": self.block_rate,
                "hit_tokens": self.hit_tokens, "total_tokens": self.total_tokens,
                "token_rate": self.token_rate}


def _block_tokens(record: TraceRecord, i: int) -> int:
    """Trace tokens in block ``i`` of a record: 512, except a shorter last block."""
    n = len(record.hash_ids)
    if i < n - 1:
        return TRACE_BLOCK_SIZE
    return min(max(record.input_length - (n - 1) * TRACE_BLOCK_SIZE, 0), TRACE_BLOCK_SIZE)


def ideal_hit_rate(records: Sequence[TraceRecord], capacity_blocks: int | None) -> IdealHitRate:
    """Replay ``records`` in order through one LRU cache of ``capacity_blocks`` trace blocks."""
    if capacity_blocks is not None and capacity_blocks < 0:
        raise ValueError("capacity_blocks must be >= 0")
    cache: OrderedDict[int, None] = OrderedDict()
    hit_blocks = total_blocks = hit_tokens = total_tokens = 0
    for record in records:
        hashes = record.hash_ids
        total_blocks += len(hashes)
        total_tokens += sum(_block_tokens(record, i) for i in range(len(hashes)))
        for i, h in enumerate(hashes):
            if h not in cache:
                break
            hit_blocks += 1
            hit_tokens += _block_tokens(record, i)
        if capacity_blocks == 0:
            continue
        # Touch the request's blocks last-to-first so its first block ends most recently used:
        # under pressure a prefix's tail is evicted before its head, as engines free blocks.
        for h in reversed(hashes):
            if h in cache:
                cache.move_to_end(h)
            else:
                cache[h] = None
        if capacity_blocks is not None:
            while len(cache) > capacity_blocks:
                cache.popitem(last=False)
    return IdealHitRate(capacity_blocks, hit_blocks, total_blocks, hit_tokens, total_tokens)


def ideal_rates(records: Sequence[TraceRecord],
                capacity_blocks: int | None) -> dict[str, IdealHitRate]:
    """``{"infinite": ..., "finite": ...}`` (finite only when a capacity is known)."""
    out = {"infinite": ideal_hit_rate(records, None)}
    if capacity_blocks is not None:
        out["finite"] = ideal_hit_rate(records, capacity_blocks)
    return out


def cluster_capacity_blocks(*, workers: int, gpu_blocks_per_worker: int, engine_block_size: int,
                            trace_block_tokens: int) -> int:
    """Total cache of a fleet, converted from engine blocks to trace blocks."""
    return workers * gpu_blocks_per_worker * engine_block_size // trace_block_tokens
