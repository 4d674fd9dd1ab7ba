"""A hash table of ``u64`` keys held in numpy arrays, probed a whole batch of keys at a time.

The compact prefix index (``index.py``) keeps tens of millions of entries; as Python dicts of ints
each costs ~100 bytes or more (the key object, the value object, the dict slot), as columns here
it costs the bytes of its key and value plus the free cells. Layout:

* ``2**bits`` **buckets of 8 cells** each: ``keys`` (``u64``), ``vals`` (any numpy dtype),
  ``occ`` (occupied).
* **Two choices**: a key may live in either of two buckets, the top ``bits`` bits of ``key * M``
  and the ``bits`` bits below those (multiplicative hashing: sequential keys, such as small
  engine block ids, still spread over every bucket), and goes to the emptier one. With 8 cells
  a bucket and two choices a key practically always finds room below 85 % load, so a lookup
  reads exactly two buckets and never probes further: one gather and one compare for a whole
  batch, however many keys are absent (absent keys are the common case when blocks are
  stored). If both are full, one of their keys moves to its other bucket (a cuckoo step); only
  if none can does the table double. It also doubles at ``_MAX_LOAD``, so it is between ~43 %
  and 85 % full. (Without the cuckoo step, greedy two choices meet a key with both buckets full
  long before 85 %: at 25.6 M pairs the tables had doubled early, to 101 bytes a pair.)
* A table that doubled, or is restored, is loaded in bulk: keys ranked within their first
  bucket by one sort, the overflow within its second, without reading occupancy.
* An empty cell of bucket ``B`` holds a *sentinel* key whose two buckets are ``B + 1`` and
  ``B + 2`` (built by inverting ``* M``), so lookups compare keys without reading ``occ``.

Every operation takes arrays and runs as a fixed handful of numpy calls whatever the batch size:
at the size of one KV event (tens of blocks) the cost is those calls' overhead, about a microsecond
each, so the code avoids calls more than arithmetic (``take`` rather than fancy indexing, which is
several times slower on small batches).
"""

from __future__ import annotations

from collections.abc import Generator

import numpy as np

from replicas.core import index_kernel
from replicas.core.index_common import U64, popcount

_WAYS = 8  # cells per bucket: one 64-byte cache line of keys
_LINE = 64
_M = np.uint64(0x9E3779B97F4A7C15)  # 2**64 / golden ratio (odd)
_M_INVERSE = np.uint64(pow(0x9E3779B97F4A7C15, -1, 2**64))  # _M * this == 1 mod 2**64
_M_INT, _MASK64 = int(_M), 2**64 - 1
_MAX_BITS = 32  # two bucket numbers of ``bits`` bits each come from one 64-bit product
_MAX_LOAD = 0.85
# A table made for a known number of keys (a restore) starts at most this full: loading a table
# close to _MAX_LOAD in bulk leaves a few percent of keys to one-by-one cuckoo steps, ~30 us each.
_BULK_LOAD = 0.7
_MIN_BITS = 3
_ROUNDS = 6  # placement rounds; what is left then gets a cuckoo step each, else the table doubles
_FEW = 16
_BULK = 256  # an insert of more keys than this into an empty table loads it in bulk


def _lined_up(buckets: int, dtype: np.dtype) -> np.ndarray:
    """Zeroed ``(buckets, 8)`` cells starting on a 64-byte boundary, so that a bucket's keys are
    one cache line (numpy aligns its data to 16 bytes only: a bucket then spans two lines, and a
    lookup of a table far larger than the caches waits for both)."""
    size = buckets * _WAYS * dtype.itemsize
    raw = np.zeros(size + _LINE, dtype=np.uint8)
    start = -raw.ctypes.data % _LINE
    return raw[start:start + size].view(dtype).reshape(buckets, _WAYS)


class U64Table:
    """``u64`` key -> value (``dtype``), vectorised over batches of keys."""

    __slots__ = ("_bits", "_empty", "_limit", "_mask_u", "_mk", "_mo", "_s1", "_s2", "_shift",
                 "_shift2", "dtype", "keys", "mask", "mv", "occ", "size", "vals")

    def __init__(self, dtype: np.dtype | type, capacity: int = 0) -> None:
        self.dtype = np.dtype(dtype)
        bits = _MIN_BITS
        while (1 << bits) * _WAYS * _BULK_LOAD < capacity:
            bits += 1
        self._alloc(bits)
        self.size = 0

    def _alloc(self, bits: int) -> None:
        if bits > _MAX_BITS:
            raise MemoryError("hash table past 2**35 cells")
        buckets = 1 << bits
        self.mask = buckets - 1
        self._mask_u = np.uint64(self.mask)
        self._shift = np.uint64(64 - bits)
        self._shift2 = np.uint64(64 - 2 * bits)
        self._s1, self._s2 = 64 - bits, 64 - 2 * bits  # the same, as Python ints
        self._limit = int(_MAX_LOAD * buckets * _WAYS)
        kernel = index_kernel.active()
        self.keys = _lined_up(buckets, U64)
        if kernel is not None:  # the same keys in one pass (doubling a large table is mostly this)
            self._empty = np.empty(buckets, dtype=U64)
            kernel.sentinels(self._empty, self.keys, self.mask, self._s1, self._s2)
        else:
            self._empty = self._sentinels(np.arange(buckets, dtype=np.int64))
            self.keys[:] = self._empty[:, None]
        self.vals = _lined_up(buckets, self.dtype)
        self.occ = _lined_up(buckets, np.dtype(bool))
        self._bits = bits
        # memoryviews of the same memory, for the one-key methods: indexing one returns a Python
        # int in ~30 ns, where indexing the array makes a numpy scalar
        self._mk = memoryview(self.keys.reshape(-1))
        self.mv = memoryview(self.vals.reshape(-1))
        self._mo = memoryview(self.occ.reshape(-1))

    def _sentinels(self, buckets: np.ndarray) -> np.ndarray:
        """Per bucket ``B``, a key whose buckets are ``B + 1`` and ``B + 2``, never ``B``."""
        first = ((buckets + 1) & self.mask).astype(U64) << self._shift
        second = ((buckets + 2) & self.mask).astype(U64) << self._shift2
        return (first | second) * _M_INVERSE

    def nbytes(self) -> int:
        return self.keys.nbytes + self.vals.nbytes + self.occ.nbytes + self._empty.nbytes

    def _homes(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        # both < 2**bits, so exact as int64 (a view: no copy)
        h = keys * _M
        return (h >> self._shift).view(np.int64), ((h >> self._shift2) & self._mask_u).view(
            np.int64)

    # --- lookups -----------------------------------------------------------------------------

    def find(self, keys: np.ndarray) -> np.ndarray:
        """Flat cell index (``bucket * 8 + way``) of each key, -1 where absent."""
        n = len(keys)
        if not n or not self.size:
            return np.full(n, -1, dtype=np.int64)
        return self._find(keys, *self._homes(keys))

    def find_homes(self, keys: np.ndarray) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
        """``find``, plus the keys' buckets for a following ``insert`` of some of them."""
        homes = self._homes(keys)
        if not self.size:
            return np.full(len(keys), -1, dtype=np.int64), homes
        return self._find(keys, *homes), homes

    def _find(self, keys: np.ndarray, b1: np.ndarray, b2: np.ndarray) -> np.ndarray:
        n = len(keys)
        both = np.concatenate((b1, b2))
        hit = self.keys.take(both, axis=0) == np.concatenate((keys, keys))[:, None]
        cell = both * _WAYS + hit.argmax(axis=1)
        found = hit.view(np.uint64)[:, 0] != 0  # any of the row's 8 bytes
        return np.where(found[:n], cell[:n], np.where(found[n:], cell[n:], -1))

    def get(self, key: int) -> int:
        """Cell of one key, -1 if absent."""
        return int(self.find(np.array([key], dtype=U64))[0])

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """Copies of every (key, value), in cell order."""
        kernel = index_kernel.active()
        if kernel is not None:  # (the size lags the cells inside ``insert``: count them)
            n = int(np.count_nonzero(self.occ))
            keys, vals = np.empty(n, dtype=U64), np.empty(n, dtype=self.dtype)
            kernel.occupied(self, keys, vals)
            return keys, vals
        return self.keys[self.occ], self.vals[self.occ]

    # --- one key at a time (events of a few blocks: a numpy call costs more than this) -------

    def find1(self, key: int) -> int:
        """``find`` for one key, in plain Python."""
        if not self.size:
            return -1
        h = (key * _M_INT) & _MASK64
        b = (h >> self._s1) * _WAYS
        row = self._mk[b:b + _WAYS].tolist()
        if key in row:
            return b + row.index(key)
        b = ((h >> self._s2) & self.mask) * _WAYS
        row = self._mk[b:b + _WAYS].tolist()
        if key in row:
            return b + row.index(key)
        return -1

    def insert1(self, key: int, val: int) -> int:
        """``insert`` for one absent key; returns its cell."""
        if self.size >= self._limit:
            self._grow(self.size + 1)
        cell = self._place1(key, val)
        if cell < 0:
            self.insert(np.array([key], dtype=U64), np.array([val], dtype=self.dtype))
            return self.find1(key)
        self.size += 1
        return cell

    def _place1(self, key: int, val: object) -> int:
        """Put one key in the emptier of its buckets, or make room with a cuckoo step;
        returns its cell, or -1 when both fail (the size is the caller's to count)."""
        h = (key * _M_INT) & _MASK64
        b1 = (h >> self._s1) * _WAYS
        b2 = ((h >> self._s2) & self.mask) * _WAYS
        mo = self._mo
        row1 = mo[b1:b1 + _WAYS].tolist()
        row2 = mo[b2:b2 + _WAYS].tolist()
        if row2.count(True) < row1.count(True):
            b1, row1 = b2, row2
        if False not in row1:  # both buckets full
            return self._relocate1(key, val)
        cell = b1 + row1.index(False)
        self._mk[cell] = key
        self.mv[cell] = val
        mo[cell] = True
        return cell

    def _buckets1(self, key: int) -> tuple[int, int]:
        h = (key * _M_INT) & _MASK64
        return h >> self._s1, (h >> self._s2) & self.mask

    def _relocate1(self, key: int, val: object) -> int:
        """Room for a key whose two buckets are full: move one of their keys to its other
        bucket, if that one has a free cell, and take its cell (one cuckoo step). Returns the
        key's cell, or -1 (then the table doubles). Cells of other keys may change, as they do
        when the table doubles: no caller keeps a cell across an insert."""
        mk, mo, mv = self._mk, self._mo, self.mv
        for b in self._buckets1(key):
            for cell in range(b * _WAYS, b * _WAYS + _WAYS):
                resident = mk[cell]
                r1, r2 = self._buckets1(resident)
                other = r2 if r1 == b else r1
                if other == b:
                    continue
                row = mo[other * _WAYS:other * _WAYS + _WAYS].tolist()
                if all(row):
                    continue
                to = other * _WAYS + row.index(False)
                mk[to], mv[to], mo[to] = resident, mv[cell], True
                mk[cell], mv[cell] = key, val
                return cell
        return -1

    def delete1(self, cell: int) -> None:
        self._mk[cell] = int(self._empty[cell // _WAYS])
        self._mo[cell] = False
        self.size -= 1

    # --- changes -----------------------------------------------------------------------------

    def insert(self, keys: np.ndarray, vals: np.ndarray,
               homes: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        """Add keys that are absent and distinct (the caller checked) with their values
        (``homes``: their buckets from ``find_homes``, if the table has not changed since)."""
        n = len(keys)
        if not n:
            return
        if (self.size + n) > _MAX_LOAD * self.keys.size:
            self._grow(self.size + n)
            homes = None
        vals = np.asarray(vals, dtype=self.dtype)
        if not self.size and n > _BULK:
            keys, vals = self._one_by_one(*self._fill_empty(keys, vals))
            homes = None
        while len(keys):
            keys, vals = self._place(keys, vals, homes)
            homes = None
            if len(keys):
                self._grow(self.size + n)  # both buckets of some key full: double and go on
        self.size += n

    def delete(self, cells: np.ndarray) -> None:
        """Empty the given (occupied, distinct) cells."""
        self.keys.reshape(-1)[cells] = self._empty.take(cells // _WAYS)
        self.occ.reshape(-1)[cells] = False
        self.size -= len(cells)

    def _place(self, keys: np.ndarray, vals: np.ndarray,
               homes: tuple[np.ndarray, np.ndarray] | None = None
               ) -> tuple[np.ndarray, np.ndarray]:
        """Put keys in the emptier of their two buckets; returns those that found no room."""
        b1, b2 = self._homes(keys) if homes is None else homes
        flat_keys, flat_vals, flat_occ = (self.keys.reshape(-1), self.vals.reshape(-1),
                                          self.occ.reshape(-1))
        for _ in range(_ROUNDS):
            m = len(keys)
            n = np.concatenate((b1, b2))
            occupied = self.occ.take(n, axis=0)
            used = popcount(occupied.view(np.uint64)[:, 0])  # occ bytes are 0 or 1
            second = used[m:] < used[:m]
            b = np.where(second, b2, b1)
            occ_b = np.where(second[:, None], occupied[m:], occupied[:m])
            order = np.argsort(b) if m > _WAYS * _WAYS else None  # a bulk batch: buckets repeat
            sb = np.sort(b) if order is None else b.take(order)
            if m == 1 or not (sb[1:] == sb[:-1]).any():  # one key per bucket: first free cell
                fits = np.where(second, used[m:], used[:m]) < _WAYS
                cell = b * _WAYS + occ_b.argmin(axis=1)
            else:
                # rank of each key among this batch's keys with the same bucket: the k-th of
                # them (in any fixed order) takes the bucket's k-th free cell
                if order is None:
                    order = np.argsort(b)
                first = np.empty(m, dtype=bool)
                first[0] = True
                np.not_equal(sb[1:], sb[:-1], out=first[1:])
                idx = np.arange(m)
                rank = np.empty(m, dtype=np.int64)
                rank[order] = idx - np.maximum.accumulate(np.where(first, idx, 0))
                free_upto = np.cumsum(~occ_b, axis=1, dtype=np.uint8)
                fits = free_upto[:, -1] > rank
                cell = b * _WAYS + (free_upto > rank[:, None]).argmax(axis=1)
            if fits.all():
                flat_keys[cell] = keys
                flat_vals[cell] = vals
                flat_occ[cell] = True
                return keys[:0], vals[:0]
            placed = cell[fits]
            flat_keys[placed] = keys[fits]
            flat_vals[placed] = vals[fits]
            flat_occ[placed] = True
            rest = ~fits
            keys, vals, b1, b2 = keys[rest], vals[rest], b1[rest], b2[rest]
            if len(keys) <= _FEW:
                break
        return self._one_by_one(keys, vals)

    def _one_by_one(self, keys: np.ndarray, vals: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``_place1`` for each key in turn (the emptier bucket, else a cuckoo step); returns
        those that found no room (then the table doubles)."""
        if not len(keys):
            return keys, vals
        kernel = index_kernel.active()
        if kernel is not None:  # (a bulk load ~70 % full leaves ~0.6 % of its keys here)
            left = kernel.place_each(self, np.ascontiguousarray(keys, dtype=U64),
                                     np.ascontiguousarray(vals, dtype=self.dtype))
        else:
            left = [i for i, (key, val) in enumerate(zip(keys.tolist(), vals.tolist(),
                                                         strict=True))
                    if self._place1(key, val) < 0]
        return keys[left], vals[left]

    def _fill_empty(self, keys: np.ndarray, vals: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Bulk load into an empty table (a restore, or a table that doubled): every key to
        its first bucket, ranked within it by one sort, the overflow likewise to its second
        bucket after what the first pass put there; returns the few keys left over.
        No occupancy is read, so this is a few passes over the keys whatever their number. The
        sorts are stable, so the compiled kernel's one pass per bucket choice places every key
        in the same cell. Both buckets of every key left are full (buckets only fill up here),
        so ``_place``'s rounds would place none of them: the callers go one by one."""
        kernel = index_kernel.active()
        if kernel is not None:
            rest = np.array(kernel.fill_empty(self, np.ascontiguousarray(keys, dtype=U64),
                                              np.ascontiguousarray(vals, dtype=self.dtype)),
                            dtype=np.int64)
            # (indexing, not ``take``: take copies a whole source that is not aligned, as a view
            # of a snapshot's buffer may be)
            return keys[rest], vals[rest]
        b1, b2 = self._homes(keys)
        fill = np.zeros(self.mask + 1, dtype=np.int64)
        flat_keys, flat_vals, flat_occ = (self.keys.reshape(-1), self.vals.reshape(-1),
                                          self.occ.reshape(-1))
        home = b1
        for _ in range(2):
            m = len(keys)
            if not m:
                break
            order = np.argsort(home, kind="stable")
            sb = home.take(order)
            first = np.empty(m, dtype=bool)
            first[0] = True
            np.not_equal(sb[1:], sb[:-1], out=first[1:])
            idx = np.arange(m)
            way = fill.take(sb) + idx - np.maximum.accumulate(np.where(first, idx, 0))
            fits = way < _WAYS
            cells = sb[fits] * _WAYS + way[fits]
            placed = order[fits]
            flat_keys[cells] = keys.take(placed)
            flat_vals[cells] = vals.take(placed)
            flat_occ[cells] = True
            fill += np.bincount(sb[fits], minlength=len(fill))
            rest = order[~fits]
            keys, vals, home = keys.take(rest), vals.take(rest), b2.take(rest)
        return keys, vals

    def _grow(self, need: int) -> None:
        keys, vals = self.items()
        bits = int(self.mask).bit_length() + 1
        while (1 << bits) * _WAYS * _MAX_LOAD < need:
            bits += 1
        while True:
            self._alloc(bits)  # the old arrays are released here; only the compact copies remain
            left, _ = self._one_by_one(*self._fill_empty(keys, vals))
            if not len(left):
                return
            bits += 1

    # --- snapshots: the cells themselves (index_arrays.py) -----------------------------------

    def bits(self) -> int:
        """log2 of the bucket count: with the cells, what a snapshot needs to rebuild this table."""
        return self._bits

    def homes(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each key's two buckets."""
        return self._homes(keys)

    @classmethod
    def with_bits(cls, dtype: np.dtype | type, bits: int) -> U64Table:
        """An empty table of ``2**bits`` buckets."""
        table = cls(dtype)
        if bits != table._bits:
            table._alloc(bits)
        return table

    def clone_in_steps(self, cells: int) -> Generator[None, None, U64Table]:
        """A copy that later changes to this table do not reach, taken a piece at a time: yields
        after each ``cells`` cells copied and returns the copy (``yield from``). The table must
        not change until the copy is returned."""
        keys, vals, occ = (np.empty_like(a) for a in (self.keys, self.vals, self.occ))
        pairs = [(a.reshape(-1), b.reshape(-1)) for a, b in
                 ((keys, self.keys), (vals, self.vals), (occ, self.occ))]
        for start in range(0, self.keys.size, cells):
            for copy, original in pairs:
                copy[start:start + cells] = original[start:start + cells]
            yield
        twin = U64Table.with_bits(self.dtype, _MIN_BITS)
        for name in ("_bits", "_empty", "_limit", "_mask_u", "_s1", "_s2", "_shift", "_shift2",
                     "mask", "size"):
            setattr(twin, name, getattr(self, name))
        twin.keys, twin.vals, twin.occ = keys, vals, occ
        twin._mk = memoryview(keys.reshape(-1))
        twin.mv = memoryview(vals.reshape(-1))
        twin._mo = memoryview(occ.reshape(-1))
        return twin

    @classmethod
    def from_cells(cls, dtype: np.dtype | type, bits: int, keys: np.ndarray, vals: np.ndarray,
                   occupancy: np.ndarray) -> U64Table:
        """A table of ``2**bits`` buckets whose occupied cells (``occupancy``: one bit a cell,
        packed little-endian) hold ``keys``/``vals`` in cell order: no hashing, no sorting.
        Raises ``ValueError`` unless every key sits in one of its two buckets."""
        table = cls.with_bits(dtype, bits)
        kernel = index_kernel.active()
        if kernel is not None:  # the same cells in one pass, without a temporary a cell
            kernel.place_occupied(table, np.ascontiguousarray(keys, dtype=U64),
                                  np.ascontiguousarray(vals, dtype=table.dtype),
                                  np.ascontiguousarray(occupancy, dtype=np.uint8))
            table.size = len(keys)
            return table
        occ = np.unpackbits(occupancy, bitorder="little").view(bool)
        cells = np.flatnonzero(occ)
        if len(occ) != table.keys.size or len(cells) != len(keys):
            raise ValueError("table cells do not match their occupancy")
        table.place_cells(cells, keys, vals, occupy=False)
        table.occ.reshape(-1)[:] = occ  # one cell a bit: distinct cells, no recount needed
        return table

    def place_cells(self, cells: np.ndarray, keys: np.ndarray, vals: np.ndarray, *,
                    checked: bool = False, occupy: bool = True) -> None:
        """Put keys (absent, distinct) at the given cells of an empty table. Raises
        ``ValueError`` if two share a cell or (unless the caller ``checked`` it: cells made
        from the keys' own buckets) a key is outside both of its buckets.

        ``occupy=False`` leaves the occupancy alone (a restore placing many batches: marking
        cells one by one is one more random write a key, and counting them a pass over the
        whole table); the caller then sets it itself or calls :meth:`occupy_placed`."""
        if not checked:
            b1, b2 = self._homes(keys)
            bucket = cells >> 3
            if not ((bucket == b1) | (bucket == b2)).all():
                raise ValueError("a key outside both of its buckets")
        self.keys.reshape(-1)[cells] = keys
        self.vals.reshape(-1)[cells] = vals
        self.size += len(keys)
        if occupy:
            occ = self.occ.reshape(-1)
            occ[cells] = True
            if int(np.count_nonzero(occ)) != self.size:
                raise ValueError("two keys in one cell")

    def occupy_placed(self) -> None:
        """After ``place_cells(..., occupy=False)``: the occupancy from the keys themselves, in
        one pass (an empty cell of bucket ``B`` holds its sentinel, whose buckets are ``B + 1``
        and ``B + 2``, so no key placed in ``B`` equals it), then the check that no two keys
        were placed in one cell."""
        self.occ[:] = self.keys != self._empty[:, None]
        if int(np.count_nonzero(self.occ)) != self.size:
            raise ValueError("two keys in one cell")
