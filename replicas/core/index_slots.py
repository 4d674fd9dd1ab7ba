"""The bookkeeping both forms of the prefix index keep alike (``index_reference.py``, the
reference; ``index.py``, the compact form): worker slots, event counters, the digest over each
slot's membership sum, and approximate mode's expiry heap.

Nothing here decides where a block is held or what a query matches: each form keeps its own
tables and answers (its property tests compare the two), and fills in the hooks below. Pure: the
event time arrives as an argument.

Expiry uses a heap with lazy deletion: a refreshed or dropped entry leaves its old heap item in
place, and popping skips items whose expiry no longer matches the live map; the heap is rebuilt
from the live map when it grows four times larger (``store_routed`` of each form says when).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from itertools import repeat
from operator import neg

from eventlog.hashing import MASK64
from replicas.core.index_common import LiveRows, WorkerKey, worker_weight


class WorkerSlots:
    """Base of both ``PrefixIndex`` forms: one slot per worker key, reused lowest first."""

    def __init__(
        self,
        *,
        approximate: bool = False,
        ttl_secs: float = 120.0,
        max_tree_size: int = 2**20,
        prune_target_ratio: float = 0.8,
    ) -> None:
        self.approximate = approximate
        self.ttl_secs = float(ttl_secs)
        self.max_tree_size = int(max_tree_size)
        self.prune_target_ratio = float(prune_target_ratio)
        self.counters: dict[tuple[str, str], int] = {}
        self._slots: dict[WorkerKey, int] = {}
        self._keys: list[WorkerKey | None] = []  # slot -> worker key
        self._free: list[int] = []  # released slots (heap: lowest reused first)
        self._dups: list[dict[int, int]] = []  # slot -> {seq: block ids beyond the first}
        self._sums: list[int] = []  # slot -> sum of membership mixes (mod 2**64, lazily)
        self._weights: list[int] = []  # slot -> digest weight of its worker key
        self._total = 0
        self._sizes_cache: dict[WorkerKey, int] | None = None
        self._columns_cache: LiveRows | None = None
        # bumped whenever a slot's block count may change / a slot changes hands
        self._sizes_epoch = self._slots_epoch = 0
        # approximate mode: (slot, seq) -> (expiry, depth); heap of (expiry, -depth, id, rank, seq)
        self._expiry: dict[tuple[int, int], tuple[float, int]] = {}
        self._heap: list[tuple[float, int, str, int, int]] = []

    # --- what each form fills in -------------------------------------------------------------

    def _open_slot(self, slot: int, fresh: bool) -> None:
        """Give ``slot`` its form's empty tables (``fresh``: a slot never used, to append)."""
        raise NotImplementedError

    def _empty_slot(self, slot: int) -> None:
        """Drop a freed slot's form tables."""
        raise NotImplementedError

    def _clear_slot(self, slot: int) -> None:
        """Forget everything the slot holds and free it."""
        raise NotImplementedError

    def _drop_entry(self, slot: int, seq: int) -> None:
        """Approximate mode: drop the block ``seq`` names in ``slot`` (expired or pruned)."""
        raise NotImplementedError

    def plain_encoder(self, *, copy: bool = True) -> Callable[[], dict[str, object]]:
        """Capture the index now; the returned function builds its plain form later."""
        raise NotImplementedError

    # --- slots and counters ------------------------------------------------------------------

    def _count(self, event_type: str, status: str, n: int = 1) -> None:
        key = (event_type, status)
        self.counters[key] = self.counters.get(key, 0) + n

    def _slot_for(self, worker: WorkerKey) -> int:
        slot = self._slots.get(worker)
        if slot is not None:
            return slot
        worker = (str(worker[0]), int(worker[1]))
        if self._free:
            slot = heapq.heappop(self._free)
            self._keys[slot] = worker
            self._weights[slot] = worker_weight(worker)
            self._open_slot(slot, False)
        else:
            slot = len(self._keys)
            self._keys.append(worker)
            self._dups.append({})
            self._sums.append(0)
            self._weights.append(worker_weight(worker))
            self._open_slot(slot, True)
        self._slots[worker] = slot
        self._slots_epoch += 1
        return slot

    def _free_slot(self, slot: int) -> None:
        worker = self._keys[slot]
        assert worker is not None
        del self._slots[worker]
        self._keys[slot] = None
        self._dups[slot] = {}
        self._sums[slot] = 0
        self._empty_slot(slot)
        heapq.heappush(self._free, slot)
        self._slots_epoch += 1

    def _sizes_changed(self) -> None:
        self._sizes_cache = None
        self._sizes_epoch += 1

    def clear(self, worker: WorkerKey) -> None:
        """Apply AllBlocksCleared for one dp rank of a worker."""
        slot = self._slots.get(worker)
        if slot is not None:
            self._sizes_changed()
            self._clear_slot(slot)
        self._count("cleared", "ok")

    def remove_worker(self, worker_id: str) -> None:
        """Forget every dp rank of a worker (retired or lost)."""
        for worker, slot in sorted(self._slots.items()):
            if worker[0] == worker_id:
                self._sizes_changed()
                self._clear_slot(slot)

    def to_plain(self) -> dict[str, object]:
        """Lists/dicts/ints/strs/floats/bytes only (msgspec-encodable), deterministic."""
        return self.plain_encoder(copy=False)()

    @property
    def total_blocks(self) -> int:
        """Block ids held, summed over worker keys."""
        return self._total

    @property
    def digest(self) -> int:
        """Order-independent digest of every (worker key, block_hash, seq hash) membership."""
        total = 0
        for slot, worker in enumerate(self._keys):
            if worker is not None:
                total += self._weights[slot] * (self._sums[slot] & MASK64)
        return total & MASK64

    # --- approximate mode's expiry heap ------------------------------------------------------

    def _pop_live(self, until: float | None = None) -> tuple[int, int] | None:
        """Pop the earliest heap entry that is still current (and expires at or before ``until``
        when given); stale entries (refreshed or already dropped) are discarded on the way."""
        heap = self._heap
        while heap and (until is None or heap[0][0] <= until):
            expires, _neg_depth, worker_id, dp_rank, seq = heapq.heappop(heap)
            slot = self._slots.get((worker_id, dp_rank))
            if slot is None:
                continue
            current = self._expiry.get((slot, seq))
            if current is None or current[0] != expires:
                continue
            return slot, seq
        return None

    def expire(self, now: float) -> int:
        """Drop approximate-mode entries whose expiry is at or before event time ``now``."""
        dropped = 0
        while (entry := self._pop_live(now)) is not None:
            self._drop_entry(*entry)
            dropped += 1
        if dropped:
            self._sizes_changed()
            self._count("expired", "ok", dropped)
        return dropped

    def _prune(self) -> None:
        target = int(self.max_tree_size * self.prune_target_ratio)
        pruned = 0
        while self._total > target:
            entry = self._pop_live()
            if entry is None:
                break
            self._drop_entry(*entry)
            pruned += 1
        self._count("pruned", "ok", pruned)

    def _compact_heap(self) -> None:
        keys = self._keys
        self._heap = [
            (expires, -depth, *keys[slot], seq)  # type: ignore[misc]
            for (slot, seq), (expires, depth) in self._expiry.items()
        ]
        heapq.heapify(self._heap)

    def _restore_expiry(self, worker: WorkerKey, seqs: list[int], expires: list[float],
                        depths: list[int]) -> None:
        """The expiry entries and heap rows of one restored worker key (heapify after all)."""
        slot = self._slots[worker]
        self._expiry.update(zip(zip(repeat(slot), seqs), zip(expires, depths, strict=True),
                                strict=False))  # repeat() is endless
        self._heap.extend(zip(expires, map(neg, depths), repeat(worker[0]), repeat(worker[1]),
                              seqs, strict=False))
