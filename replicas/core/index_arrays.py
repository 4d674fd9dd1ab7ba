"""Snapshot form v4 of the compact prefix index (``index.py``): its arrays themselves.

Restoring v3 (two columns per worker) rebuilt every hash table: each key's bucket again, a sort
to rank keys within buckets, a sort of every sequence hash to find the nodes several workers
share, ``np.unique`` per worker for the repeated ones. At 10 M pairs that is seconds of sorting
on the path to ``/ready``. v4 writes the tables as they are, so restoring is reading columns
(``np.frombuffer``) and putting them back where they were:

* per slot, its block table's occupied cells in cell order — ``ids`` and ``seqs`` (``u64``),
  16 bytes a held pair as in v3 — and the table's **occupancy bitmap** (``occ``: one bit a cell,
  1.2-2.4 bits a pair at the tables' 43-85 % load). Restore: a boolean-mask assignment.
* per row a **node code** (``codes``, one byte): the node table cell of its sequence hash, as
  which of the hash's two buckets (bit 3) and which way (bits 0-2), on the one row that
  *owns* the node (its lowest-numbered holder slot, first of its repeated ids); 255 elsewhere.
  The node table is not written at all: its keys are the owners' sequence hashes, put back at
  their cells with one scatter, the value the owner's slot.
  A row whose slot holds the same node under an earlier row's id says so (254): those rows
  are the slot's repeated nodes (``_dups``).
* the bitmaps of nodes several slots hold, with the row (``shared_rows``) that owns each: few,
  so small columns.

Slot numbers, table sizes and cells are the live index's: the restored index is the same arrays,
not an equivalent rebuild. Every column has a CRC-32 beside it, checked before anything is
placed; the snapshot store checks the whole blob's SHA-256 too. Costs: 17 bytes a pair raw, plus
the occupancy bits and the shared bitmaps (v3: 16). Older versions (1-3) are still read, through
``index_codec.read_plain``.
"""

from __future__ import annotations

import heapq
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np

from replicas.core.index_codec import expiry_columns
from replicas.core.index_common import U64, mix_sum, worker_weight
from replicas.core.index_table import U64Table

PLAIN_VERSION_V4 = 4
_NOT_OWNER = 255  # another slot owns the node
_REPEAT = 254  # this slot holds the node under an earlier row's id too (an entry of ``_dups``)
_COLUMNS = ("ids", "seqs", "occ", "codes", "shared_rows", "shared_masks")


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


def capture(index: Any, *, copy: bool = True) -> Callable[[], dict[str, object]]:
    """Copy what v4 needs out of ``index`` (a compact ``PrefixIndex``) now; the returned function
    encodes the copies, so it may run in a worker thread while the index keeps changing.

    The copies are the block tables' occupied cells and occupancy, and the node table's keys
    and values (memory copies: ~0.1 s for 10 M pairs on the event loop)."""
    blocks: list[tuple[int, object, int, np.ndarray, np.ndarray, np.ndarray, dict[int, int]]] = []
    for worker, slot in sorted(index._slots.items(), key=lambda kv: kv[1]):
        table = index._blocks[slot]
        occ = table.occ.reshape(-1)
        blocks.append((slot, worker, table.bits(), table.keys.reshape(-1)[occ],
                       table.vals.reshape(-1)[occ], np.packbits(occ, bitorder="little"),
                       dict(index._dups[slot])))
    holders = index._holders
    nodes = holders.nodes.clone()
    rows = holders.rows[:holders.rows_used].copy()
    expiry = dict(index._expiry) if copy else index._expiry
    keys = list(index._keys)
    head = {"version": PLAIN_VERSION_V4, "approximate": index.approximate,
            "ttl_secs": index.ttl_secs, "max_tree_size": index.max_tree_size,
            "prune_target_ratio": index.prune_target_ratio, "slot_count": len(keys),
            "node_bits": nodes.bits(), "words": int(holders.rows.shape[1])}
    counters = [[t, s, n] for (t, s), n in sorted(index.counters.items())]

    def build() -> dict[str, object]:
        return {**head, **_encode(blocks, nodes, rows),
                "expiry": expiry_columns(expiry, keys), "counters": counters}

    return build


def _encode(blocks: list[tuple[int, object, int, np.ndarray, np.ndarray, np.ndarray,
                               dict[int, int]]],
            nodes: U64Table, rows: np.ndarray) -> dict[str, object]:
    lowest = _lowest_slots(rows)
    node_vals = nodes.vals.reshape(-1)
    codes: list[np.ndarray] = []
    shared_rows: list[np.ndarray] = []
    shared_of: list[np.ndarray] = []
    offset = 0
    for slot, _, _, _, seqs, _, dups in blocks:
        cells = nodes.find(seqs)
        if len(cells) and int(cells.min()) < 0:
            raise ValueError("a held block's node is missing from the node table")
        v = node_vals[cells].astype(np.int64)
        shared = v < 0
        owner = v == slot
        owner[shared] = lowest[-2 - v[shared]] == slot
        b1, _ = nodes.homes(seqs)
        bucket = cells >> 3
        code = ((bucket != b1).astype(np.uint8) << np.uint8(3)) | (cells & 7).astype(np.uint8)
        code[~owner] = _NOT_OWNER
        if dups:  # a node under several ids of this slot: every row after its first repeats it
            rows_of = np.flatnonzero(np.isin(seqs, np.fromiter(dups, U64, len(dups))))
            seen: set[int] = set()
            for row, seq in zip(rows_of.tolist(), seqs[rows_of].tolist(), strict=True):
                if seq in seen:
                    owner[row] = False
                    code[row] = _REPEAT
                seen.add(seq)
        codes.append(code)
        mine = np.flatnonzero(owner & shared)
        shared_rows.append(mine + offset)
        shared_of.append(-2 - v[mine])
        offset += len(seqs)
    masks = rows[np.concatenate(shared_of)] if shared_of else rows[:0]
    columns = {
        "ids": b"".join(ids.data for _, _, _, ids, _, _, _ in blocks),
        "seqs": b"".join(seqs.data for _, _, _, _, seqs, _, _ in blocks),
        "occ": b"".join(occ.data for _, _, _, _, _, occ, _ in blocks),
        "codes": b"".join(c.data for c in codes),
        "shared_rows": np.concatenate(shared_rows or [np.zeros(0, np.int64)]).astype(U64)
        .tobytes(),
        "shared_masks": np.ascontiguousarray(masks, dtype=U64).tobytes(),
    }
    return {"slots": [[w[0], w[1], slot, bits, len(ids)]  # type: ignore[index]
                      for slot, w, bits, ids, _, _, _ in blocks],
            "columns": columns,
            "checksums": [zlib.crc32(columns[name]) for name in _COLUMNS]}


def _columns(obj: dict[str, Any]) -> dict[str, bytes]:
    columns = obj["columns"]
    crcs = obj["checksums"]
    if not isinstance(columns, dict) or len(crcs) != len(_COLUMNS):
        raise ValueError("malformed v4 PrefixIndex")
    for name, crc in zip(_COLUMNS, crcs, strict=True):
        if zlib.crc32(columns[name]) != crc:
            raise ValueError(f"v4 PrefixIndex column {name!r} fails its checksum")
    return columns


def restore(index: Any, obj: dict[str, Any]) -> None:
    """Fill a fresh compact ``PrefixIndex`` from a v4 plain form (see the module docstring)."""
    cols = _columns(obj)
    ids = np.frombuffer(cols["ids"], dtype=U64)
    seqs = np.frombuffer(cols["seqs"], dtype=U64)
    codes = np.frombuffer(cols["codes"], dtype=np.uint8)
    occ_bytes = np.frombuffer(cols["occ"], dtype=np.uint8)
    slots = [(str(w), int(r), int(s), int(b), int(n)) for w, r, s, b, n in obj["slots"]]
    slot_count = int(obj["slot_count"])
    total = sum(n for *_, n in slots)
    if (len(ids) != total or len(seqs) != total or len(codes) != total
            or len(occ_bytes) != sum(1 << b for _, _, _, b, _ in slots)
            or any(not 0 <= s < slot_count for _, _, s, _, _ in slots)
            or len({s for _, _, s, _, _ in slots}) != len(slots)):
        raise ValueError("malformed v4 PrefixIndex (column lengths)")
    index._keys = [None] * slot_count
    index._blocks = [U64Table(U64) for _ in range(slot_count)]
    index._dups = [{} for _ in range(slot_count)]
    index._sums = [0] * slot_count
    index._weights = [0] * slot_count
    row_slots = np.empty(total, dtype=np.int32)
    at = occ_at = 0
    for worker_id, rank, slot, bits, n in slots:
        worker = (worker_id, rank)
        index._keys[slot] = worker
        index._slots[worker] = slot
        index._weights[slot] = worker_weight(worker)
        buckets = 1 << bits
        index._blocks[slot] = U64Table.from_cells(U64, bits, ids[at:at + n], seqs[at:at + n],
                                                  occ_bytes[occ_at:occ_at + buckets])
        index._sums[slot] = mix_sum(ids[at:at + n], seqs[at:at + n])
        row_slots[at:at + n] = slot
        at += n
        occ_at += buckets
    index._total = total
    index._free = [s for s in range(slot_count) if index._keys[s] is None]
    heapq.heapify(index._free)
    _restore_dups(index._dups, row_slots, seqs, np.flatnonzero(codes == _REPEAT))
    _restore_nodes(index._holders, obj, seqs, codes, row_slots, cols)


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


def _restore_nodes(holders: Any, obj: dict[str, Any], seqs: np.ndarray, codes: np.ndarray,
                   row_slots: np.ndarray, cols: dict[str, bytes]) -> None:
    owner = np.flatnonzero(codes < _REPEAT)
    owned = seqs[owner]
    words = int(obj["words"])
    nodes = U64Table.with_bits(np.int32, int(obj["node_bits"]))
    cells = _cells_of(nodes, owned, codes[owner])
    vals = row_slots[owner]
    shared = np.frombuffer(cols["shared_rows"], dtype=U64).astype(np.int64)
    masks = np.frombuffer(cols["shared_masks"], dtype=U64)
    if len(masks) != len(shared) * words or (len(shared) and (
            int(shared.max()) >= len(seqs) or codes[shared].max() >= _REPEAT)):
        raise ValueError("malformed v4 PrefixIndex (shared nodes)")
    nodes.place_cells(cells, owned, vals, checked=True)  # _cells_of chose one of the two
    if len(shared):
        nodes.vals.reshape(-1)[_cells_of(nodes, seqs[shared], codes[shared])] = (
            -2 - np.arange(len(shared), dtype=np.int32))
    holders.nodes = nodes
    holders.rows = masks.reshape(len(shared), words).copy()
    holders.rows_used = len(shared)
    holders.rows_free = []


def _cells_of(table: U64Table, keys: np.ndarray, codes: np.ndarray) -> np.ndarray:
    b1, b2 = table.homes(keys)
    if len(codes) and int(codes.max()) > 15:
        raise ValueError("malformed v4 PrefixIndex (node codes)")
    return np.where(codes & 8, b2, b1) * 8 + (codes & 7)
