"""The reference prefix index (``index_reference.py``) captured for a snapshot, in steps.

Its capture is a shallow copy of each worker's map (block hash -> entry; the entries are
immutable ints): ~20 ms per million blocks, all of it on the event loop when taken at once.
``MapsCapture.steps()`` copies one worker's map a step (a map holds at most ``max_tree_size``
blocks), so that the leader can let the loop run between steps while it holds the KV stream,
as for the compact form (``index_capture.py``, whose ``IndexChanged`` the last step raises if
the index's digest moved since the first). ``build`` makes the plain form (v2) from the copies,
in a worker thread if the caller likes. Pure: no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from replicas.core.index_capture import IndexChanged
from replicas.core.index_codec import PLAIN_VERSION_V2, block_columns, expiry_columns


class MapsCapture:
    """Copies of a reference ``PrefixIndex``'s maps: ``steps()`` takes them (without ``copy``:
    the live maps, for a caller that builds before anything changes), then ``build``."""

    def __init__(self, index: Any, *, copy: bool = True) -> None:
        self._index = index
        self._copy = copy
        self._digest = index.digest
        self._order = sorted(index._slots.items())
        self._head = {"version": PLAIN_VERSION_V2, "approximate": index.approximate,
                      "ttl_secs": index.ttl_secs, "max_tree_size": index.max_tree_size,
                      "prune_target_ratio": index.prune_target_ratio}
        self._counters = [[t, s, n] for (t, s), n in sorted(index.counters.items())]
        self._expiry = dict(index._expiry) if copy else index._expiry
        self._keys = list(index._keys)
        self._workers: list[tuple[Any, dict[int, int]]] = []
        self._done = False

    def steps(self) -> Iterator[None]:
        """Copy the workers' maps, one a step."""
        maps = self._index._blocks
        for worker, slot in self._order:
            self._workers.append((worker, maps[slot].copy() if self._copy else maps[slot]))
            yield
        if self._index.digest != self._digest:
            raise IndexChanged("the prefix index changed while it was copied for a snapshot")
        self._done = True

    def build(self) -> dict[str, object]:
        """The index's plain form (v2) from the copies; after the last step."""
        if not self._done:
            raise RuntimeError("the index capture is not complete: run its steps first")
        return {**self._head,
                "workers": [[w[0], w[1], *block_columns(bmap)] for w, bmap in self._workers],
                "expiry": expiry_columns(self._expiry, self._keys),
                "counters": self._counters}


def capture(index: Any, *, copy: bool = True) -> Callable[[], dict[str, object]]:
    """Every step at once; the returned ``build`` may then run in a worker thread while the
    index keeps changing (with ``copy``)."""
    taken = MapsCapture(index, copy=copy)
    for _ in taken.steps():
        pass
    return taken.build
