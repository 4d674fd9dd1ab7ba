"""Approximate mode of the compact prefix index: blocks recorded from routing decisions, with a TTL.

Without KV events (``--no-router-kv-events``) the index is filled from ``RequestRouted`` instead:
``store_routed`` records a routed prompt's sequence hashes as blocks the worker will hold until
``now + ttl_secs`` (event time, never a clock), with the sequence hash standing in for the engine's
block id. Entries expire by event time, and past ``max_tree_size`` the soonest-expiring, deepest
entries are pruned down to ``prune_target_ratio`` of it, through the expiry heap both index forms
share (``index_slots.py``). The live map and heap hold Python objects, which is fine here:
approximate mode is bounded by ``max_tree_size`` (2**20 by default).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from replicas.core.index_common import U64, WorkerKey
from replicas.core.index_slots import WorkerSlots
from replicas.core.index_table import U64Table


class ApproximateMode(WorkerSlots):
    """The compact ``PrefixIndex``'s base: its approximate mode; the tables are the index's."""

    _blocks: list[U64Table]

    def _add(self, slot: int, block_hashes: np.ndarray, seqs: np.ndarray) -> None:
        raise NotImplementedError

    def _drop1(self, slot: int, block_hash: int, seq: int, cell: int) -> None:
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

    def _drop_entry(self, slot: int, seq: int) -> None:
        table = self._blocks[slot]
        cell = table.find1(seq)
        self._expiry.pop((slot, seq), None)
        if cell >= 0:
            self._drop1(slot, seq, table.mv[cell], cell)
