"""What both forms of the prefix index share: the worker key, the answer of ``find_matches``, and
the digest terms (design.md §5).

The digest must come out equal whichever form computed it (replicas running different builds
compare digests, and the reference form checks the compact one in tests), so its terms live here,
once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat

import numpy as np
import xxhash

from eventlog.hashing import MASK64

WorkerKey = tuple[str, int]  # (worker_id, dp_rank)

DIGEST_SALT = 0x5BD1E9955BD1E995  # xored into seq hashes so that seq 0 still moves the digest
U64 = np.dtype("<u8")
_SALT, _TWO, _ONE = np.uint64(DIGEST_SALT), np.uint64(2), np.uint64(1)


@dataclass(frozen=True, slots=True)
class OverlapScores:
    scores: dict[WorkerKey, int]  # matched prefix blocks per worker key (only keys with > 0)
    tree_sizes: dict[WorkerKey, int]  # blocks held per worker key (every key that holds any)


@dataclass(frozen=True, slots=True)
class MatchColumns:
    """``find_matches`` as columns, for candidate columns (candidate_columns.py): one row per
    worker key holding any block (``tree_sizes``' keys), in the index's slot order. A key with no
    row has overlap and tree size 0, exactly as a key missing from ``OverlapScores``' dicts.

    ``workers`` is the same list object from one query to the next while the rows stay the same,
    so a caller can keep columns aligned with it until it changes."""

    workers: list[WorkerKey]
    overlap_blocks: np.ndarray  # int64, matched prefix blocks per row
    tree_sizes: np.ndarray  # int64, blocks held per row
    rows: dict[WorkerKey, int]  # worker key -> its row (built with ``workers``)

    @classmethod
    def from_scores(cls, scores: OverlapScores) -> MatchColumns:
        workers = list(scores.tree_sizes)
        return cls(workers,
                   np.fromiter((scores.scores.get(k, 0) for k in workers), np.int64, len(workers)),
                   np.fromiter(scores.tree_sizes.values(), np.int64, len(workers)),
                   {k: i for i, k in enumerate(workers)})

    def rows_of(self, keys: Sequence[WorkerKey]) -> np.ndarray:
        """Each of ``keys``' row here (-1 for a key with no row): the same for every query while
        ``workers`` is the same list, so a caller may keep it that long."""
        return np.fromiter(map(self.rows.get, keys, repeat(-1)), np.int64, len(keys))

    def for_keys(self, keys: Sequence[WorkerKey], where: np.ndarray | None = None
                 ) -> tuple[np.ndarray, np.ndarray]:
        """(overlap, tree size) of each of ``keys``, in their order (0 for a key with no row);
        ``where``: ``rows_of(keys)``, if the caller kept it."""
        if not self.workers:
            return np.zeros(len(keys), dtype=np.int64), np.zeros(len(keys), dtype=np.int64)
        if where is None:
            where = self.rows_of(keys)
        missing = where < 0
        overlap = self.overlap_blocks[where]
        tree = self.tree_sizes[where]
        if missing.any():
            overlap[missing] = 0
            tree[missing] = 0
        return overlap, tree

    def to_scores(self) -> OverlapScores:
        overlap = self.overlap_blocks.tolist()
        return OverlapScores({k: n for k, n in zip(self.workers, overlap, strict=True) if n},
                             dict(zip(self.workers, self.tree_sizes.tolist(), strict=True)))


def worker_weight(worker: WorkerKey) -> int:
    """Odd 64-bit weight of a worker key in the digest (odd, so it never cancels a change)."""
    return xxhash.xxh3_64_intdigest(f"{worker[0]}\x1f{worker[1]}".encode(), 0x4A52) | 1


def membership_mix(block_hash: int, seq: int) -> int:
    """Digest term of one (block_hash -> seq) entry; nonlinear so swapped pairs do not cancel."""
    return ((seq ^ DIGEST_SALT) * (2 * block_hash + 1)) & MASK64


def mix_sum(block_hashes: np.ndarray, seqs: np.ndarray) -> int:
    """Sum of :func:`membership_mix` over columns, mod 2**64 (uint64 arithmetic wraps exactly)."""
    odd = block_hashes * _TWO  # arrays never warn on overflow
    odd += _ONE
    odd *= seqs ^ _SALT  # in place: a restore sums 64 slots of ~150 k rows each
    return int(odd.sum(dtype=np.uint64))


def popcount(words: np.ndarray) -> np.ndarray:
    """Set bits of each ``u64`` (``np.bitwise_count`` from numpy 2.0; numpy 1.26 is allowed too)."""
    if _BITWISE_COUNT is not None:
        return _BITWISE_COUNT(words)  # type: ignore[no-any-return]
    as_bytes = np.ascontiguousarray(words).view(np.uint8).reshape(*words.shape, 8)
    return np.unpackbits(as_bytes, axis=-1).sum(axis=-1, dtype=np.uint8)


_BITWISE_COUNT = getattr(np, "bitwise_count", None)


LiveRows = tuple[np.ndarray, list[WorkerKey], np.ndarray, dict[WorkerKey, int], int, int]
"""What ``match_columns`` answers for: the slots holding any block (in slot order), their keys,
their tree sizes, each key's row, and the size and slot epochs they were read at."""


def live_rows(cached: LiveRows | None, sizes: np.ndarray, keys: Sequence[WorkerKey | None],
              sizes_epoch: int, slots_epoch: int) -> LiveRows:
    """Both index forms' live rows from ``sizes`` (tree size per slot): the keys and rows are
    kept, the same list, while the same slots of the same workers hold blocks, so a caller's
    rows keyed by that list stay valid across events that only change sizes."""
    live = np.flatnonzero(sizes)
    if cached is not None and cached[5] == slots_epoch and np.array_equal(cached[0], live):
        workers, rows = cached[1], cached[3]
    else:
        workers = [keys[s] for s in live.tolist()]  # type: ignore[misc]
        rows = {w: i for i, w in enumerate(workers)}
    return (live, workers, sizes[live], rows, sizes_epoch, slots_epoch)
