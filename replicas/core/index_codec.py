"""Snapshot form of the prefix index: the columns both index forms write and read (design.md §8).

Three versions of the plain form (msgspec-encodable: lists, ints, floats, strs, bytes) exist:

* **v1** — per worker key a flat int list ``[block_hash, seq, parent (-1 for a root), ...]``;
* **v2** — per worker key little-endian ``u64`` columns of block ids and sequence hashes, plus
  each row's parent as a *kind* (chained to the previous row, root, or explicit) with only the
  explicit parents stored (written by the reference form, ``index_reference.py``);
* **v3** — per worker key just the two ``u64`` columns, block ids and sequence hashes: 16 bytes
  per held (block, worker) pair. The compact index (``index.py``) keeps no parents, because a
  query walks the prompt from its first block and so never needs them, and writes v3.

Every version is still read: :func:`read_plain` turns any of them into the same columns. Both
forms keep the approximate-mode expiries as ``[id, rank, seqs, expiries, depths]`` columns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat

import numpy as np

from eventlog.hashing import MASK64
from replicas.core.index_common import U64, WorkerKey

Entry = int  # a reference-form held block: seq | (parent seq + 1) << 64
PLAIN_VERSION_V2 = 2
PLAIN_VERSION_V3 = 3
_ROOT = -1  # a root block's parent in v1 rows
U64_MAX = np.uint64(MASK64)
_KIND_EXPLICIT, _KIND_CHAINED, _KIND_ROOT = 0, 1, 2  # where a row's parent sequence hash is


def block_columns(bmap: dict[int, Entry]) -> list[object]:
    """One slot map as ``[count, block ids, seqs, parent kinds, explicit parents]`` (bytes)."""
    n = len(bmap)
    block_hashes = np.fromiter(bmap.keys(), dtype=U64, count=n)
    seqs = np.fromiter(map(MASK64.__and__, bmap.values()), dtype=U64, count=n)
    try:  # parent + 1 (0 for a root); 2**64 only for the parent 2**64 - 1
        high = np.fromiter(map((64).__rrshift__, bmap.values()), dtype=U64, count=n)
        roots = high == 0
        parents = high - np.uint64(1)  # a root's wraps; its kind says it has none
    except OverflowError:
        highs = [e >> 64 for e in bmap.values()]
        roots = np.array([h == 0 for h in highs], dtype=bool)
        parents = np.array([(h - 1) & MASK64 for h in highs], dtype=U64)
    kinds = np.zeros(n, dtype=np.uint8)
    if n > 1:
        kinds[1:][parents[1:] == seqs[:-1]] = _KIND_CHAINED
    kinds[roots] = _KIND_ROOT
    explicit = parents[kinds == _KIND_EXPLICIT]
    return [n, block_hashes.tobytes(), seqs.tobytes(), kinds.tobytes(), explicit.tobytes()]


def columns_v2(n: int, block_ids: bytes, seq_bytes: bytes, kind_bytes: bytes,
                explicit_bytes: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Inverse of :func:`block_columns`: block ids, seqs, parents, root flags."""
    block_hashes = np.frombuffer(block_ids, dtype=U64)
    seqs = np.frombuffer(seq_bytes, dtype=U64)
    kinds = np.frombuffer(kind_bytes, dtype=np.uint8)
    explicit = np.frombuffer(explicit_bytes, dtype=U64)
    is_explicit = kinds == _KIND_EXPLICIT
    chained = np.flatnonzero(kinds == _KIND_CHAINED)
    if (not len(block_hashes) == len(seqs) == len(kinds) == n
            or int(np.count_nonzero(is_explicit)) != len(explicit)
            or (n and int(kinds.max()) > _KIND_ROOT) or (len(chained) and chained[0] == 0)):
        raise ValueError("malformed block columns in a plain PrefixIndex")
    parents = np.zeros(n, dtype=U64)
    parents[is_explicit] = explicit
    parents[chained] = seqs[chained - 1]
    return block_hashes, seqs, parents, kinds == _KIND_ROOT


def columns_v1(flat: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """v1 rows ``[block_hash, seq, parent (-1 for a root), ...]`` as v2 columns."""
    parents = flat[2::3]
    return (np.array(flat[0::3], dtype=U64), np.array(flat[1::3], dtype=U64),
            np.array([p & MASK64 for p in parents], dtype=U64),
            np.array([p == _ROOT for p in parents], dtype=bool))


def members(values: np.ndarray, sorted_set: np.ndarray) -> np.ndarray:
    """Which ``values`` occur in ``sorted_set`` (sorted, distinct): one bisection each."""
    if not len(sorted_set):
        return np.zeros(len(values), dtype=bool)
    at = np.minimum(np.searchsorted(sorted_set, values), len(sorted_set) - 1)
    return sorted_set[at] == values


def node_masks(held: list[tuple[int, np.ndarray]]) -> dict[int, int]:
    """``seq -> bitmask of slots`` from each slot's distinct sequence hashes (sorted): one bulk
    insert per slot, then Python ORs only for the hashes several slots share."""
    nodes: dict[int, int] = {}
    for slot, seqs in held:
        nodes.update(zip(seqs.tolist(), repeat(1 << slot)))  # repeat() is endless
    if len(held) < 2:
        return nodes
    every = np.sort(np.concatenate([seqs for _, seqs in held]))
    shared = np.unique(every[1:][every[1:] == every[:-1]])
    if len(shared):
        masks = dict.fromkeys(shared.tolist(), 0)
        for slot, seqs in held:
            bit = 1 << slot
            for seq in seqs[members(seqs, shared)].tolist():
                masks[seq] |= bit
        nodes.update(masks)
    return nodes


def expiry_columns(expiry: dict[tuple[int, int], tuple[float, int]],
                    keys: list[WorkerKey | None]) -> list[list[object]]:
    """Approximate-mode expiries per worker key: ``[id, rank, seqs, expiries, depths]``."""
    per_slot: dict[int, list[tuple[int, float, int]]] = {}
    for (slot, seq), (expires, depth) in expiry.items():
        per_slot.setdefault(slot, []).append((seq, expires, depth))
    out: list[list[object]] = []
    for slot, rows in sorted(per_slot.items(), key=lambda kv: keys[kv[0]]):  # type: ignore[arg-type, return-value]
        worker = keys[slot]
        assert worker is not None
        seqs, expires, depths = zip(*rows, strict=True)
        out.append([worker[0], worker[1], np.array(seqs, dtype=U64).tobytes(),
                    np.array(expires, dtype="<f8").tobytes(),
                    np.array(depths, dtype="<i8").tobytes()])
    return out


def expiry_v2(seqs: bytes, expires: bytes, depths: bytes
               ) -> tuple[list[int], list[float], list[int]]:
    out = (np.frombuffer(seqs, dtype=U64).tolist(), np.frombuffer(expires, dtype="<f8").tolist(),
           np.frombuffer(depths, dtype="<i8").tolist())
    if not len(out[0]) == len(out[1]) == len(out[2]):
        raise ValueError("malformed expiry columns in a plain PrefixIndex")
    return out


def expiry_v1(flat: Sequence[float | int]) -> tuple[list[int], list[float], list[int]]:
    return ([int(x) for x in flat[0::3]], [float(x) for x in flat[1::3]],
            [int(x) for x in flat[2::3]])


@dataclass(slots=True)
class PlainColumns:
    """A plain index of any version, as columns: what the compact index restores from."""

    approximate: bool
    ttl_secs: float
    max_tree_size: int
    prune_target_ratio: float
    workers: list[tuple[WorkerKey, np.ndarray, np.ndarray]]  # (key, block ids, seqs)
    expiry: list[tuple[WorkerKey, list[int], list[float], list[int]]]  # (key, seqs, exp., depths)
    counters: dict[tuple[str, str], int]


def read_plain(obj: object) -> PlainColumns:
    """Any plain version (1, 2 or 3) as columns; parents (v1, v2) are checked, then dropped."""
    if not isinstance(obj, dict) or obj.get("version") not in (1, PLAIN_VERSION_V2,
                                                               PLAIN_VERSION_V3):
        raise ValueError("not a plain PrefixIndex (version mismatch)")
    version = obj["version"]
    workers: list[tuple[WorkerKey, np.ndarray, np.ndarray]] = []
    for row in obj["workers"]:
        key = (str(row[0]), int(row[1]))
        if version == 1:
            block_hashes, seqs, _, _ = columns_v1(row[2])
        elif version == PLAIN_VERSION_V2:
            block_hashes, seqs, _, _ = columns_v2(*row[2:])
        else:
            block_hashes, seqs = columns_v3(*row[2:])
        workers.append((key, block_hashes, seqs))
    expiry = read_expiry(obj)
    return PlainColumns(bool(obj["approximate"]), float(obj["ttl_secs"]),
                        int(obj["max_tree_size"]), float(obj["prune_target_ratio"]),
                        workers, expiry,  # type: ignore[arg-type]
                        {(t, s): int(n) for t, s, n in obj["counters"]})


def read_expiry(obj: dict[str, object]
                ) -> list[tuple[WorkerKey, list[int], list[float], list[int]]]:
    """The approximate-mode expiries of any plain version, per worker key."""
    return [((str(row[0]), int(row[1])),
             *(expiry_v1(row[2]) if obj["version"] == 1 else expiry_v2(*row[2:])))
            for row in obj["expiry"]]  # type: ignore[attr-defined]


def columns_v3(n: int, block_ids: bytes, seq_bytes: bytes) -> tuple[np.ndarray, np.ndarray]:
    block_hashes = np.frombuffer(block_ids, dtype=U64)
    seqs = np.frombuffer(seq_bytes, dtype=U64)
    if not len(block_hashes) == len(seqs) == n:
        raise ValueError("malformed block columns in a plain PrefixIndex")
    return block_hashes, seqs
