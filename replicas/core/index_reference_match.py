"""The reference index's query: where along a prompt each worker slot stops matching.

``PrefixIndex`` in ``index_reference.py`` keeps, per sequence hash, an int bitmask of the worker
slots holding that block, and knows which slots have *gaps* (hold a block without its parent).
A slot without gaps holds every ancestor of what it holds, so along the prompt "slot holds block
i" turns false only once: a bisection finds each point where the set of matching slots shrinks,
with a few dozen dict lookups for a 512-block prompt. Slots with gaps fall back to a running AND
of the masks along the prompt, in C, until it is empty. Pure.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Sequence
from itertools import accumulate, compress, repeat, takewhile
from operator import and_

import numpy as np

from replicas.core.index_common import WorkerKey

_BITS = bytes.maketrans(b"01", b"\x00\x01")  # '0'/'1' digits -> falsy/truthy bytes


def match_groups(get: Callable[[int, int], int], gappy: int, seq_hashes: Sequence[int]
                 ) -> list[tuple[int, int]]:
    """``(slot mask, matched blocks)`` for each set of slots that match equally far.

    ``get``: the index's ``seq hash -> slot mask`` lookup (``dict.get``); ``gappy``: the mask of
    slots with gaps."""
    groups: list[tuple[int, int]] = []
    first = get(seq_hashes[0], 0) if seq_hashes else 0
    if not first:
        return groups
    end = len(seq_hashes)
    gappy &= first
    held = first ^ gappy
    start = 0
    while held:
        stop = bisect_left(
            range(end), True, start + 1, end,
            key=lambda i: get(seq_hashes[i], 0) & held != held,
        )
        left = get(seq_hashes[stop], 0) & held if stop < end else 0
        groups.append((held ^ left, stop))
        held, start = left, stop
    if gappy:
        running = list(takewhile(bool, accumulate(
            map(get, seq_hashes, repeat(0)), and_, initial=gappy)))
        end = len(running) - 1
        held, start = gappy, 0
        while held:
            stop = bisect_left(running, True, start + 1, end + 1, key=held.__ne__) - 1
            left = running[stop + 1] if stop < end else 0
            groups.append((held ^ left, stop))
            held, start = left, stop + 1
    return groups


def record(scores: dict[WorkerKey, int], keys: list[WorkerKey | None], slots: int,
           matched: int) -> None:
    """Give every slot whose bit is set in ``slots`` a score of ``matched`` blocks."""
    # decode the bits in C: binary digits, least significant first, as 0/1 bytes
    flags = bin(slots)[:1:-1].encode().translate(_BITS)
    scores.update(zip(compress(keys, flags), repeat(matched)))  # type: ignore[arg-type]


def slot_indices(slots: int) -> np.ndarray:
    """The slots whose bit is set in the mask ``slots``, ascending."""
    return np.flatnonzero(np.frombuffer(bin(slots)[:1:-1].encode().translate(_BITS),
                                        dtype=np.uint8))
