"""The reference prefix index: Python dicts of ints, one entry per held block (design.md §5).

The router's index before the compact form (``index.py``); kept, unchanged in behaviour, as the
oracle tests check the compact form against and the "before" side of ``bench core``.

Pure and deterministic: no clock, no randomness. Layout, for the two hot paths (apply, match):

* Every block is a node keyed by its *sequence hash* (``eventlog.hashing.chain_hash`` from the
  parent's sequence hash; a root block's sequence hash is its ``tokens_hash``), so equal prefixes on
  different workers share a node. A node's value is an int bitmask of the worker *slots* holding it.
* Per slot, ``block_hash -> entry`` (the block's sequence hash and its parent's, packed in one
  int) maps the engine's opaque ids back to nodes, for removals and for the parent of a later store.
* Gap bookkeeping (per slot, child counts per node and held nodes lacking their parent) lets
  ``find_matches`` *bisect* along the query (``index_reference_match.py``) for slots without gaps;
  slots with gaps fall back to ANDing the masks along the query, in C, until empty.

Membership is *flat* and the counters are the compact form's (both described in ``index.py``).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from eventlog.hashing import CHAIN_MULTIPLIER, MASK64
from replicas.core import index_reference_capture
from replicas.core.index_codec import (
    PLAIN_VERSION_V2,
    columns_v1,
    columns_v2,
    expiry_v1,
    expiry_v2,
    node_masks,
)
from replicas.core.index_common import (
    DIGEST_SALT,
    LiveRows,
    MatchColumns,
    OverlapScores,
    WorkerKey,
    live_rows,
)
from replicas.core.index_reference_capture import MapsCapture
from replicas.core.index_reference_match import match_groups, record, slot_indices
from replicas.core.index_reference_restore import restore_slot
from replicas.core.index_run import STORE, KvOp, RunResult
from replicas.core.index_slots import WorkerSlots

Entry = int  # a held block: seq | (parent seq + 1) << 64 (a root's parent is _ROOT, so: seq)

_P = CHAIN_MULTIPLIER
_ROOT = -1  # parent of a root block in the gap bookkeeping (sequence hashes are >= 0)
_SHARED_INTS = 256  # CPython keeps one object for each int from -5 to this


class PrefixIndex(WorkerSlots):
    def __init__(self, **settings: Any) -> None:
        """``settings``: ``WorkerSlots``'s (approximate mode's and its limits)."""
        super().__init__(**settings)
        self._nodes: dict[int, int] = {}  # seq hash -> bitmask of slots holding it
        # slot -> {block_hash: entry}; entries are ints, not tuples, so that a million of them
        # cost the garbage collector nothing
        self._blocks: list[dict[int, Entry]] = []
        # Gap tracking, so find_matches can bisect: a slot is "clean" when every node it holds
        # has its parent held too (then holding block i implies holding blocks 0..i).
        self._kids: list[dict[int, int]] = []  # slot -> {seq: held nodes whose parent is seq}
        self._gaps: list[int] = []  # slot -> held nodes whose parent it does not hold
        self._gappy = 0  # bitmask of slots with gaps

    # --- bookkeeping -------------------------------------------------------------------------

    def _open_slot(self, slot: int, fresh: bool) -> None:
        if fresh:  # a freed slot kept its emptied tables
            self._blocks.append({})
            self._kids.append({})
            self._gaps.append(0)

    def _empty_slot(self, slot: int) -> None:
        self._blocks[slot] = {}
        self._kids[slot] = {}
        self._set_gaps(slot, 0)

    def _release(self, slot: int, block_hash: int, entry: Entry) -> None:
        """Drop one block id's membership (the caller already took it from the slot's map)."""
        self._release_ids(slot, (block_hash,), {block_hash: entry}.pop)

    def _set_gaps(self, slot: int, gaps: int) -> None:
        gaps = max(gaps, 0)  # only a 64-bit hash collision could drive it negative
        self._gaps[slot] = gaps
        if gaps:
            self._gappy |= 1 << slot
        else:
            self._gappy &= ~(1 << slot)

    # --- KV events ---------------------------------------------------------------------------

    def store(
        self,
        worker: WorkerKey,
        parent_block_hash: int | None,
        blocks: Sequence[tuple[int, int]],
    ) -> str:
        """Apply a BlocksStored: ``blocks`` are ``(block_hash, tokens_hash)`` in chain order."""
        if parent_block_hash is None:
            slot = self._slot_for(worker)
            parent = 0  # chain_hash(0, t) == t: a root block's sequence hash is its tokens_hash
        else:
            slot = self._slots.get(worker, -1)
            known = self._blocks[slot].get(parent_block_hash) if slot >= 0 else None
            if known is None:
                self._count("stored", "parent_block_not_found")
                return "parent_block_not_found"
            parent = known & MASK64
        self._sizes_changed()
        bmap = self._blocks[slot]
        before = len(bmap)
        moved = 0
        claim = bmap.setdefault
        nodes = self._nodes
        get = nodes.get
        bit = 1 << slot
        mult, mask64, salt = _P, MASK64, DIGEST_SALT  # locals: this loop is the apply hot path
        kids = self._kids[slot]
        gaps = self._gaps[slot]
        prev = _ROOT if parent_block_hash is None else parent  # held by this worker (or root)
        prev_kids = -1  # kids[prev] when known, else -1
        if parent_block_hash is None and blocks:
            # The loop tells a new block id by getting its own fresh ``entry`` object back from
            # ``setdefault``. Only a root's entry can be small (its parent part is 0), and
            # CPython shares the objects of ints up to 256, so a re-announced root with such a
            # tiny sequence hash would look new: skip it here (re-announcing changes nothing).
            first_hash, first_tokens = blocks[0]
            seq = first_tokens & mask64
            if seq <= _SHARED_INTS and bmap.get(first_hash) == seq:
                blocks, prev, parent = blocks[1:], seq, seq
        moved_any = False  # a move may have released the chain's own parent
        acc = 0
        for block_hash, tokens_hash in blocks:
            seq = parent = (parent * mult + tokens_hash) & mask64
            entry = seq | (prev + 1) << 64
            held = claim(block_hash, entry)  # one dict lookup for a new id, the common case
            if held is not entry:  # the id was held already (getting ``entry`` back: see above)
                if held & mask64 == seq:
                    prev, prev_kids = seq, -1
                    continue  # re-announced: nothing changes
                # the engine reused the id for other content: move it
                bmap[block_hash] = entry
                self._gaps[slot] = gaps
                self._release(slot, block_hash, held)
                gaps = self._gaps[slot]
                prev_kids = -1
                moved += 1
                moved_any = True
            acc += (seq ^ salt) * (2 * block_hash + 1)  # digest term, reduced once per batch
            mask = get(seq)
            if mask is None:  # a node nobody held: the common case when prompts are new
                nodes[seq] = bit
            elif mask & bit:  # held under another block id: membership unchanged
                dups = self._dups[slot]
                dups[seq] = dups.get(seq, 0) + 1
                prev, prev_kids = seq, -1
                continue
            else:
                nodes[seq] = mask | bit
            if prev_kids >= 0:  # the parent was added just before: its child count is known
                kids[prev] = prev_kids + 1
            elif prev != _ROOT:
                kids[prev] = kids.get(prev, 0) + 1
                if moved_any and not get(prev, 0) & bit:
                    gaps += 1  # stored under a parent this batch itself moved away
            if gaps:  # children held without this node were gaps (impossible in a clean slot)
                prev_kids = kids.get(seq, 0)
                gaps -= prev_kids
            else:
                prev_kids = 0
            prev = seq
        self._set_gaps(slot, gaps)
        self._sums[slot] = (self._sums[slot] + acc) & MASK64
        self._total += len(bmap) - before + moved
        self._count("stored", "ok")
        return "ok"

    def remove(self, worker: WorkerKey, block_hashes: Sequence[int]) -> int:
        """Apply a BlocksRemoved; returns how many block hashes were unknown (the rest apply)."""
        slot = self._slots.get(worker)
        unknown = 0
        if slot is None:
            unknown = len(block_hashes)
        else:
            self._sizes_changed()
            unknown = self._release_ids(slot, block_hashes, self._blocks[slot].pop)
        self._count("removed", "ok")
        if unknown:
            self._count("removed", "block_not_found", unknown)
        return unknown

    def _release_ids(self, slot: int, block_hashes: Iterable[int],
                     pop: Callable[[int, None], Entry | None]) -> int:
        """Drop the membership of each block id that ``pop`` takes from the slot's map (with
        its entry; ``None``: an id the slot does not hold), inlined with locals (the replay hot
        path for evictions); returns how many ids the slot did not hold."""
        dups = self._dups[slot]
        kids = self._kids[slot]
        nodes = self._nodes
        expiry = self._expiry if self.approximate else None
        bit = 1 << slot
        gaps = self._gaps[slot]
        mask64, salt = MASK64, DIGEST_SALT
        acc = removed = unknown = 0
        for block_hash in block_hashes:
            entry = pop(block_hash, None)
            if entry is None:
                unknown += 1
                continue
            seq = entry & mask64
            acc += ((seq ^ salt) * (2 * block_hash + 1)) & mask64
            removed += 1
            extra = dups.get(seq) if dups else None
            if extra:  # another block id of this worker still maps to the same node
                if extra == 1:
                    del dups[seq]
                else:
                    dups[seq] = extra - 1
                continue
            mask = nodes[seq] ^ bit
            if mask:
                nodes[seq] = mask
            else:
                del nodes[seq]
            if expiry is not None:
                expiry.pop((slot, seq), None)
            gaps += kids.get(seq, 0)  # its held children lose their parent
            parent = (entry >> 64) - 1
            if parent != _ROOT:
                left = kids.get(parent, 0) - 1
                if left > 0:
                    kids[parent] = left
                else:
                    kids.pop(parent, None)
                if not nodes.get(parent, 0) & bit:
                    gaps -= 1  # it was itself a child without its parent
            if gaps < 0:  # as _set_gaps: only a 64-bit hash collision gets here
                gaps = 0
        self._sums[slot] = (self._sums[slot] - acc) & MASK64
        self._total -= removed
        self._set_gaps(slot, gaps)
        return unknown

    def apply_run(self, ops: Sequence[KvOp]) -> list[RunResult]:
        """Stores and removals (``index_run.KvOp``) in order, one by one (each is a few dict
        operations a block here: there is no fixed cost per event to share)."""
        store, remove = self.store, self.remove
        return [store(w, a, b) if kind == STORE else remove(w, a) for kind, w, a, b in ops]

    def _clear_slot(self, slot: int) -> None:
        bit = 1 << slot
        nodes = self._nodes
        bmap = self._blocks[slot]
        dups = self._dups[slot]
        seqs = (e & MASK64 for e in bmap.values())
        for seq in set(seqs) if dups else seqs:
            mask = nodes[seq] ^ bit
            if mask:
                nodes[seq] = mask
            else:
                del nodes[seq]
            if self.approximate:
                self._expiry.pop((slot, seq), None)
        self._total -= len(bmap)
        self._free_slot(slot)

    # --- queries -----------------------------------------------------------------------------

    def find_matches(self, seq_hashes: Sequence[int]) -> OverlapScores:
        """Matched prefix length (in blocks) of ``seq_hashes`` per worker key, plus tree sizes."""
        scores: dict[WorkerKey, int] = {}
        keys = self._keys
        for slots, matched in match_groups(self._nodes.get, self._gappy, seq_hashes):
            record(scores, keys, slots, matched)
        return OverlapScores(scores, dict(self._tree_sizes()))

    def match_columns(self, seq_hashes: Sequence[int]) -> MatchColumns:
        """``find_matches`` as columns (``MatchColumns``): no dict of worker keys is built."""
        live, workers, sizes, rows, _, _ = self._live_columns()
        lengths = np.zeros(len(self._keys), dtype=np.int64)
        for slots, matched in match_groups(self._nodes.get, self._gappy, seq_hashes):
            lengths[slot_indices(slots)] = matched
        return MatchColumns(workers, lengths[live], sizes, rows)

    def _tree_sizes(self) -> dict[WorkerKey, int]:
        sizes = self._sizes_cache
        if sizes is None:
            blocks = self._blocks
            sizes = {w: len(blocks[s]) for w, s in self._slots.items() if blocks[s]}
            self._sizes_cache = sizes
        return sizes

    def _live_columns(self) -> LiveRows:
        """The slots holding any block (in slot order), their keys, tree sizes and each key's
        row. After a change the sizes are re-read per slot (one C pass); the keys and rows are
        kept, the same list, while the same slots of the same workers hold blocks."""
        cached = self._columns_cache
        if cached is not None and cached[4] == self._sizes_epoch:
            return cached
        sizes = np.fromiter(map(len, self._blocks), np.int64, len(self._blocks))
        self._columns_cache = live_rows(cached, sizes, self._keys, self._sizes_epoch,
                                        self._slots_epoch)
        return self._columns_cache

    def tree_size(self, worker: WorkerKey) -> int:
        slot = self._slots.get(worker)
        return 0 if slot is None else len(self._blocks[slot])

    @property
    def node_count(self) -> int:
        """Distinct sequence hashes held by anyone (shared prefixes count once)."""
        return len(self._nodes)

    # --- approximate mode --------------------------------------------------------------------

    def store_routed(self, worker: WorkerKey, seq_hashes: Sequence[int], now: float) -> None:
        """Record a routing decision as blocks the worker will hold until ``now + ttl_secs``."""
        self.expire(now)
        if not seq_hashes:
            return
        self._sizes_changed()
        slot = self._slot_for(worker)
        bmap = self._blocks[slot]
        nodes = self._nodes
        expiry_map = self._expiry
        heap = self._heap
        bit = 1 << slot
        expires = now + self.ttl_secs
        worker_id, dp_rank = self._keys[slot]  # type: ignore[misc]
        acc = 0
        added = 0
        kids = self._kids[slot]
        gaps = self._gaps[slot]
        prev = _ROOT
        for depth, seq in enumerate(seq_hashes, 1):
            if seq not in bmap:
                bmap[seq] = seq | (prev + 1) << 64  # no engine id here: the seq names the block
                added += 1
                acc += ((seq ^ DIGEST_SALT) * (2 * seq + 1)) & MASK64
                nodes[seq] = nodes.get(seq, 0) | bit
                if prev != _ROOT:
                    kids[prev] = kids.get(prev, 0) + 1
                if gaps:
                    gaps -= kids.get(seq, 0)
            prev = seq
            expiry_map[(slot, seq)] = (expires, depth)
            heapq.heappush(heap, (expires, -depth, worker_id, dp_rank, seq))
        self._set_gaps(slot, gaps)
        self._sums[slot] = (self._sums[slot] + acc) & MASK64
        self._total += added
        if self._total > self.max_tree_size:
            self._prune()
        if len(heap) > 4 * max(len(expiry_map), 1024):
            self._compact_heap()

    def _drop_entry(self, slot: int, seq: int) -> None:
        entry = self._blocks[slot].pop(seq)
        self._expiry.pop((slot, seq), None)
        self._release(slot, seq, entry)

    # --- snapshots ---------------------------------------------------------------------------
    #
    # Plain form v2 is columnar, so that a million blocks restore with bulk operations instead
    # of per-block Python: per worker key, its blocks in the slot map's order as little-endian
    # arrays of engine block ids and sequence hashes, plus the parents compressed by *kind*
    # (a chain is stored in order, so most blocks' parent is the previous row's sequence hash;
    # only the others carry an explicit parent). v1 (flat int lists) is still read.

    def plain_encoder(self, *, copy: bool = True) -> Callable[[], dict[str, object]]:
        """Capture the index now and return a function that builds its plain form later.

        With ``copy`` the per-worker maps are shallow-copied (C-speed, ~20 ms per million
        blocks; entries are immutable ints), so the returned function may run in a worker
        thread while the index keeps changing on the event loop."""
        return index_reference_capture.capture(self, copy=copy)

    def plain_capture(self) -> MapsCapture:
        """The same capture in steps, one worker's map a step (``index_reference_capture.py``),
        for a caller that keeps the index unchanged until the last step."""
        return MapsCapture(self)

    @classmethod
    def from_plain(cls, obj: object) -> PrefixIndex:
        if not isinstance(obj, dict) or obj.get("version") not in (1, PLAIN_VERSION_V2):
            raise ValueError("this snapshot's prefix index is in the compact form: run every "
                             "replica with --router-index-form compact" if isinstance(obj, dict)
                             and obj.get("version") in (3, 4, 5, 6) else "not a plain PrefixIndex")
        index = cls(
            approximate=bool(obj["approximate"]),
            ttl_secs=float(obj["ttl_secs"]),
            max_tree_size=int(obj["max_tree_size"]),
            prune_target_ratio=float(obj["prune_target_ratio"]),
        )
        legacy = obj["version"] == 1
        held: list[tuple[int, np.ndarray]] = []
        for row in obj["workers"]:
            block_hashes, seqs, parents, roots = (columns_v1(row[2]) if legacy
                                                  else columns_v2(*row[2:]))
            slot = index._slot_for((str(row[0]), int(row[1])))
            held.append((slot, restore_slot(index, slot, block_hashes, seqs, parents, roots)))
        index._nodes = node_masks(held)
        for row in obj["expiry"]:
            index._restore_expiry((str(row[0]), int(row[1])),
                                  *(expiry_v1(row[2]) if legacy else expiry_v2(*row[2:])))
        heapq.heapify(index._heap)
        index.counters = {(t, s): int(n) for t, s, n in obj["counters"]}
        return index
