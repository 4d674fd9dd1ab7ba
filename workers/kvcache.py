"""The simulated engine's paged KV cache with prefix caching (vLLM-like).

A fixed pool of ``num_blocks`` blocks. A full block whose KV has been computed is *committed*: it
gets an engine block id and becomes findable by its position in a chain, keyed by
``(parent block id, tokens_hash)``, so a later prompt with the same prefix reuses it. Blocks held
by running requests are pinned (refcounted). Unpinned committed blocks stay cached and are evicted
least-recently-released first when space is needed.

Eviction order keeps every cached chain whole: a request releases its blocks deepest first, and a
prefix hit pins (and later re-releases) a chain from its root, so in the eviction queue each block
comes after all its cached descendants. Hence the evicted block is always a leaf and a parent is
never removed while a child is still cached.

Block ids are a salted hash of a per-engine counter: deliberately unrelated to the router's
hashes, so the router can only know a block by the ``tokens_hash`` published with it.

Every change to the set of cached blocks is recorded as a :data:`KvChange`; the engine drains them
once per scheduler step and the publisher turns them into ``BlocksStored`` / ``BlocksRemoved``.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import xxhash


@dataclass(frozen=True, slots=True)
class Stored:
    parent_id: int | None
    blocks: list[tuple[int, int]]  # (engine block id, tokens_hash), parent first


@dataclass(frozen=True, slots=True)
class Removed:
    block_ids: list[int]


@dataclass(frozen=True, slots=True)
class Cleared:
    pass


KvChange = Stored | Removed | Cleared


@dataclass(eq=False, slots=True)
class Block:
    """One physical block. ``block_id``/``tokens_hash`` are set once it is committed."""

    block_id: int = 0
    tokens_hash: int = 0
    parent_id: int | None = None
    refcount: int = 0
    committed: bool = False


@dataclass(slots=True)
class CacheStats:
    total: int
    pinned: int
    cached: int
    free: int  # never-committed free blocks + evictable cached blocks


@dataclass
class KVCache:
    num_blocks: int
    block_size: int
    salt: int = 0
    _free_plain: int = field(init=False)
    _evictable: OrderedDict[int, Block] = field(init=False, default_factory=OrderedDict)
    _by_key: dict[tuple[int | None, int], Block] = field(init=False, default_factory=dict)
    _committed: dict[int, Block] = field(init=False, default_factory=dict)
    _pinned: int = field(init=False, default=0)
    _counter: int = field(init=False, default=0)
    _changes: list[KvChange] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        if self.num_blocks < 1 or self.block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self._free_plain = self.num_blocks

    # --- queries ----------------------------------------------------------------------------

    def match_prefix(self, tokens_hashes: list[int]) -> list[Block]:
        """The longest run of committed blocks chaining ``tokens_hashes`` from the root."""
        out: list[Block] = []
        parent: int | None = None
        for th in tokens_hashes:
            block = self._by_key.get((parent, th))
            if block is None:
                break
            out.append(block)
            parent = block.block_id
        return out

    def available(self) -> int:
        """Blocks an allocation could get now (free ones plus evictable cached ones)."""
        return self._free_plain + len(self._evictable)

    def stats(self) -> CacheStats:
        return CacheStats(self.num_blocks, self._pinned, len(self._committed), self.available())

    def eviction_order(self) -> list[int]:
        """Ids of evictable blocks, next victim first (for tests and debugging)."""
        return list(self._evictable)

    def is_cached(self, block_id: int) -> bool:
        return block_id in self._committed

    # --- pin / allocate / release ---------------------------------------------------------

    def pin(self, blocks: list[Block]) -> None:
        for block in blocks:
            if block.refcount == 0:
                self._pinned += 1
                if block.committed:
                    self._evictable.pop(block.block_id, None)
            block.refcount += 1

    def allocate(self, n: int) -> list[Block] | None:
        """``n`` fresh pinned blocks, evicting cached ones LRU-first; None if they do not fit."""
        if n <= 0:
            return []
        if n > self.available():
            return None
        from_plain = min(n, self._free_plain)
        self._free_plain -= from_plain
        evicted: list[int] = []
        for _ in range(n - from_plain):
            block_id, block = self._evictable.popitem(last=False)
            self._forget(block)
            evicted.append(block_id)
        if evicted:
            self._changes.append(Removed(evicted))
        self._pinned += n
        return [Block(refcount=1) for _ in range(n)]

    def release(self, blocks: list[Block]) -> None:
        """Unpin a request's blocks, deepest first (so chains are evicted leaf-first)."""
        for block in reversed(blocks):
            block.refcount -= 1
            if block.refcount > 0:
                continue
            self._pinned -= 1
            if block.committed:
                self._evictable[block.block_id] = block
            else:
                self._free_plain += 1

    def commit(self, block: Block, parent: Block | None, tokens_hash: int) -> Block:
        """Register a full, computed, pinned block; returns the block the request now holds.

        If an identical chain position is already cached (another request computed it first),
        the request switches to that block and its own copy is freed: never two copies.
        """
        parent_id = parent.block_id if parent is not None else None
        existing = self._by_key.get((parent_id, tokens_hash))
        if existing is not None:
            if existing is not block:
                self.pin([existing])
                self.release([block])
            return existing
        self._counter += 1
        block.block_id = xxhash.xxh3_64_intdigest(self._counter.to_bytes(8, "little"),
                                                  seed=self.salt)
        block.tokens_hash = tokens_hash
        block.parent_id = parent_id
        block.committed = True
        self._by_key[(parent_id, tokens_hash)] = block
        self._committed[block.block_id] = block
        last = self._changes[-1] if self._changes else None
        if isinstance(last, Stored) and last.blocks and last.blocks[-1][0] == parent_id:
            last.blocks.append((block.block_id, tokens_hash))
        else:
            self._changes.append(Stored(parent_id, [(block.block_id, tokens_hash)]))
        return block

    def _forget(self, block: Block) -> None:
        del self._committed[block.block_id]
        del self._by_key[(block.parent_id, block.tokens_hash)]
        block.committed = False

    # --- change feed ------------------------------------------------------------------------

    def drain_changes(self) -> list[KvChange]:
        out, self._changes = self._changes, []
        return out

    def dump(self) -> list[KvChange]:
        """The whole cache as ``Cleared`` + ``Stored`` chains, parents before children.

        Committed blocks are kept in commit order and a parent is always committed before its
        child (and outlives it), so a single pass in that order preserves parent order.
        """
        out: list[KvChange] = [Cleared()]
        current: Stored | None = None
        for block in self._committed.values():
            pair = (block.block_id, block.tokens_hash)
            if current is not None and current.blocks[-1][0] == block.parent_id:
                current.blocks.append(pair)
            else:
                current = Stored(block.parent_id, [pair])
                out.append(current)
        return out
