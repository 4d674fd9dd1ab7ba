"""The compact index copied for a snapshot (``index_arrays.py``'s form), in bounded steps.

A snapshot is encoded from copies of the index's tables, in a worker thread, while the index
goes on changing (``state_codec.py``, ``snapshots/store.py``). Taking those copies is the part
that needs the index to stand still: per slot, its block table's occupied cells (boolean-mask
copies of the ids and sequence hashes) and its occupancy bits, then the node table and the
holder bitmaps. Taken at once, they held the event loop ~0.2 s at 10 M pairs and ~2 s at
25.6 M (docs/measurements/restart-at-scale.md): no request answered, no lease renewed.

Here ``IndexCapture.steps()`` takes them a piece at a time, at most ``STEP_CELLS`` cells a step
(a few ms), so that whoever iterates it can let other work run between steps
(``replicas/runtime/leader.py``). The index must not change from the capture's start to its last
step: outside approximate mode only KV messages change it, and the runtime holds the KV stream
meanwhile (``replicas/runtime/follower.py``). The last step checks the index's digest against
the one it started from and raises ``IndexChanged`` rather than hand over copies of two states.

Pure: no clock, no I/O; the caller decides when each step runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from errors.root import JetrouterError
from replicas.core.index_arrays import PLAIN_VERSION_V6, _encode, _Slot
from replicas.core.index_codec import expiry_columns
from replicas.core.index_table import U64Table

# Cells one step copies at most: ~1-3 ms of copying here (a multiple of 8, so that each piece of
# a slot's occupancy packs into whole bytes and the pieces join into the slot's bits).
STEP_CELLS = 1 << 19


class IndexChanged(JetrouterError, RuntimeError):
    """The index changed while it was being copied: the copies are not one state."""


class IndexCapture:
    """Copies of what a snapshot needs of one compact ``PrefixIndex``: ``steps()`` takes them,
    then ``build`` encodes them (it may run in a worker thread: it reads the copies only)."""

    def __init__(self, index: Any, *, copy: bool = True, step_cells: int | None = None) -> None:
        step_cells = STEP_CELLS if step_cells is None else step_cells
        if step_cells < 8 or step_cells % 8:
            raise ValueError(f"step_cells must be a positive multiple of 8, got {step_cells}")
        self._index = index
        self._step = step_cells
        self._digest = index.digest
        self._order = sorted(index._slots.items(), key=lambda kv: kv[1])
        holders = index._holders
        # the version index_arrays._encode writes: change with it
        self._head = {"version": PLAIN_VERSION_V6, "approximate": index.approximate,
                      "ttl_secs": index.ttl_secs, "max_tree_size": index.max_tree_size,
                      "prune_target_ratio": index.prune_target_ratio,
                      "slot_count": len(index._keys), "node_bits": holders.nodes.bits(),
                      "words": int(holders.rows.shape[1])}
        self._counters = [[t, s, n] for (t, s), n in sorted(index.counters.items())]
        self._expiry = dict(index._expiry) if copy else index._expiry
        self._keys = list(index._keys)
        # per slot: (slot, worker key, table bits, pieces of ids, of seqs, of occupancy, dups)
        self._slots: list[tuple[int, object, int, list[np.ndarray], list[np.ndarray],
                                list[np.ndarray], dict[int, int]]] = []
        self._nodes: U64Table | None = None
        self._rows: np.ndarray | None = None

    def steps(self) -> Iterator[None]:
        """Copy the tables, yielding after each piece of at most ``step_cells`` cells."""
        index, step = self._index, self._step
        for worker, slot in self._order:
            table = index._blocks[slot]
            occ, keys, vals = (a.reshape(-1) for a in (table.occ, table.keys, table.vals))
            ids: list[np.ndarray] = []
            seqs: list[np.ndarray] = []
            packed: list[np.ndarray] = []
            for start in range(0, len(occ), step):
                held = occ[start:start + step]
                ids.append(keys[start:start + step][held])
                seqs.append(vals[start:start + step][held])
                packed.append(np.packbits(held, bitorder="little"))
                yield
            self._slots.append((slot, worker, table.bits(), ids, seqs, packed,
                                dict(index._dups[slot])))
        holders = index._holders
        self._nodes = yield from holders.nodes.clone_in_steps(step)
        used = holders.rows_used
        words = holders.rows.shape[1]
        rows = np.empty((used, words), dtype=holders.rows.dtype)
        per_step = max(step // words, 1)
        for start in range(0, used, per_step):
            end = min(start + per_step, used)
            rows[start:end] = holders.rows[start:end]
            yield
        if index.digest != self._digest:
            raise IndexChanged("the prefix index changed while it was copied for a snapshot")
        self._rows = rows

    def build(self) -> dict[str, object]:
        """The index's plain form (``_encode``'s version) from the copies; after the last
        step."""
        if self._nodes is None or self._rows is None:
            raise RuntimeError("the index capture is not complete: run its steps first")
        blocks: list[_Slot] = [(slot, worker, bits, _joined(ids), _joined(seqs), _joined(occ),
                                dups) for slot, worker, bits, ids, seqs, occ, dups in self._slots]
        return {**self._head, **_encode(blocks, self._nodes, self._rows),
                "expiry": expiry_columns(self._expiry, self._keys), "counters": self._counters}


def _joined(pieces: list[np.ndarray]) -> np.ndarray:
    return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)


def capture(index: Any, *, copy: bool = True) -> Callable[[], dict[str, object]]:
    """Every step at once: copy the tables now and return ``build``, which may then run in a
    worker thread while the index keeps changing."""
    taken = IndexCapture(index, copy=copy)
    for _ in taken.steps():
        pass
    return taken.build

