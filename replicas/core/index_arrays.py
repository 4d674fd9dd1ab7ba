"""Snapshot forms v4 to v6 of the compact prefix index (``index.py``): its arrays themselves.

Restoring v3 (two columns per worker) rebuilt every hash table: each key's bucket again, a sort
to rank keys within buckets, a sort of every sequence hash to find the nodes several workers
share, ``np.unique`` per worker for the repeated ones. At 10 M pairs that is seconds of sorting
on the path to ``/ready``. v4 to v6 write the block tables as they are, so restoring them is
reading columns (``np.frombuffer``, on the snapshot's own buffer) and putting them back where
they were. Rows are the block tables' occupied cells, slot by slot, each slot's in cell order:

* ``ids`` (``u64``): every row's engine block id; each slot's **occupancy bitmap** (``occ``:
  one bit a cell, 1.2-2.4 bits a pair at the tables' 43-85 % load). Restore: each block
  table's keys put at its set bits (``U64Table.from_cells``: one pass of the kernel when built).
* The row that **owns** a node (its lowest-numbered holder slot, first of that slot's ids for
  it) carries the node's sequence hash (``seqs``, ``u64``); an ``own`` bit a row says which.
* The bitmaps of nodes several slots hold, with the row (``shared_rows``) that owns each: few,
  so small columns; a slot's repeated nodes (``_dups``) as ``dup_slots``, ``dup_seqs``,
  ``dup_counts``.

v6 (written since state format 6): every other row names its node by the **ordinal of the
owning row** among all owning rows (``refs``, ``u32``; ``u64`` past 2**32 nodes), and the node
table is not written at all: restore loads the owners' sequence hashes into a fresh table in
bulk (the compiled kernel's one pass when built, ``U64Table._fill_empty`` otherwise), the value
the owner's slot or its bitmap row, and reads every other row's hash from ``seqs`` at its
ordinal. The node table's cells are then not the live one's (only lookups and later changes
read them: no digest or answer depends on a cell). ~0.45 byte a pair less than v5, which wrote
each owner's **node code** (the cell: which of the hash's two buckets, bit 3, and which way,
bits 0-2; half a byte) so that the node table went back cell for cell, and each other row's
node as its node table cell (``u32``).

v5 (state format 5) and v4 (state format 4) are still read. v4 has a code byte per row (255:
another row owns the node; 254: this slot holds it under an earlier id too), every row's
sequence hash, and CRC-32s; v5 and v6 check an XXH3-64 per column (~25 GB/s here, CRC-32 ~3).

Slot numbers, block table sizes and cells are the live index's: the block tables restored are
the same arrays, not an equivalent rebuild. Every column's checksum is checked before anything
is placed; the snapshot store checks the whole blob's SHA-256 too. Bytes a pair, v6: 8 (id) +
1/8 (own bit) + what each row needs (owner: 8; other: 4) + the occupancy bits (v5: owner 8.5;
v4: 17 + the occupancy bits). Older versions (1-3) are read through ``index_codec.read_plain``.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import xxhash

from replicas.core.index_codec import members
from replicas.core.index_common import U64, mix_sum, worker_weight
from replicas.core.index_table import U64Table

PLAIN_VERSION_V4 = 4
PLAIN_VERSION_V5 = 5
PLAIN_VERSION_V6 = 6
_COLUMNS = ("ids", "own", "seqs", "refs", "occ", "shared_rows", "shared_masks", "dup_slots",
            "dup_seqs", "dup_counts")
U32 = np.dtype("<u4")


def _lowest_slots(rows: np.ndarray) -> np.ndarray:
    """Per bitmap row, its lowest set slot (-1 for an empty row)."""
    if not len(rows):
        return np.zeros(0, dtype=np.int64)
    nonzero = rows != 0
    word = nonzero.argmax(axis=1)
    bits = rows[np.arange(len(rows)), word]
    low = bits & (~bits + np.uint64(1))  # the lowest set bit alone (a power of two, exact)
    lowest = word * 64 + np.frexp(low.astype(np.float64))[1] - 1
    return np.where(nonzero.any(axis=1), lowest, -1)


# (slot, worker key, table bits, ids and seqs of its occupied cells, packed occupancy, dups)
_Slot = tuple[int, object, int, np.ndarray, np.ndarray, np.ndarray, dict[int, int]]


def row_seqs(own: np.ndarray, owned: np.ndarray, refs: np.ndarray, others: np.ndarray
             ) -> Callable[[int, int], np.ndarray]:
    """``seqs_of(start, end)`` for ``place_slots``, called for consecutive rows: their sequence
    hashes in order, an owning row's its own (the next of ``owned``), every other row's
    ``others[ref]`` (the next of ``refs``: v6 an owner's ordinal into ``owned``, v5 a node table
    cell into its keys)."""
    taken = [0, 0]  # owners', others' rows read so far

    def seqs_of(start: int, end: int) -> np.ndarray:
        mine = own[start:end]
        k = int(np.count_nonzero(mine))
        o, r = taken
        seqs = np.empty(end - start, dtype=U64)
        seqs[mine] = owned[o:o + k]
        # (indexing, not ``take``: take copies a source that is not aligned, as these views are)
        seqs[~mine] = others[refs[r:r + end - start - k]]
        taken[0], taken[1] = o + k, r + end - start - k
        return seqs

    return seqs_of


def _joined(parts: list[np.ndarray]) -> bytes:
    """The arrays' bytes end to end. ``bytes.join`` lets the GIL go for a large result only when
    every part is ``bytes`` (for buffers it keeps it: ~40 ms of a 10 M-pair snapshot's encoding
    thread held the event loop that long), so each part becomes ``bytes`` first, holding the GIL
    for one worker's copy (~0.1 ms) at a time."""
    return b"".join([part.tobytes() for part in parts])


def _ordinal_dtype(owners: int) -> np.dtype:
    """v6: the ordinals of ``owners`` owning rows (one per node)."""
    return U32 if owners <= 2**32 else U64


def _encode(blocks: list[_Slot], nodes: U64Table, rows: np.ndarray) -> dict[str, object]:
    lowest = _lowest_slots(rows)
    node_vals = nodes.vals.reshape(-1)
    # each owned node's owner ordinal, by its node table cell: an owner comes in an earlier slot
    # than the other rows of its node, or earlier in the same slot, so it is known when they come
    ordinal_at = np.zeros(node_vals.size, dtype=_ordinal_dtype(nodes.size))
    own: list[np.ndarray] = []
    owned: list[np.ndarray] = []
    refs: list[np.ndarray] = []
    shared_rows: list[np.ndarray] = []
    shared_of: list[np.ndarray] = []
    dup_slots: list[int] = []
    dup_seqs: list[int] = []
    dup_counts: list[int] = []
    offset = owners = 0
    for slot, _, _, _, seqs, _, dups in blocks:
        cells = nodes.find(seqs)
        if len(cells) and int(cells.min()) < 0:
            raise ValueError("a held block's node is missing from the node table")
        v = node_vals[cells].astype(np.int64)
        shared = v < 0
        owner = v == slot
        owner[shared] = lowest[-2 - v[shared]] == slot
        if dups:  # a node under several ids of this slot: the first of its rows owns it
            rows_of = np.flatnonzero(members(seqs, np.sort(np.fromiter(dups, U64, len(dups)))))
            _, first = np.unique(seqs[rows_of], return_index=True)  # first occurrences
            later = np.ones(len(rows_of), dtype=bool)
            later[first] = False
            owner[rows_of[later]] = False
            for seq, count in sorted(dups.items()):
                dup_slots.append(slot)
                dup_seqs.append(seq)
                dup_counts.append(count)
        mine = cells[owner]
        ordinal_at[mine] = np.arange(owners, owners + len(mine), dtype=ordinal_at.dtype)
        owners += len(mine)
        own.append(owner)
        owned.append(seqs[owner])
        refs.append(ordinal_at[cells[~owner]])
        held = np.flatnonzero(owner & shared)
        shared_rows.append(held + offset)
        shared_of.append(-2 - v[held])
        offset += len(seqs)
    masks = rows[np.concatenate(shared_of)] if shared_of else rows[:0]
    columns = {
        "ids": _joined([ids for _, _, _, ids, _, _, _ in blocks]),
        "own": np.packbits(np.concatenate(own or [np.zeros(0, bool)]), bitorder="little")
        .tobytes(),
        "seqs": _joined(owned),
        "refs": _joined(refs),
        "occ": _joined([occ for _, _, _, _, _, occ, _ in blocks]),
        "shared_rows": np.concatenate(shared_rows or [np.zeros(0, np.int64)]).astype(U64)
        .tobytes(),
        "shared_masks": np.ascontiguousarray(masks, dtype=U64).tobytes(),
        "dup_slots": np.array(dup_slots, dtype=U32).tobytes(),
        "dup_seqs": np.array(dup_seqs, dtype=U64).tobytes(),
        "dup_counts": np.array(dup_counts, dtype=U32).tobytes(),
    }
    return {"slots": [[w[0], w[1], slot, bits, len(ids)]  # type: ignore[index]
                      for slot, w, bits, ids, _, _, _ in blocks],
            "columns": columns,
            "checksums": [xxhash.xxh3_64_intdigest(columns[name]) for name in _COLUMNS]}


class _PlainColumns(msgspec.Struct):
    """Only to decode v5's and v6's columns as views of the snapshot's buffer (no copy)."""

    columns: dict[str, memoryview]


def plain_from_msgpack(raw: bytes | memoryview) -> object:
    """A plain index from its msgpack bytes; v5's and v6's columns as ``memoryview``s of ``raw``
    rather than copies (a 10 M-pair snapshot's are ~160 MB)."""
    obj = msgspec.msgpack.decode(raw, type=dict[str, msgspec.Raw])
    version = msgspec.msgpack.decode(obj["version"]) if "version" in obj else None
    if version not in (PLAIN_VERSION_V5, PLAIN_VERSION_V6):
        return msgspec.msgpack.decode(raw)
    plain: dict[str, object] = {k: msgspec.msgpack.decode(v) for k, v in obj.items()
                                if k != "columns"}
    plain["columns"] = msgspec.msgpack.decode(raw, type=_PlainColumns).columns
    return plain


def checked_columns(obj: dict[str, Any], names: tuple[str, ...],
                    checksum: Callable[[Any], int]) -> dict[str, Any]:
    """The plain form's columns, each checked against its checksum (a failing one named)."""
    columns = obj["columns"]
    sums = obj["checksums"]
    if not isinstance(columns, dict) or len(sums) != len(names):
        raise ValueError(f"malformed v{obj['version']} PrefixIndex")
    for name, want in zip(names, sums, strict=True):
        if name not in columns or checksum(columns[name]) != want:
            raise ValueError(f"v{obj['version']} PrefixIndex column {name!r} fails its "
                             f"checksum")
    return columns


def owned_rows(obj: dict[str, Any], names: tuple[str, ...]) -> tuple[
        dict[str, Any], list[tuple[str, int, int, int, int]], int, np.ndarray, np.ndarray]:
    """v5's and v6's columns (checked), slots, row count, which rows own their node (``own``)
    and the owned nodes' sequence hashes."""
    cols = checked_columns(obj, names, xxhash.xxh3_64_intdigest)
    slots = slot_rows(obj)
    total = sum(n for *_, n in slots)
    if len(cols["own"]) != (total + 7) // 8:
        raise ValueError(f"malformed v{obj['version']} PrefixIndex (column lengths)")
    own = np.unpackbits(np.frombuffer(cols["own"], dtype=np.uint8), count=total,
                        bitorder="little").view(bool)
    return cols, slots, total, own, np.frombuffer(cols["seqs"], dtype=U64)


def check_shared_rows(obj: dict[str, Any], shared: np.ndarray, total: int,
                      own: np.ndarray) -> None:
    """v5's and v6's shared nodes: owned rows, in increasing order."""
    if len(shared) and (int(shared.max()) >= total or not own[shared].all()
                        or (len(shared) > 1 and int(np.diff(shared).min()) <= 0)):
        raise ValueError(f"malformed v{obj['version']} PrefixIndex (shared nodes)")


def restore(index: Any, obj: dict[str, Any]) -> None:
    """Fill a fresh compact ``PrefixIndex`` from a v6 plain form (module docstring; v4 and v5:
    ``index_arrays_legacy.restore``)."""
    cols, slots, total, own, owned = owned_rows(obj, _COLUMNS)
    refs = np.frombuffer(cols["refs"], dtype=_ordinal_dtype(len(owned)))
    shared = np.frombuffer(cols["shared_rows"], dtype=U64).astype(np.int64)
    if int(np.count_nonzero(own)) != len(owned) or len(refs) != total - len(owned):
        raise ValueError("malformed v6 PrefixIndex (column lengths)")
    if len(refs) and int(refs.max()) >= len(owned):
        raise ValueError("malformed v6 PrefixIndex (a row's node has no owner)")
    check_shared_rows(obj, shared, total, own)
    words = int(obj["words"])
    masks = np.frombuffer(cols["shared_masks"], dtype=U64)
    if len(masks) != len(shared) * words:
        raise ValueError("malformed v6 PrefixIndex (shared nodes)")
    seqs_of = row_seqs(own, owned, refs, owned)
    index._holders.nodes = _load_owners(int(obj["node_bits"]), slots, own, owned, shared)
    place_slots(index, obj, slots, np.frombuffer(cols["ids"], dtype=U64), seqs_of,
                np.frombuffer(cols["occ"], dtype=np.uint8))
    index._holders.rows = masks.reshape(len(shared), words).copy()
    index._holders.rows_used = len(shared)
    index._holders.rows_free = []
    restore_dup_columns(index, cols)


def _load_owners(node_bits: int, slots: list[tuple[str, int, int, int, int]], own: np.ndarray,
                 owned: np.ndarray, shared: np.ndarray) -> U64Table:
    """v6's node table: the owners' sequence hashes loaded in bulk (one pass of the compiled
    kernel when built), each with its owner's slot, or ``-2 - k`` for the ``k``-th shared
    node (its bitmap is row ``k``). As many buckets as the live table had, or twice as many if
    it was over ``index_table._BULK_LOAD`` full: a bulk load that full leaves a few percent of
    the keys to cuckoo steps one by one (~7 us each; at 85 % some found no room, and the table
    doubled anyway). Its cells are not the live table's, which only lookups and later changes
    read, never a digest or an answer."""
    starts = np.cumsum([0] + [n for *_, n in slots]).tolist()
    counts = np.zeros(len(slots), dtype=np.int64)
    ordinals = np.zeros(len(shared), dtype=np.int64)
    before = 0
    for i, (start, end) in enumerate(itertools.pairwise(starts)):
        mine = own[start:end]
        counts[i] = np.count_nonzero(mine)
        lo, hi = np.searchsorted(shared, [start, end])
        if hi > lo:  # the shared nodes this slot owns: their rows' ordinals among the owners
            ordinals[lo:hi] = before + np.cumsum(mine)[shared[lo:hi] - start] - 1
        before += int(counts[i])
    vals = np.repeat(np.array([s for _, _, s, _, _ in slots], dtype=np.int32), counts)
    vals[ordinals] = -2 - np.arange(len(shared), dtype=np.int32)
    nodes = U64Table(np.int32, capacity=len(owned))
    if nodes.bits() < node_bits:
        nodes = U64Table.with_bits(np.int32, node_bits)
    nodes.insert(owned, vals)
    return nodes


def restore_dup_columns(index: Any, cols: dict[str, Any]) -> None:
    """v5's and v6's repeated nodes: each slot's ``{seq: ids beyond the first}``."""
    dup_slots = np.frombuffer(cols["dup_slots"], dtype=U32).tolist()
    dup_seqs = np.frombuffer(cols["dup_seqs"], dtype=U64).tolist()
    dup_counts = np.frombuffer(cols["dup_counts"], dtype=U32).tolist()
    if not len(dup_slots) == len(dup_seqs) == len(dup_counts) or any(
            not 0 <= s < len(index._keys) or index._keys[s] is None for s in set(dup_slots)):
        raise ValueError("malformed PrefixIndex (repeated nodes)")
    for slot, seq, count in zip(dup_slots, dup_seqs, dup_counts, strict=True):
        index._dups[slot][seq] = count


def slot_rows(obj: dict[str, Any]) -> list[tuple[str, int, int, int, int]]:
    """The slots' (worker id, rank, slot, table bits, rows), checked against ``slot_count``."""
    slots = [(str(w), int(r), int(s), int(b), int(n)) for w, r, s, b, n in obj["slots"]]
    slot_count = int(obj["slot_count"])
    if (any(not 0 <= s < slot_count for _, _, s, _, _ in slots)
            or len({s for _, _, s, _, _ in slots}) != len(slots)):
        raise ValueError(f"malformed v{obj['version']} PrefixIndex (slots)")
    return slots


def place_slots(index: Any, obj: dict[str, Any], slots: list[tuple[str, int, int, int, int]],
                ids: np.ndarray, seqs_of: Callable[[int, int], np.ndarray],
                occ_bytes: np.ndarray) -> None:
    """The slots, their block tables (cells in place) and digest sums, and the free slots;
    ``seqs_of(start, end)``: the sequence hashes of rows ``start`` to ``end``, in order."""
    total = sum(n for *_, n in slots)
    if len(ids) != total or len(occ_bytes) != sum(1 << b for _, _, _, b, _ in slots):
        raise ValueError(f"malformed v{obj['version']} PrefixIndex (column lengths)")
    slot_count = int(obj["slot_count"])
    index._keys = [None] * slot_count
    index._blocks = [U64Table(U64) for _ in range(slot_count)]
    index._dups = [{} for _ in range(slot_count)]
    index._sums = [0] * slot_count
    index._weights = [0] * slot_count
    at = occ_at = 0
    for worker_id, rank, slot, bits, n in slots:
        worker = (worker_id, rank)
        index._keys[slot] = worker
        index._slots[worker] = slot
        index._weights[slot] = worker_weight(worker)
        buckets = 1 << bits
        seqs = seqs_of(at, at + n)
        index._blocks[slot] = U64Table.from_cells(U64, bits, ids[at:at + n], seqs,
                                                  occ_bytes[occ_at:occ_at + buckets])
        index._sums[slot] = mix_sum(ids[at:at + n], seqs)
        at += n
        occ_at += buckets
    index._total = total
    index._free = [s for s in range(slot_count) if index._keys[s] is None]
    heapq.heapify(index._free)
