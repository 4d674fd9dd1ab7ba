"""A hash table of ``u64`` keys held in numpy arrays, probed a whole batch of keys at a time.

The compact prefix index (``index.py``) keeps tens of millions of entries; as Python dicts of ints
each costs ~100 bytes or more (the key object, the value object, the dict slot), as columns here
it costs the bytes of its key and value plus the free cells. Layout:

* ``2**bits`` **buckets of 8 cells** each: ``keys`` (``u64``), ``vals`` (any numpy dtype),
  ``occ`` (occupied). A key's home bucket is the top ``bits`` bits of ``key * _MULT`` (Fibonacci
  hashing: sequential keys, such as small engine block ids, still spread over every bucket).
* A key lives in its home bucket unless that bucket was full when it arrived; then it went to
  the next bucket with a free cell, and every bucket it passed got its sticky ``spill`` flag. A
  lookup moves on to the next bucket only while the flag is set, so an absent key costs one
  bucket read nearly always. Deleting just clears the cell (no tombstones: the flag keeps later
  lookups right). Flags are dropped when the table is rebuilt.
* The table doubles when it is ``_MAX_LOAD`` full, so it is between ~43 % and 85 % full.

Every operation takes arrays and runs as a few numpy calls whatever the batch size: at the size
of one KV event (tens of blocks) the cost is those calls' fixed overhead, a few microseconds each.
A deleted cell's key is reset to 0 so that a stale key can only match a query for key 0, and
lookups of key 0 (checked per batch) also check ``occ``.
"""

from __future__ import annotations

import numpy as np

from replicas.core.index_common import U64

_WAYS = 8  # cells per bucket: one 64-byte cache line of keys
_MULT = np.uint64(0x9E3779B97F4A7C15)  # 2**64 / golden ratio, odd
_MAX_LOAD = 0.85
_MIN_BITS = 3


class U64Table:
    """``u64`` key -> value (``dtype``), vectorised over batches of keys."""

    __slots__ = ("_shift", "dtype", "keys", "mask", "occ", "size", "spill", "vals")

    def __init__(self, dtype: np.dtype | type, capacity: int = 0) -> None:
        self.dtype = np.dtype(dtype)
        bits = _MIN_BITS
        while (1 << bits) * _WAYS * _MAX_LOAD < capacity:
            bits += 1
        self._alloc(bits)
        self.size = 0

    def _alloc(self, bits: int) -> None:
        buckets = 1 << bits
        self.mask = buckets - 1
        self._shift = np.uint64(64 - bits)
        self.keys = np.zeros((buckets, _WAYS), dtype=U64)
        self.vals = np.zeros((buckets, _WAYS), dtype=self.dtype)
        self.occ = np.zeros((buckets, _WAYS), dtype=bool)
        self.spill = np.zeros(buckets, dtype=bool)

    def nbytes(self) -> int:
        return self.keys.nbytes + self.vals.nbytes + self.occ.nbytes + self.spill.nbytes

    def _home(self, keys: np.ndarray) -> np.ndarray:
        return ((keys * _MULT) >> self._shift).astype(np.int64)

    # --- lookups -----------------------------------------------------------------------------

    def find(self, keys: np.ndarray) -> np.ndarray:
        """Flat cell index (``bucket * 8 + way``) of each key, -1 where absent."""
        n = len(keys)
        pos = np.full(n, -1, dtype=np.int64)
        if not n or not self.size:
            return pos
        zero = not keys.all()
        b = self._home(keys)
        at = None  # rows of ``pos`` still looked for (None: all of them)
        while True:
            hit = self.keys[b] == keys[:, None]
            if zero:
                hit &= self.occ[b]
            found = hit.any(axis=1)
            cell = b * _WAYS + hit.argmax(axis=1)
            if at is None:
                np.copyto(pos, cell, where=found)
            else:
                pos[at[found]] = cell[found]
            more = ~found & self.spill[b]
            if not more.any():
                return pos
            at = np.flatnonzero(more) if at is None else at[more]
            keys, b = keys[more], (b[more] + 1) & self.mask

    def get(self, key: int) -> int:
        """Cell of one key, -1 if absent."""
        return int(self.find(np.array([key], dtype=U64))[0])

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """Copies of every (key, value), in cell order."""
        return self.keys[self.occ], self.vals[self.occ]

    # --- changes -----------------------------------------------------------------------------

    def insert(self, keys: np.ndarray, vals: np.ndarray) -> None:
        """Add keys that are absent and distinct (the caller checked) with their values."""
        n = len(keys)
        if not n:
            return
        if (self.size + n) > _MAX_LOAD * self.keys.size:
            self._grow(self.size + n)
        self._place(keys, np.asarray(vals, dtype=self.dtype))
        self.size += n

    def delete(self, cells: np.ndarray) -> None:
        """Empty the given (occupied, distinct) cells."""
        flat_keys = self.keys.reshape(-1)
        flat_keys[cells] = 0
        self.occ.reshape(-1)[cells] = False
        self.size -= len(cells)

    def _place(self, keys: np.ndarray, vals: np.ndarray) -> None:
        b = self._home(keys)
        flat_keys, flat_vals, flat_occ = (self.keys.reshape(-1), self.vals.reshape(-1),
                                          self.occ.reshape(-1))
        while len(keys):
            m = len(keys)
            if m == 1:
                rank = np.zeros(1, dtype=np.int64)
            else:
                # rank of each key among this batch's keys with the same bucket: the k-th of
                # them takes the bucket's k-th free cell
                order = np.argsort(b, kind="stable")
                sb = b[order]
                first = np.empty(m, dtype=bool)
                first[0] = True
                np.not_equal(sb[1:], sb[:-1], out=first[1:])
                idx = np.arange(m)
                starts = np.maximum.accumulate(np.where(first, idx, 0))
                rank = np.empty(m, dtype=np.int64)
                rank[order] = idx - starts
            free = np.cumsum(~self.occ[b], axis=1)
            fits = free[:, -1] > rank
            cell = b * _WAYS + (free > rank[:, None]).argmax(axis=1)
            placed = cell[fits]
            flat_keys[placed] = keys[fits]
            flat_vals[placed] = vals[fits]
            flat_occ[placed] = True
            if fits.all():
                return
            rest = ~fits
            self.spill[b[rest]] = True
            keys, vals, b = keys[rest], vals[rest], (b[rest] + 1) & self.mask

    def _grow(self, need: int) -> None:
        keys, vals = self.items()
        bits = int(self.mask).bit_length()
        while (1 << bits) * _WAYS * _MAX_LOAD < need:
            bits += 1
        self._alloc(bits)  # the old arrays are released here; only the compact copies remain
        self._place(keys, vals)
