"""Snapshot forms v4 and v5 of the compact prefix index (``index.py``): its arrays themselves.

Restoring v3 (two columns per worker) rebuilt every hash table: each key's bucket again, a sort
to rank keys within buckets, a sort of every sequence hash to find the nodes several workers
share, ``np.unique`` per worker for the repeated ones. At 10 M pairs that is seconds of sorting
on the path to ``/ready``. v4 and v5 write the tables as they are, so restoring is reading
columns (``np.frombuffer``, on the snapshot's own buffer) and putting them back where they were.
Rows are the block tables' occupied cells, slot by slot, each slot's in cell order:

* ``ids`` (``u64``): every row's engine block id; each slot's **occupancy bitmap** (``occ``:
  one bit a cell, 1.2-2.4 bits a pair at the tables' 43-85 % load). Restore: a boolean-mask
  assignment per block table.
* The row that **owns** a node (its lowest-numbered holder slot, first of that slot's ids for
  it) carries the node's sequence hash (``seqs``, ``u64``) and its **node code**: the node
  table cell, as which of the hash's two buckets (bit 3) and which way (bits 0-2). The node
  table is not written at all: its keys are the owners' sequence hashes, put back at their
  cells with one scatter, the value the owner's slot.
* The bitmaps of nodes several slots hold, with the row (``shared_rows``) that owns each: few,
  so small columns.

v5 (written since state format 5) packs what v4 spent a byte a row on: an ``own`` bit a row,
the owners' codes two to a byte (``codes``), and every other row's sequence hash as the node
table cell that holds it (``refs``, ``u32``: 4 bytes instead of 8, read back from the restored
node table); a slot's repeated nodes (``_dups``) are columns of their own (``dup_slots``,
``dup_seqs``, ``dup_counts``) instead of being counted back from marked rows with a sort.
Its checksums are XXH3-64 per column (~25 GB/s here, CRC-32 ~3). v4 has a code byte per row
(255: another row owns the node; 254: this slot holds it under an earlier id too), every row's
sequence hash, and CRC-32s; it is still read.

Slot numbers, table sizes and cells are the live index's: the restored index is the same arrays,
not an equivalent rebuild. Every column's checksum is checked before anything is placed; the
snapshot store checks the whole blob's SHA-256 too. Bytes a pair, v5: 8 (id) + 1/8 (own bit) +
what each row needs (owner: 8.5; other: 4) + the occupancy bits (v4: 17 + the occupancy bits).
Older versions (1-3) are read through ``index_codec.read_plain``.
"""

from __future__ import annotations

import heapq
import zlib
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
_NOT_OWNER = 255  # v4: another slot owns the node
_REPEAT = 254  # v4: this slot holds the node under an earlier row's id too (an entry of ``_dups``)
_COLUMNS_V4 = ("ids", "seqs", "occ", "codes", "shared_rows", "shared_masks")
_COLUMNS = ("ids", "own", "seqs", "codes", "refs", "occ", "shared_rows", "shared_masks",
            "dup_slots", "dup_seqs", "dup_counts")
_U32 = np.dtype("<u4")


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


def _ref_dtype(node_bits: int) -> np.dtype:
    """Node table cells fit ``u32`` up to 2**29 buckets (3.6 G nodes at the tables' load)."""
    return _U32 if node_bits + 3 <= 32 else U64


def _encode(blocks: list[_Slot], nodes: U64Table, rows: np.ndarray) -> dict[str, object]:
    lowest = _lowest_slots(rows)
    node_vals = nodes.vals.reshape(-1)
    own: list[np.ndarray] = []
    owned: list[np.ndarray] = []
    codes: list[np.ndarray] = []
    refs: list[np.ndarray] = []
    shared_rows: list[np.ndarray] = []
    shared_of: list[np.ndarray] = []
    dup_slots: list[int] = []
    dup_seqs: list[int] = []
    dup_counts: list[int] = []
    ref_dtype = _ref_dtype(nodes.bits())
    offset = 0
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
        b1, _ = nodes.homes(seqs[owner])
        mine = cells[owner]
        own.append(owner)
        owned.append(seqs[owner])
        codes.append(((mine >> 3 != b1).astype(np.uint8) << np.uint8(3))
                     | (mine & 7).astype(np.uint8))
        refs.append(cells[~owner].astype(ref_dtype))
        held = np.flatnonzero(owner & shared)
        shared_rows.append(held + offset)
        shared_of.append(-2 - v[held])
        offset += len(seqs)
    code = np.concatenate(codes or [np.zeros(0, np.uint8)])
    if len(code) % 2:
        code = np.append(code, np.uint8(0))
    masks = rows[np.concatenate(shared_of)] if shared_of else rows[:0]
    columns = {
        "ids": b"".join(ids.data for _, _, _, ids, _, _, _ in blocks),
        "own": np.packbits(np.concatenate(own or [np.zeros(0, bool)]), bitorder="little")
        .tobytes(),
        "seqs": b"".join(o.data for o in owned),
        "codes": (code[0::2] | (code[1::2] << np.uint8(4))).tobytes(),
        "refs": b"".join(r.data for r in refs),
        "occ": b"".join(occ.data for _, _, _, _, _, occ, _ in blocks),
        "shared_rows": np.concatenate(shared_rows or [np.zeros(0, np.int64)]).astype(U64)
        .tobytes(),
        "shared_masks": np.ascontiguousarray(masks, dtype=U64).tobytes(),
        "dup_slots": np.array(dup_slots, dtype=_U32).tobytes(),
        "dup_seqs": np.array(dup_seqs, dtype=U64).tobytes(),
        "dup_counts": np.array(dup_counts, dtype=_U32).tobytes(),
    }
    return {"slots": [[w[0], w[1], slot, bits, len(ids)]  # type: ignore[index]
                      for slot, w, bits, ids, _, _, _ in blocks],
            "columns": columns,
            "checksums": [xxhash.xxh3_64_intdigest(columns[name]) for name in _COLUMNS]}


class _PlainV5(msgspec.Struct):
    """Only to decode v5's columns as views of the snapshot's buffer (no copy)."""

    columns: dict[str, memoryview]


def plain_from_msgpack(raw: bytes | memoryview) -> object:
    """A plain index from its msgpack bytes; v5's columns as ``memoryview``s of ``raw`` rather
    than copies (a 10 M-pair snapshot's are ~165 MB)."""
    obj = msgspec.msgpack.decode(raw, type=dict[str, msgspec.Raw])
    version = msgspec.msgpack.decode(obj["version"]) if "version" in obj else None
    if version != PLAIN_VERSION_V5:
        return msgspec.msgpack.decode(raw)
    plain: dict[str, object] = {k: msgspec.msgpack.decode(v) for k, v in obj.items()
                                if k != "columns"}
    plain["columns"] = msgspec.msgpack.decode(raw, type=_PlainV5).columns
    return plain


def _columns(obj: dict[str, Any], names: tuple[str, ...],
             checksum: Callable[[Any], int]) -> dict[str, Any]:
    columns = obj["columns"]
    sums = obj["checksums"]
    if not isinstance(columns, dict) or len(sums) != len(names):
        raise ValueError(f"malformed v{obj['version']} PrefixIndex")
    for name, want in zip(names, sums, strict=True):
        if name not in columns or checksum(columns[name]) != want:
            raise ValueError(f"v{obj['version']} PrefixIndex column {name!r} fails its "
                             f"checksum")
    return columns


def restore(index: Any, obj: dict[str, Any]) -> None:
    """Fill a fresh compact ``PrefixIndex`` from a v4 or v5 plain form (module docstring)."""
    if obj["version"] == PLAIN_VERSION_V4:
        _restore_v4(index, obj)
        return
    cols = _columns(obj, _COLUMNS, xxhash.xxh3_64_intdigest)
    slots = _slot_rows(obj)
    total = sum(n for *_, n in slots)
    if len(cols["own"]) != (total + 7) // 8:
        raise ValueError("malformed v5 PrefixIndex (column lengths)")
    own = np.unpackbits(np.frombuffer(cols["own"], dtype=np.uint8), count=total,
                        bitorder="little").view(bool)
    owned = np.frombuffer(cols["seqs"], dtype=U64)
    packed = np.frombuffer(cols["codes"], dtype=np.uint8)
    codes = np.empty(2 * len(packed), dtype=np.uint8)
    codes[0::2] = packed & np.uint8(15)
    codes[1::2] = packed >> np.uint8(4)
    node_bits = int(obj["node_bits"])
    refs = np.frombuffer(cols["refs"], dtype=_ref_dtype(node_bits))
    shared = np.frombuffer(cols["shared_rows"], dtype=U64).astype(np.int64)
    if (int(np.count_nonzero(own)) != len(owned) or len(packed) != (len(owned) + 1) // 2
            or len(refs) != total - len(owned)):
        raise ValueError("malformed v5 PrefixIndex (column lengths)")
    if len(shared) and (int(shared.max()) >= total or not own[shared].all()
                        or (len(shared) > 1 and int(np.diff(shared).min()) <= 0)):
        raise ValueError("malformed v5 PrefixIndex (shared nodes)")
    nodes, shared_cells = _place_owners(U64Table.with_bits(np.int32, node_bits), slots, own,
                                        owned, codes, shared)
    node_keys = nodes.keys.reshape(-1)
    if len(refs) and (int(refs.max()) >= len(node_keys)
                      or not nodes.occ.reshape(-1)[refs].all()):
        raise ValueError("malformed v5 PrefixIndex (a row's node is not in the node table)")
    owned_at = refs_at = 0

    def seqs_of(start: int, end: int) -> np.ndarray:
        """A slot's rows' sequence hashes: the owners' own, the others' from the node table."""
        nonlocal owned_at, refs_at
        mine = own[start:end]
        k = int(np.count_nonzero(mine))
        seqs = np.empty(end - start, dtype=U64)
        seqs[mine] = owned[owned_at:owned_at + k]
        seqs[~mine] = node_keys[refs[refs_at:refs_at + end - start - k]]
        owned_at += k
        refs_at += end - start - k
        return seqs

    _place_slots(index, obj, slots, np.frombuffer(cols["ids"], dtype=U64), seqs_of,
                 np.frombuffer(cols["occ"], dtype=np.uint8))
    _hold_shared(index._holders, nodes, shared_cells, int(obj["words"]),
                 np.frombuffer(cols["shared_masks"], dtype=U64))
    dup_slots = np.frombuffer(cols["dup_slots"], dtype=_U32).tolist()
    dup_seqs = np.frombuffer(cols["dup_seqs"], dtype=U64).tolist()
    dup_counts = np.frombuffer(cols["dup_counts"], dtype=_U32).tolist()
    if not len(dup_slots) == len(dup_seqs) == len(dup_counts) or any(
            not 0 <= s < len(index._keys) or index._keys[s] is None for s in set(dup_slots)):
        raise ValueError("malformed v5 PrefixIndex (repeated nodes)")
    for slot, seq, count in zip(dup_slots, dup_seqs, dup_counts, strict=True):
        index._dups[slot][seq] = count


def _place_owners(nodes: U64Table, slots: list[tuple[str, int, int, int, int]],
                  own: np.ndarray, owned: np.ndarray, codes: np.ndarray, shared: np.ndarray
                  ) -> tuple[U64Table, np.ndarray]:
    """The node table from the owning rows (key: the row's sequence hash, value: its slot, at
    the cell its code names), and the cells of the ``shared`` rows' nodes. Slot by slot, so
    that no temporary is as large as the whole index: at 10 M pairs each would be tens of MB of
    fresh pages (page faults) on the way to ``/ready``."""
    starts = np.cumsum([0] + [n for *_, n in slots]).tolist()
    owned_at = 0
    shared_cells = np.zeros(len(shared), dtype=np.int64)
    for (_, _, slot, _, _), start, end in zip(slots, starts[:-1], starts[1:], strict=True):
        mine = own[start:end]
        k = int(np.count_nonzero(mine))
        keys = owned[owned_at:owned_at + k]
        cells = _cells_of(nodes, keys, codes[owned_at:owned_at + k])
        nodes.place_cells(cells, keys, np.full(k, slot, dtype=np.int32), checked=True,
                          occupy=False)
        lo, hi = np.searchsorted(shared, [start, end])
        if hi > lo:  # the shared nodes this slot owns: their rows' places among its owners
            shared_cells[lo:hi] = cells[np.cumsum(mine)[shared[lo:hi] - start] - 1]
        owned_at += k
    nodes.occupy_placed()
    return nodes, shared_cells


def _slot_rows(obj: dict[str, Any]) -> list[tuple[str, int, int, int, int]]:
    """The slots' (worker id, rank, slot, table bits, rows), checked against ``slot_count``."""
    slots = [(str(w), int(r), int(s), int(b), int(n)) for w, r, s, b, n in obj["slots"]]
    slot_count = int(obj["slot_count"])
    if (any(not 0 <= s < slot_count for _, _, s, _, _ in slots)
            or len({s for _, _, s, _, _ in slots}) != len(slots)):
        raise ValueError(f"malformed v{obj['version']} PrefixIndex (slots)")
    return slots


def _row_slots(slots: list[tuple[str, int, int, int, int]], total: int) -> np.ndarray:
    return np.repeat(np.array([s for _, _, s, _, _ in slots], dtype=np.int32),
                     [n for *_, n in slots]) if slots else np.zeros(total, dtype=np.int32)


def _place_slots(index: Any, obj: dict[str, Any], slots: list[tuple[str, int, int, int, int]],
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


def _hold_shared(holders: Any, nodes: U64Table, cells: np.ndarray, words: int,
                 masks: np.ndarray) -> None:
    """The node table (its owners placed) and the bitmaps of the nodes at ``cells``."""
    if len(masks) != len(cells) * words:
        raise ValueError("malformed PrefixIndex (shared nodes)")
    if len(cells):
        nodes.vals.reshape(-1)[cells] = -2 - np.arange(len(cells), dtype=np.int32)
    holders.nodes = nodes
    holders.rows = masks.reshape(len(cells), words).copy()
    holders.rows_used = len(cells)
    holders.rows_free = []


# --- v4 (read only) ---------------------------------------------------------------------------


def _restore_v4(index: Any, obj: dict[str, Any]) -> None:
    cols = _columns(obj, _COLUMNS_V4, zlib.crc32)
    ids = np.frombuffer(cols["ids"], dtype=U64)
    seqs = np.frombuffer(cols["seqs"], dtype=U64)
    codes = np.frombuffer(cols["codes"], dtype=np.uint8)
    slots = _slot_rows(obj)
    total = sum(n for *_, n in slots)
    if len(codes) != total or len(seqs) != total:
        raise ValueError("malformed v4 PrefixIndex (column lengths)")
    _place_slots(index, obj, slots, ids, lambda start, end: seqs[start:end],
                 np.frombuffer(cols["occ"], dtype=np.uint8))
    row_slots = _row_slots(slots, total)
    _restore_dups(index._dups, row_slots, seqs, np.flatnonzero(codes == _REPEAT))
    owner = np.flatnonzero(codes < _REPEAT)
    owned = seqs[owner]
    nodes = U64Table.with_bits(np.int32, int(obj["node_bits"]))
    nodes.place_cells(_cells_of(nodes, owned, codes[owner]), owned, row_slots[owner],
                      checked=True)  # _cells_of chose one of the two
    shared = np.frombuffer(cols["shared_rows"], dtype=U64).astype(np.int64)
    if len(shared) and (int(shared.max()) >= len(seqs) or codes[shared].max() >= _REPEAT):
        raise ValueError("malformed v4 PrefixIndex (shared nodes)")
    _hold_shared(index._holders, nodes, _cells_of(nodes, seqs[shared], codes[shared]),
                 int(obj["words"]), np.frombuffer(cols["shared_masks"], dtype=U64))


def _restore_dups(dups: list[dict[int, int]], row_slots: np.ndarray, seqs: np.ndarray,
                  repeats: np.ndarray) -> None:
    """Each slot's ``{seq: ids beyond the first}`` from its repeat rows: counted by one sort
    (there can be millions of repeat rows, of far fewer distinct nodes)."""
    if not len(repeats):
        return
    slots, nodes = row_slots[repeats], seqs[repeats]
    order = np.lexsort((nodes, slots))
    slots, nodes = slots[order], nodes[order]
    first = np.ones(len(order), dtype=bool)
    first[1:] = (slots[1:] != slots[:-1]) | (nodes[1:] != nodes[:-1])
    starts = np.flatnonzero(first)
    counts = np.diff(np.append(starts, len(order)))
    for slot, seq, count in zip(slots[starts].tolist(), nodes[starts].tolist(), counts.tolist(),
                                strict=True):
        dups[slot][seq] = count


def _cells_of(table: U64Table, keys: np.ndarray, codes: np.ndarray) -> np.ndarray:
    b1, b2 = table.homes(keys)
    if len(codes) and int(codes.max()) > 15:
        raise ValueError("malformed PrefixIndex (node codes)")
    return np.where(codes & 8, b2, b1) * 8 + (codes & 7)
