"""The in-flight load as columns, for decisions at fleet size (design.md §6).

``ActiveLoad`` (load.py) keeps each worker rank's load in Python aggregates and answers one rank
at a time; that stays the reference. At 256 ranks with requests in flight a decision that asked
each rank cost ~1.3 µs a rank for its active prefix (a binary search of the prompt in that rank's
dict of active blocks) and ~0.3 µs for its prefill and decode figures: ~0.4 ms in all. So
``ActiveLoad`` also keeps, updated with its aggregates on every event:

- a **slot** per loaded worker rank (the lowest free one; given back when the rank has no request
  left) and a journal of slot changes, so that a reader keeps its own slot → row map in step at
  the cost of the changes since it last looked (``SlotRows``);
- per slot, its prefill tokens, distinct active blocks and weighted output blocks (thousandths),
  in ``int64`` arrays written through memoryviews (a numpy scalar store costs more than the rest
  of a small event);
- per sequence hash, an int bitmask of the slots whose active requests hold that block
  (``holders``), as the reference index keeps cached blocks — from the first decision that asks
  for it on (``ActiveLoad.prefix_groups``), so a replica that never decides over columns never
  pays for it.

``prefix_groups`` then gives every slot's active prefix at once: it runs
``ActiveLoad.active_prefix_len``'s binary search for all slots together, keeping the slots that
answered each probe alike in one group, so a probe is one dict lookup and one AND for a whole
group. Its answers are the per-rank searches' exactly, whatever blocks the ranks hold. The price
is on applying events: a block a rank starts or stops holding also sets or clears its bit in a
dict as large as all ranks' active blocks together (~0.25 µs a block, added and removed, on the
project's 2-core machine; docs/measurements/fleet-scale-decisions.md).

Nothing here is in digests or snapshots: it all follows from the requests in flight, and a
restored ``ActiveLoad`` builds it again. Pure: no clock, no I/O, no randomness.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence

import numpy as np

WorkerKey = tuple[str, int]

_FIRST_CAPACITY = 64
_I64 = np.dtype(np.int64)


class LoadColumns:
    """Slots, per-slot load columns and per-block holder bitmasks of one ``ActiveLoad``.

    ``ActiveLoad`` is the only writer: it writes a slot's figures through ``prefill_view``,
    ``blocks_view`` and ``milli_view`` (memoryviews of ``prefill``, ``blocks``, ``milli``; both
    replaced when the arrays grow) and, once it keeps them, edits ``holders`` as its ranks'
    active blocks change."""

    __slots__ = ("_free", "blocks", "blocks_view", "changes", "changes_base", "holders", "keys",
                 "milli", "milli_view", "prefill", "prefill_view")

    def __init__(self) -> None:
        self.keys: list[WorkerKey | None] = []  # slot -> its worker rank (None: free)
        self._free: list[int] = []  # min-heap of free slots below len(keys)
        # sequence hash -> mask of the slots holding it; None: not kept (nothing asked yet)
        self.holders: dict[int, int] | None = None
        # Slot changes, oldest first: (slot, its new key or None). ``changes_base`` counts the
        # entries dropped from the front, so entry i of the journal is change changes_base + i.
        self.changes: list[tuple[int, WorkerKey | None]] = []
        self.changes_base = 0
        self._allocate(_FIRST_CAPACITY)

    def _allocate(self, capacity: int) -> None:
        for name in ("prefill", "blocks", "milli"):
            column = np.zeros(capacity, dtype=_I64)
            old = getattr(self, name, None)
            if old is not None:
                column[: len(old)] = old
            setattr(self, name, column)
            setattr(self, f"{name}_view", memoryview(column))

    @property
    def changes_end(self) -> int:
        """The number of slot changes so far (the next change's number)."""
        return self.changes_base + len(self.changes)

    def assign(self, key: WorkerKey) -> int:
        """A slot for ``key``, which just got its first request in flight."""
        if self._free:
            slot = heapq.heappop(self._free)
            self.keys[slot] = key
        else:
            slot = len(self.keys)
            self.keys.append(key)
            if slot >= len(self.prefill):
                self._allocate(2 * len(self.prefill))
        self._record(slot, key)
        return slot

    def release(self, slot: int) -> None:
        """``slot``'s rank has no request left: its figures are all 0 and it holds no block."""
        self.keys[slot] = None
        self.prefill_view[slot] = self.blocks_view[slot] = self.milli_view[slot] = 0
        heapq.heappush(self._free, slot)
        self._record(slot, None)

    def _record(self, slot: int, key: WorkerKey | None) -> None:
        changes = self.changes
        changes.append((slot, key))
        # Bounded: a reader this far behind rebuilds its map, which costs about as much as
        # replaying this many changes would.
        if len(changes) > 4 * len(self.keys) + 256:
            self.changes_base += len(changes)
            changes.clear()

    def prefix_groups(self, seq_hashes: Sequence[int]) -> list[tuple[int, int]]:
        """``(slot mask, length)`` for the slots whose active requests hold the first
        ``length`` > 0 blocks of ``seq_hashes``, one entry per length: what
        ``ActiveLoad.active_prefix_len`` answers for each slot's rank. Every other slot: 0.
        Only once ``holders`` are kept (``ActiveLoad.prefix_groups`` sees to it)."""
        holders = self.holders
        if holders is None:
            raise RuntimeError("the blocks' holders are not kept yet")
        n = len(seq_hashes)
        if not n or not holders:
            return []
        get = holders.get
        out: list[tuple[int, int]] = []
        # Free slots are in the first mask too: they hold nothing, so they answer 0 as an idle
        # rank does, and leave no entry.
        todo = [((1 << len(self.keys)) - 1, 0, n)]
        while todo:
            mask, lo, hi = todo.pop()
            while lo < hi:
                mid = (lo + hi) >> 1
                held = get(seq_hashes[mid], 0) & mask
                if held == mask:
                    lo = mid + 1
                elif not held:
                    hi = mid
                else:  # the group splits: the holders search on to the right, the rest left
                    todo.append((held, mid + 1, hi))
                    mask ^= held
                    hi = mid
            if lo:
                out.append((mask, lo))
        return out


class SlotRows:
    """Which of a caller's rows each slot of a ``LoadColumns`` is: ``row_of`` maps a worker rank
    to its row (ranks missing from it have none). Kept in step through the slots' journal, so it
    costs the slot changes since the last ``sync``, not a lookup per loaded rank."""

    __slots__ = ("_columns", "_loaded", "_row_of", "_seen", "slot_row")

    def __init__(self, row_of: Mapping[WorkerKey, int]) -> None:
        self._row_of = row_of
        self._columns: LoadColumns | None = None
        self._seen = 0
        self.slot_row = np.zeros(0, dtype=_I64)  # slot -> row, -1 where none
        self._loaded: tuple[np.ndarray, np.ndarray] | None = None

    def sync(self, columns: LoadColumns) -> tuple[np.ndarray, np.ndarray]:
        """``(slots, rows)``: every slot of ``columns`` whose rank has a row, and that row."""
        if columns is not self._columns or self._seen < columns.changes_base:
            get = self._row_of.get
            self.slot_row = np.array([-1 if k is None else get(k, -1) for k in columns.keys],
                                     dtype=_I64)
            self._columns = columns
            self._loaded = None
        elif self._seen < columns.changes_end:
            size = len(columns.keys)
            if len(self.slot_row) < size:
                grown = np.full(size, -1, dtype=_I64)
                grown[: len(self.slot_row)] = self.slot_row
                self.slot_row = grown
            get = self._row_of.get
            slot_row = self.slot_row
            for slot, key in columns.changes[self._seen - columns.changes_base:]:
                slot_row[slot] = -1 if key is None else get(key, -1)
            self._loaded = None
        self._seen = columns.changes_end
        if self._loaded is None:
            slots = np.flatnonzero(self.slot_row >= 0)
            self._loaded = (slots, self.slot_row[slots])
        return self._loaded
