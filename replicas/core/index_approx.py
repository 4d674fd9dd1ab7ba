"""Approximate mode of the prefix index: blocks recorded from routing decisions, with a TTL.

Without KV events (``--no-router-kv-events``) the index is filled from ``RequestRouted`` instead:
``store_routed`` records a routed prompt's sequence hashes as blocks the worker will hold until
``now + ttl_secs`` (event time, never a clock), with the sequence hash standing in for the engine's
block id. Entries expire by event time, and past ``max_tree_size`` the soonest-expiring, deepest
entries are pruned down to ``prune_target_ratio`` of it.

Expiry uses a heap with lazy deletion: a refreshed or dropped entry leaves its old heap item in
place, and popping skips items whose expiry no longer matches the live map; the heap is rebuilt
from the live map when it grows four times larger. The live map and heap hold Python objects,
which is fine here: approximate mode is bounded by ``max_tree_size`` (2**20 by default).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from itertools import repeat
from operator import neg

import numpy as np

from replicas.core.index_common import U64, WorkerKey
from replicas.core.index_table import U64Table


class ApproximateMode:
    """Mixed into ``PrefixIndex``; the attributes below are the index's."""

    approximate: bool
    ttl_secs: float
    max_tree_size: int
    prune_target_ratio: float
    counters: dict[tuple[str, str], int]
    _slots: dict[WorkerKey, int]
    _keys: list[WorkerKey | None]
    _blocks: list[U64Table]
    _total: int
    # (slot, seq) -> (expiry, depth); heap of (expiry, -depth, worker id, dp rank, seq)
    _expiry: dict[tuple[int, int], tuple[float, int]]
    _heap: list[tuple[float, int, str, int, int]]

    def _slot_for(self, worker: WorkerKey) -> int:
        raise NotImplementedError

    def _sizes_changed(self) -> None:
        raise NotImplementedError

    def _add(self, slot: int, block_hashes: np.ndarray, seqs: np.ndarray) -> None:
        raise NotImplementedError

    def _drop1(self, slot: int, block_hash: int, seq: int, cell: int) -> None:
        raise NotImplementedError

    def _count(self, event_type: str, status: str, n: int = 1) -> None:
        raise NotImplementedError

    def store_routed(self, worker: WorkerKey, seq_hashes: Sequence[int], now: float) -> None:
        """Record a routing decision as blocks the worker will hold until ``now + ttl_secs``."""
        self.expire(now)
        if not seq_hashes:
            return
        self._sizes_changed()
        slot = self._slot_for(worker)
        seqs = np.array(list(dict.fromkeys(seq_hashes)), dtype=U64)
        new = self._blocks[slot].find(seqs) < 0
        self._add(slot, seqs[new], seqs[new])  # no engine id here: the seq names the block
        expires = now + self.ttl_secs
        worker_id, dp_rank = self._keys[slot]  # type: ignore[misc]
        expiry_map, heap = self._expiry, self._heap
        for depth, seq in enumerate(seq_hashes, 1):
            expiry_map[(slot, seq)] = (expires, depth)
            heapq.heappush(heap, (expires, -depth, worker_id, dp_rank, seq))
        if self._total > self.max_tree_size:
            self._prune()
        if len(heap) > 4 * max(len(expiry_map), 1024):
            self._compact_heap()

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

    def _drop_entry(self, slot: int, seq: int) -> None:
        table = self._blocks[slot]
        cell = table.find1(seq)
        self._expiry.pop((slot, seq), None)
        if cell >= 0:
            self._drop1(slot, seq, table.mv[cell], cell)

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
        slot = self._slots[worker]
        self._expiry.update(zip(zip(repeat(slot), seqs), zip(expires, depths, strict=True),
                                strict=False))  # repeat() is endless
        self._heap.extend(zip(expires, map(neg, depths), repeat(worker[0]), repeat(worker[1]),
                              seqs, strict=False))
