"""Prefix index: which worker (dp rank) holds which KV blocks, by sequence hash (design.md §5).

Pure and deterministic: no clock (time arrives as arguments taken from events), no randomness.

Compact, columnar form (replicas/core/README.md has the why). Tens of millions of (block, worker)
pairs must fit in tens of bytes each, so nothing here is a Python object per block:

* ``_holders`` — :class:`NodeHolders` (``index_holders.py``): from *sequence hash* to the one
  slot holding the node, or to a bitmap of slots when several hold it.
* ``_blocks[slot]`` — a :class:`U64Table` from the engine's block id to the sequence hash, for
  removals and for the parent of a later store.
* ``_dups[slot]`` — the rare nodes one worker holds under several block ids (a small dict).

An event of more than ``small_event`` blocks is applied as a fixed handful of numpy calls over
all its blocks; shorter ones, and any batch that needs the exact block-by-block order (an id
reused for other content, or the same id or content twice in one event), one block at a time in
plain Python over the tables' memoryviews. Both give the same result.

Membership is *flat*: a node is held by a worker exactly while the worker holds that block,
whatever it holds of its ancestors; a query walks the prompt from its first block and stops a
worker's match at the first block it does not hold. This is what the reference form
(``index_reference.py``) answers too; the two are tested against each other.

Counters: ``("stored", "ok" | "parent_block_not_found")`` and ``("removed", "ok")`` count events,
``("removed", "block_not_found")`` counts unknown block hashes, ``("cleared", "ok")`` counts clears,
``("expired", "ok")`` / ``("pruned", "ok")`` count approximate-mode entries dropped.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from itertools import chain
from typing import Any

import numpy as np

from eventlog.hashing import CHAIN_MULTIPLIER, MASK64
from replicas.core import index_arrays, index_arrays_legacy, index_capture, index_kernel, index_run
from replicas.core.index_approx import ApproximateMode
from replicas.core.index_capture import IndexCapture
from replicas.core.index_codec import read_expiry, read_plain
from replicas.core.index_common import (
    U64,
    LiveRows,
    MatchColumns,
    OverlapScores,
    WorkerKey,
    live_rows,
    membership_mix,
    mix_sum,
)
from replicas.core.index_holders import NodeHolders
from replicas.core.index_run import REMOVE, STORE, KvOp, RunResult
from replicas.core.index_table import U64Table

__all__ = ["OverlapScores", "PrefixIndex", "WorkerKey"]

# A worker's block table starts with 2**7 buckets (1,024 cells, ~18 KB; ~870 blocks before it
# first doubles): an engine that stores holds thousands of blocks, and each doubling of a small
# table is a fixed ~30 us of numpy calls, most of applying a fresh worker's first events.
_SLOT_TABLE_BITS = 7

class _Powers:
    """``P**i`` and ``P**-i`` mod 2**64 for the chain multiplier ``P`` (odd, so invertible)."""

    up = np.ones(1, dtype=U64)
    down = np.ones(1, dtype=U64)

    @classmethod
    def get(cls, n: int) -> tuple[np.ndarray, np.ndarray]:
        if len(cls.up) < n:
            size = max(n, 2 * len(cls.up))
            p, q = CHAIN_MULTIPLIER, pow(CHAIN_MULTIPLIER, -1, 2**64)
            up, down = [1] * size, [1] * size
            for i in range(1, size):
                up[i] = (up[i - 1] * p) & MASK64
                down[i] = (down[i - 1] * q) & MASK64
            cls.up, cls.down = np.array(up, dtype=U64), np.array(down, dtype=U64)
        return cls.up[:n], cls.down[:n]


def _chain(parent: int, tokens: np.ndarray) -> np.ndarray:
    """Sequence hashes of a chain under ``parent``: ``s[i] = s[i-1]·P + t[i]`` with
    ``s[-1] = parent``, computed as ``P**i · (parent·P + Σ_{j<=i} t[j]·P**-j)`` (uint64
    arithmetic wraps, so all of it is exact mod 2**64)."""
    up, down = _Powers.get(len(tokens))
    acc = np.cumsum(tokens * down, dtype=U64)
    acc += np.uint64((parent * CHAIN_MULTIPLIER) & MASK64)
    acc *= up
    return acc


class PrefixIndex(ApproximateMode):
    # Events of at most this many blocks apply block by block in plain Python (~3 us a block);
    # longer ones as arrays (a fixed ~100 us of numpy calls, then well under 1 us a block).
    small_event = 24

    def __init__(self, **settings: Any) -> None:
        """``settings``: ``WorkerSlots``'s (approximate mode's and its limits)."""
        super().__init__(**settings)
        self._holders = NodeHolders()
        self._blocks: list[U64Table] = []  # slot -> {block_hash: seq}

    def _open_slot(self, slot: int, fresh: bool) -> None:
        table = U64Table.with_bits(U64, _SLOT_TABLE_BITS)
        if fresh:
            self._blocks.append(table)
            self._holders.widen(slot)
        else:
            self._blocks[slot] = table

    def _empty_slot(self, slot: int) -> None:
        self._blocks[slot] = U64Table(U64)

    # --- membership primitives ---------------------------------------------------------------

    def _add(self, slot: int, block_hashes: np.ndarray, seqs: np.ndarray,
             homes: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        """Add pairs the slot does not hold (distinct ids; distinct seqs); ``homes``: the ids'
        buckets in the slot's block map, from ``find_homes`` just before."""
        n = len(block_hashes)
        if not n:
            return
        self._blocks[slot].insert(block_hashes, seqs, homes)
        self._sums[slot] = (self._sums[slot] + mix_sum(block_hashes, seqs)) & MASK64
        self._total += n
        dup = self._holders.hold(slot, seqs)
        if dup.any():  # held under another block id too: membership unchanged, count the id
            dups = self._dups[slot]
            for seq in seqs[dup].tolist():
                dups[seq] = dups.get(seq, 0) + 1

    def _drop(self, slot: int, block_hashes: np.ndarray, seqs: np.ndarray,
              cells: np.ndarray) -> None:
        """Drop pairs the slot holds at ``cells`` of its block map (distinct ids and seqs)."""
        n = len(block_hashes)
        if not n:
            return
        self._blocks[slot].delete(cells)
        self._sums[slot] = (self._sums[slot] - mix_sum(block_hashes, seqs)) & MASK64
        self._total -= n
        dups = self._dups[slot]
        if dups:  # another block id of this worker still maps to some of these nodes
            keep = np.ones(n, dtype=bool)
            for i, seq in enumerate(seqs.tolist()):
                extra = dups.get(seq)
                if extra:
                    keep[i] = False
                    if extra == 1:
                        del dups[seq]
                    else:
                        dups[seq] = extra - 1
            seqs = seqs[keep]
        self._holders.unhold(slot, seqs)
        if self.approximate:
            for seq in seqs.tolist():
                self._expiry.pop((slot, seq), None)

    def _add1(self, slot: int, block_hash: int, seq: int) -> None:
        """``_add`` of one pair the slot does not hold, in plain Python."""
        self._blocks[slot].insert1(block_hash, seq)
        self._sums[slot] = (self._sums[slot] + membership_mix(block_hash, seq)) & MASK64
        self._total += 1
        if self._holders.hold1(slot, seq):
            dups = self._dups[slot]
            dups[seq] = dups.get(seq, 0) + 1

    def _drop1(self, slot: int, block_hash: int, seq: int, cell: int) -> None:
        """``_drop`` of one pair the slot holds at ``cell`` of its block map."""
        self._blocks[slot].delete1(cell)
        self._sums[slot] = (self._sums[slot] - membership_mix(block_hash, seq)) & MASK64
        self._total -= 1
        dups = self._dups[slot]
        extra = dups.get(seq) if dups else None
        if extra:  # another block id of this worker still maps to the node
            if extra == 1:
                del dups[seq]
            else:
                dups[seq] = extra - 1
            return
        self._holders.unhold1(slot, seq)
        if self.approximate:
            self._expiry.pop((slot, seq), None)

    def _store1(self, slot: int, block_hash: int, seq: int) -> None:
        """Store one pair, block by block semantics: re-announced, moved, or new."""
        table = self._blocks[slot]
        cell = table.find1(block_hash)
        if cell >= 0:
            was = table.mv[cell]
            if was == seq:
                return  # re-announced: nothing changes
            self._drop1(slot, block_hash, was, cell)  # the engine reused the id: move it
        self._add1(slot, block_hash, seq)

    # --- KV events ---------------------------------------------------------------------------

    def store(
        self,
        worker: WorkerKey,
        parent_block_hash: int | None,
        blocks: Sequence[tuple[int, int]],
    ) -> str:
        """Apply a BlocksStored: ``blocks`` are ``(block_hash, tokens_hash)`` in chain order."""
        kernel = index_kernel.active()
        if kernel is None or self.approximate:
            return self._store_python(worker, parent_block_hash, blocks)
        self._sizes_changed()
        done = kernel.apply_ops(self, [(STORE, worker, parent_block_hash, blocks)], 0)
        if not done:  # a number the kernel does not take on: Python's error or result
            return self._store_python(worker, parent_block_hash, blocks)
        status: str = done[0]
        self._count("stored", status)
        return status

    def _python_op(self, op: KvOp) -> RunResult:
        kind, worker, a, b = op
        return self._store_python(worker, a, b) if kind == STORE else self._remove_python(worker, a)

    def _store_python(self, worker: WorkerKey, parent_block_hash: int | None,
                      blocks: Sequence[tuple[int, int]]) -> str:
        """``store`` in Python: the reference the compiled kernel (``_fastindex.c``) follows."""
        if parent_block_hash is None:
            slot = self._slot_for(worker)
            parent = 0  # chain_hash(0, t) == t: a root block's sequence hash is its tokens_hash
        else:
            slot = self._slots.get(worker, -1)
            cell = self._blocks[slot].find1(parent_block_hash) if slot >= 0 else -1
            if cell < 0:
                self._count("stored", "parent_block_not_found")
                return "parent_block_not_found"
            parent = self._blocks[slot].mv[cell]
        self._sizes_changed()
        n = len(blocks)
        if n <= self.small_event:
            mult, mask64 = CHAIN_MULTIPLIER, MASK64
            for block_hash, tokens_hash in blocks:
                parent = (parent * mult + tokens_hash) & mask64
                self._store1(slot, block_hash, parent)
        else:
            pairs = np.fromiter(chain.from_iterable(blocks), dtype=U64, count=2 * n)
            ids = pairs[0::2]
            self._store_pairs(slot, ids, _chain(parent, pairs[1::2]))
        self._count("stored", "ok")
        return "ok"

    def _store_pairs(self, slot: int, ids: np.ndarray, seqs: np.ndarray) -> None:
        table = self._blocks[slot]
        ordered = np.sort(np.stack((ids, seqs)), axis=1)
        if not (ordered[:, 1:] == ordered[:, :-1]).any():  # distinct ids, distinct nodes
            cells, homes = table.find_homes(ids)
            held = cells >= 0
            if not held.any():
                self._add(slot, ids, seqs, homes)
                return
            if (table.vals.reshape(-1)[cells[held]] == seqs[held]).all():
                new = ~held  # the held ones are re-announced: nothing changes for them
                self._add(slot, ids[new], seqs[new])
                return
        # An id reused for other content, or an id or node twice in one event: block by block.
        for block_hash, seq in zip(ids.tolist(), seqs.tolist(), strict=True):
            self._store1(slot, block_hash, seq)

    def remove(self, worker: WorkerKey, block_hashes: Sequence[int]) -> int:
        """Apply a BlocksRemoved; returns how many block hashes were unknown (the rest apply)."""
        kernel = index_kernel.active()
        if kernel is None or self.approximate:
            return self._remove_python(worker, block_hashes)
        self._sizes_changed()
        done = kernel.apply_ops(self, [(REMOVE, worker, block_hashes, None)], 0)
        if not done:
            return self._remove_python(worker, block_hashes)
        unknown: int = done[0]
        self._count("removed", "ok")
        if unknown:
            self._count("removed", "block_not_found", unknown)
        return unknown

    def _remove_python(self, worker: WorkerKey, block_hashes: Sequence[int]) -> int:
        """``remove`` in Python (the kernel's reference)."""
        slot = self._slots.get(worker)
        if slot is None:
            unknown = len(block_hashes)
        else:
            self._sizes_changed()
            unknown = self._remove_from_slot(slot, list(block_hashes))
        self._count("removed", "ok")
        if unknown:
            self._count("removed", "block_not_found", unknown)
        return unknown

    def _remove_from_slot(self, slot: int, ids: list[int]) -> int:
        table = self._blocks[slot]
        if len(ids) > self.small_event and len(set(ids)) == len(ids):
            id_col = np.array(ids, dtype=U64)
            cells = table.find(id_col)
            found = cells >= 0
            cells = cells[found]
            seqs = table.vals.reshape(-1)[cells]
            if len(np.unique(seqs)) == len(seqs):  # distinct nodes too: all at once
                self._drop(slot, id_col[found], seqs, cells)
                return len(ids) - len(cells)
        unknown = 0  # a few ids, or an id or a node twice in one event: block by block
        for block_hash in ids:
            cell = table.find1(block_hash)
            if cell < 0:
                unknown += 1
            else:
                self._drop1(slot, block_hash, table.mv[cell], cell)
        return unknown

    def apply_run(self, ops: Sequence[KvOp]) -> list[RunResult]:
        """Stores and removals (``index_run.KvOp``) in order, as one change to the tables: the
        result of applying them one by one, each op's status or unknown count included. With
        the compiled kernel, one by one is what it does, without a Python call per block."""
        kernel = index_kernel.active()
        if kernel is not None and not self.approximate:
            return index_run.apply_compiled(kernel, self, ops, self._python_op)
        return index_run.apply_run(self, ops)

    def _clear_slot(self, slot: int) -> None:
        table = self._blocks[slot]
        _, seqs = table.items()
        held = np.unique(seqs) if self._dups[slot] else seqs
        self._holders.unhold(slot, held)
        if self.approximate:
            for seq in held.tolist():
                self._expiry.pop((slot, seq), None)
        self._total -= table.size
        self._free_slot(slot)

    # --- queries -----------------------------------------------------------------------------

    def find_matches(self, seq_hashes: Sequence[int]) -> OverlapScores:
        """Matched prefix length (in blocks) of ``seq_hashes`` per worker key, plus tree sizes."""
        slots, lengths = self._match_slots(seq_hashes)
        keys = self._keys
        scores: dict[WorkerKey, int] = dict(zip([keys[s] for s in slots],  # type: ignore[misc]
                                                lengths, strict=True))
        return OverlapScores(scores, dict(self._tree_sizes()))

    def match_columns(self, seq_hashes: Sequence[int]) -> MatchColumns:
        """``find_matches`` as columns (``MatchColumns``)."""
        live, workers, sizes, rows, _, _ = self._live_columns()
        by_slot = np.zeros(len(self._keys), dtype=np.int64)
        kernel = index_kernel.active()
        # the kernel writes each length at its slot (None: a hash it does not take on)
        if kernel is None or kernel.prefix_match(self._holders, seq_hashes, by_slot) is None:
            slots, lengths = self._match_python(seq_hashes)
            by_slot[slots] = lengths
        return MatchColumns(workers, by_slot.take(live), sizes, rows)

    def _match_slots(self, seq_hashes: Sequence[int]) -> tuple[list[int], list[int]]:
        """(slots, match lengths) of the slots holding the query's first block, in order of
        length then slot: the compiled kernel's (``_fastindex_match.c``) when it runs, else
        ``_match_python``'s, the same answer."""
        kernel = index_kernel.active()
        if kernel is not None:
            found: tuple[list[int], list[int]] | None = kernel.prefix_match(self._holders,
                                                                             seq_hashes)
            if found is not None:  # (None: a hash the kernel does not take on)
                return found
        return self._match_python(seq_hashes)

    def _match_python(self, seq_hashes: Sequence[int]) -> tuple[list[int], list[int]]:
        """``_match_slots`` in Python: the reference the compiled kernel follows."""
        if not len(seq_hashes) or not self._holders.nodes.size:
            return [], []
        holders = self._holders.prefix_holders(np.asarray(seq_hashes, dtype=U64))
        if not len(holders):
            return [], []
        first = int(holders[0])
        other = np.flatnonzero(holders != first) if first >= 0 else None
        if other is not None and (not len(other) or holders[other[0]] >= 0):
            # one worker holds the first block, and after its run comes a block it does not
            # hold (or none): only it matches, that far
            return [first], [int(other[0]) if len(other) else len(holders)]
        return self._holders.match(holders)

    def _tree_sizes(self) -> dict[WorkerKey, int]:
        sizes = self._sizes_cache
        if sizes is None:
            blocks = self._blocks
            sizes = {w: blocks[s].size for w, s in self._slots.items() if blocks[s].size}
            self._sizes_cache = sizes
        return sizes

    def _live_columns(self) -> LiveRows:
        """The keys holding any block (in slot order), their tree sizes and rows; the keys and
        rows kept, the same list, while the same slots of the same workers hold blocks."""
        cached = self._columns_cache
        if cached is not None and cached[4] == self._sizes_epoch:
            return cached
        sizes = np.fromiter((t.size for t in self._blocks), np.int64, len(self._blocks))
        self._columns_cache = live_rows(cached, sizes, self._keys, self._sizes_epoch,
                                        self._slots_epoch)
        return self._columns_cache

    def tree_size(self, worker: WorkerKey) -> int:
        slot = self._slots.get(worker)
        return 0 if slot is None else self._blocks[slot].size

    @property
    def node_count(self) -> int:
        """Distinct sequence hashes held by anyone (shared prefixes count once)."""
        return self._holders.nodes.size

    def nbytes(self) -> int:
        """Bytes of the index's arrays (what ``bench core`` compares with RSS growth)."""
        return self._holders.nbytes() + sum(t.nbytes() for t in self._blocks)

    # --- snapshots (index_codec.py) -----------------------------------------------------------

    def plain_encoder(self, *, copy: bool = True) -> Callable[[], dict[str, object]]:
        """Capture the index now and return a function that builds its plain form (v6, the
        arrays themselves: ``index_arrays.py``) later.

        The capture copies the tables' cells (numpy, ~15-20 ms per million pairs) whatever
        ``copy`` says, so the returned function may run in a worker thread while the index
        keeps changing on the event loop."""
        return index_capture.capture(self, copy=copy)

    def plain_capture(self) -> IndexCapture:
        """The same capture in bounded steps (``index_capture.py``), for a caller that keeps
        the index unchanged until the last step and lets other work run between steps."""
        return IndexCapture(self)

    @classmethod
    def from_plain(cls, obj: object) -> PrefixIndex:
        """Restore from any plain version (1 and 2 written by the reference form, 3 to 6 by
        this one)."""
        if isinstance(obj, dict) and obj.get("version") in (index_arrays.PLAIN_VERSION_V4,
                                                            index_arrays.PLAIN_VERSION_V5,
                                                            index_arrays.PLAIN_VERSION_V6):
            index = cls(approximate=bool(obj["approximate"]), ttl_secs=float(obj["ttl_secs"]),
                        max_tree_size=int(obj["max_tree_size"]),
                        prune_target_ratio=float(obj["prune_target_ratio"]))
            if obj["version"] == index_arrays.PLAIN_VERSION_V6:
                index_arrays.restore(index, obj)
            else:
                index_arrays_legacy.restore(index, obj)
            for worker, seq_list, expires, depths in read_expiry(obj):
                index._restore_expiry(worker, seq_list, expires, depths)
            heapq.heapify(index._heap)
            index.counters = {(t, s): int(n) for t, s, n in obj["counters"]}
            return index
        plain = read_plain(obj)
        index = cls(approximate=plain.approximate, ttl_secs=plain.ttl_secs,
                    max_tree_size=plain.max_tree_size,
                    prune_target_ratio=plain.prune_target_ratio)
        held: list[np.ndarray] = []
        holders: list[np.ndarray] = []
        for worker, ids, seqs in plain.workers:
            slot = index._slot_for(worker)
            n = len(ids)
            distinct, counts = np.unique(seqs, return_counts=True)
            if n and len(np.unique(ids)) != n:
                raise ValueError(f"snapshot repeats block ids of {worker}")
            table = U64Table(U64, capacity=n)
            table.insert(ids, seqs)
            index._blocks[slot] = table
            index._sums[slot] = mix_sum(ids, seqs)
            index._total += n
            extra = counts > 1
            if extra.any():
                index._dups[slot] = dict(zip(distinct[extra].tolist(),
                                             (counts[extra] - 1).tolist(), strict=True))
            held.append(distinct)
            holders.append(np.full(len(distinct), slot, dtype=np.int64))
        if sum(map(len, held)):
            index._holders.restore(np.concatenate(held), np.concatenate(holders))
        for worker, seq_list, expires, depths in plain.expiry:
            index._restore_expiry(worker, seq_list, expires, depths)
        heapq.heapify(index._heap)
        index.counters = plain.counters
        return index
