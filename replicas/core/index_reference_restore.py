"""How the reference form (``index_reference.py``) rebuilds one worker slot from its snapshot
columns: child counts with ``np.unique``, gaps by checking only rows that are neither roots nor
chained against the slot's sorted set, the digest sum in wrapping ``uint64`` arithmetic, and the
packed entries. Kept apart only so that the reference module stays readable in one sitting;
``self`` is that module's ``PrefixIndex`` (typed loosely: the two must not import each other).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from replicas.core.index_codec import U64_MAX, members
from replicas.core.index_common import DIGEST_SALT

_ROOT = -1


def restore_slot(self: Any, slot: int, block_hashes: np.ndarray, seqs: np.ndarray,
                  parents: np.ndarray, roots: np.ndarray) -> np.ndarray:
    """Fill one fresh slot from its columns; returns its distinct sequence hashes, sorted."""
    n = len(seqs)
    held = np.sort(seqs)
    if n > 1 and not np.all(held[1:] != held[:-1]):
        # Some node is held under several block ids: its first row holds it, the others
        # count as extra ids (``_dups``).
        held, node_rows, counts = np.unique(seqs, return_index=True, return_counts=True)
        extra = counts > 1
        self._dups[slot] = dict(zip(held[extra].tolist(), (counts[extra] - 1).tolist(),
                                    strict=True))
        node_parents = parents[node_rows][~roots[node_rows]]
        unsure = node_rows
    else:
        node_parents = parents[~roots]
        unsure = np.arange(n)
    parent_ids, kid_counts = np.unique(node_parents, return_counts=True)
    self._kids[slot] = dict(zip(parent_ids.tolist(), kid_counts.tolist(), strict=True))
    # Gaps: nodes whose parent this slot does not hold. A row whose parent is the previous
    # row's seq (a chain stored in order: nearly all of them) is known to have it.
    chained = np.zeros(n, dtype=bool)
    chained[1:] = parents[1:] == seqs[:-1]
    unsure = unsure[~(roots[unsure] | chained[unsure])]
    self._set_gaps(slot, int(np.count_nonzero(~members(parents[unsure], held))))
    # entries: seq | (parent + 1) << 64, and 0 above the seq for a root
    high = parents + np.uint64(1)
    high[roots] = 0
    highs = high.tolist()
    for row in np.flatnonzero((parents == U64_MAX) & ~roots).tolist():
        highs[row] = 1 << 64  # parent 2**64 - 1 wrapped to 0 in uint64
    entries = [s | h << 64 for s, h in zip(seqs.tolist(), highs, strict=True)]
    bmap = dict(zip(block_hashes.tolist(), entries, strict=True))
    if len(bmap) != n:
        raise ValueError(f"snapshot repeats block ids of {self._keys[slot]}")
    self._blocks[slot] = bmap
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps: exactly mod 2**64
        mixes = (seqs ^ np.uint64(DIGEST_SALT)) * (block_hashes * np.uint64(2) + np.uint64(1))
        self._sums[slot] = int(mixes.sum(dtype=np.uint64))
    self._total += n
    return held
