"""The simulated engine's KV cache: prefix hits, LRU eviction, pinning, change feed, dump."""

from __future__ import annotations

from workers.kvcache import Block, Cleared, KVCache, Removed, Stored


def _fill_chain(cache: KVCache, hashes: list[int]) -> list[Block]:
    """Allocate and commit a chain as a request would; the blocks stay pinned."""
    blocks = cache.allocate(len(hashes))
    assert blocks is not None
    parent = None
    for i, th in enumerate(hashes):
        blocks[i] = cache.commit(blocks[i], parent, th)
        parent = blocks[i]
    return blocks


def test_prefix_hit_follows_the_chain_and_stops_at_the_first_miss() -> None:
    cache = KVCache(num_blocks=8, block_size=4)
    chain = _fill_chain(cache, [10, 11, 12])
    cache.release(chain)
    assert cache.match_prefix([10, 11, 99]) == chain[:2]
    assert cache.match_prefix([11, 12]) == []  # same hashes, wrong position: no hit
    assert cache.match_prefix([10, 11, 12, 13]) == chain


def test_commit_records_one_stored_chain_with_engine_ids_and_parent() -> None:
    cache = KVCache(num_blocks=8, block_size=4, salt=7)
    chain = _fill_chain(cache, [10, 11])
    (change,) = cache.drain_changes()
    assert change == Stored(None, [(chain[0].block_id, 10), (chain[1].block_id, 11)])
    assert {b.block_id for b in chain}.isdisjoint({10, 11})  # engine ids are not tokens hashes
    more = cache.allocate(1)
    assert more is not None
    cache.commit(more[0], chain[1], 12)
    assert cache.drain_changes() == [Stored(chain[1].block_id, [(more[0].block_id, 12)])]


def test_duplicate_commit_switches_to_the_cached_block_and_frees_the_copy() -> None:
    cache = KVCache(num_blocks=4, block_size=4)
    first = _fill_chain(cache, [10])
    copy = cache.allocate(1)
    assert copy is not None
    held = cache.commit(copy[0], None, 10)
    assert held is first[0] and held.refcount == 2
    assert cache.stats().pinned == 1 and cache.available() == 3
    assert len(cache.drain_changes()) == 1  # only the first commit was announced


def test_lru_eviction_takes_the_least_recently_released_leaf_first() -> None:
    cache = KVCache(num_blocks=4, block_size=4)
    a = _fill_chain(cache, [1, 2])
    b = _fill_chain(cache, [3, 4])
    cache.release(a)  # released first -> evicted first, deepest first
    cache.release(b)
    cache.drain_changes()
    assert cache.eviction_order() == [a[1].block_id, a[0].block_id, b[1].block_id,
                                      b[0].block_id]
    got = cache.allocate(1)
    assert got is not None
    assert cache.drain_changes() == [Removed([a[1].block_id])]
    assert cache.match_prefix([1, 2]) == [a[0]]  # the parent survives its evicted child


def test_a_hit_refreshes_recency() -> None:
    cache = KVCache(num_blocks=4, block_size=4)
    a = _fill_chain(cache, [1])
    b = _fill_chain(cache, [2])
    cache.release(a)
    cache.release(b)
    hit = cache.match_prefix([1])
    cache.pin(hit)
    cache.release(hit)  # `a` is now the most recently used
    assert cache.eviction_order() == [b[0].block_id, a[0].block_id]


def test_pinned_blocks_are_never_evicted() -> None:
    cache = KVCache(num_blocks=3, block_size=4)
    pinned = _fill_chain(cache, [1, 2])
    assert cache.allocate(2) is None  # only one block is free; pinned ones are off limits
    got = cache.allocate(1)
    assert got is not None
    assert cache.allocate(1) is None
    assert all(cache.is_cached(b.block_id) for b in pinned)
    cache.release(got)
    cache.release(pinned)
    assert cache.allocate(3) is not None  # once released they can go
    removed = [c for c in cache.drain_changes() if isinstance(c, Removed)]
    assert removed == [Removed([pinned[1].block_id, pinned[0].block_id])]


def test_shared_prefix_is_freed_only_by_its_last_holder() -> None:
    cache = KVCache(num_blocks=4, block_size=4)
    a = _fill_chain(cache, [1, 2])
    hit = cache.match_prefix([1])
    cache.pin(hit)
    cache.release(a)
    assert cache.eviction_order() == [a[1].block_id]
    cache.release(hit)
    assert cache.eviction_order() == [a[1].block_id, a[0].block_id]


def test_dump_is_cleared_then_chains_parent_first() -> None:
    cache = KVCache(num_blocks=8, block_size=4)
    a = _fill_chain(cache, [1, 2, 3])
    branch = cache.allocate(1)
    assert branch is not None
    b = cache.commit(branch[0], a[0], 9)
    other = _fill_chain(cache, [5])
    dump = cache.dump()
    assert dump[0] == Cleared()
    assert dump[1:] == [
        Stored(None, [(a[0].block_id, 1), (a[1].block_id, 2), (a[2].block_id, 3)]),
        Stored(a[0].block_id, [(b.block_id, 9)]),
        Stored(None, [(other[0].block_id, 5)]),
    ]
