"""Snapshot forms v4 and v5 of the compact prefix index, read only (``index_arrays.py`` writes
and reads v6 and says what the columns are).

Both put the node table back cell for cell: each owning row carries its node's **code**, which of
the hash's two buckets (bit 3) and which way (bits 0-2), and the table is one scatter of the
owners' hashes at those cells. v5 (state format 5) packs the codes two to a byte and names every
other row's node by its node table cell (``refs``, ``u32``), read back from the restored table;
v4 (state format 4) has a code byte per row (255: another row owns the node; 254: this slot holds
it under an earlier id too), every row's sequence hash, and CRC-32s instead of XXH3-64s.
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np

from replicas.core.index_arrays import (
    PLAIN_VERSION_V4,
    U32,
    check_shared_rows,
    checked_columns,
    owned_rows,
    place_slots,
    restore_dup_columns,
    row_seqs,
    slot_rows,
)
from replicas.core.index_common import U64
from replicas.core.index_table import U64Table

_NOT_OWNER = 255  # v4: another slot owns the node
_REPEAT = 254  # v4: this slot holds the node under an earlier row's id too (an entry of ``_dups``)
_COLUMNS_V4 = ("ids", "seqs", "occ", "codes", "shared_rows", "shared_masks")
_COLUMNS_V5 = ("ids", "own", "seqs", "codes", "refs", "occ", "shared_rows", "shared_masks",
               "dup_slots", "dup_seqs", "dup_counts")


def restore(index: Any, obj: dict[str, Any]) -> None:
    """Fill a fresh compact ``PrefixIndex`` from a v4 or v5 plain form."""
    if obj["version"] == PLAIN_VERSION_V4:
        _restore_v4(index, obj)
    else:
        _restore_v5(index, obj)


def _restore_v5(index: Any, obj: dict[str, Any]) -> None:
    cols, slots, total, own, owned = owned_rows(obj, _COLUMNS_V5)
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
    check_shared_rows(obj, shared, total, own)
    nodes, shared_cells = _place_owners(U64Table.with_bits(np.int32, node_bits), slots, own,
                                        owned, codes, shared)
    node_keys = nodes.keys.reshape(-1)
    if len(refs) and (int(refs.max()) >= len(node_keys)
                      or not nodes.occ.reshape(-1)[refs].all()):
        raise ValueError("malformed v5 PrefixIndex (a row's node is not in the node table)")
    seqs_of = row_seqs(own, owned, refs, node_keys)
    place_slots(index, obj, slots, np.frombuffer(cols["ids"], dtype=U64), seqs_of,
                np.frombuffer(cols["occ"], dtype=np.uint8))
    _hold_shared(index._holders, nodes, shared_cells, int(obj["words"]),
                 np.frombuffer(cols["shared_masks"], dtype=U64))
    restore_dup_columns(index, cols)


def _ref_dtype(node_bits: int) -> np.dtype:
    """v5: node table cells fit ``u32`` up to 2**29 buckets (3.6 G nodes at the tables' load)."""
    return U32 if node_bits + 3 <= 32 else U64


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


def _restore_v4(index: Any, obj: dict[str, Any]) -> None:
    cols = checked_columns(obj, _COLUMNS_V4, zlib.crc32)
    ids = np.frombuffer(cols["ids"], dtype=U64)
    seqs = np.frombuffer(cols["seqs"], dtype=U64)
    codes = np.frombuffer(cols["codes"], dtype=np.uint8)
    slots = slot_rows(obj)
    total = sum(n for *_, n in slots)
    if len(codes) != total or len(seqs) != total:
        raise ValueError("malformed v4 PrefixIndex (column lengths)")
    place_slots(index, obj, slots, ids, lambda start, end: seqs[start:end],
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


def _row_slots(slots: list[tuple[str, int, int, int, int]], total: int) -> np.ndarray:
    return np.repeat(np.array([s for _, _, s, _, _ in slots], dtype=np.int32),
                     [n for *_, n in slots]) if slots else np.zeros(total, dtype=np.int32)


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
