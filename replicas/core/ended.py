"""Requests that ended recently, so a ``RequestRouted`` delivered again brings back no load.

``RouterState`` keeps every request that ended within ``request_max_age`` of event time (a
duplicate routed older than that would expire at once anyway). That window holds every request
of the last ten minutes by default: at 37 requests/s on a soak's cluster it grew each replica by
~7 KB/s for ten minutes (tracemalloc: the decoded id string, a float, a dict entry and a heap
tuple, ~336 bytes a request), so at the 2,500 requests/s one replica routes it would hold
~500 MB. Here a request is a 64-bit hash of its id in a set, listed in a bucket per whole second
of its routed time for expiry: ~80 bytes, and no string or float of the event kept alive.

Pure and deterministic: a bucket ``b`` (ts in ``[b, b + 1)``) is dropped once ``b + 1 <=
bound``, so an entry lives at most one second longer than its exact expiry would allow; every
replica applies the same events and drops the same buckets. A hash collision (two ids in 2**64)
could only make a new request look ended: counted as a duplicate, never a wrong load.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable

import xxhash

_SEED = 0x454E4445  # "ENDE": keys are not the ids' hashes used anywhere else


def request_key(request_id: str) -> int:
    return xxhash.xxh3_64_intdigest(request_id.encode(), _SEED)


class EndedRequests:
    """Set of recently ended request ids, expiring by event time (module doc)."""

    __slots__ = ("_buckets", "_keys", "_order")

    def __init__(self) -> None:
        self._keys: set[int] = set()
        self._buckets: dict[int, list[int]] = {}  # whole second of routed ts -> keys
        self._order: list[int] = []  # heap of the buckets' seconds

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, request_id: object) -> bool:
        return isinstance(request_id, str) and request_key(request_id) in self._keys

    def add(self, request_id: str, ts: float) -> None:
        """Remember ``request_id`` (routed at ``ts``); the first time counts."""
        self._add(request_key(request_id), math.floor(ts))

    def _add(self, key: int, second: int) -> None:
        if key in self._keys:
            return
        self._keys.add(key)
        bucket = self._buckets.get(second)
        if bucket is None:
            bucket = self._buckets[second] = []
            heapq.heappush(self._order, second)
        bucket.append(key)

    def expire(self, bound: float) -> None:
        """Forget every request routed before ``bound`` (whole buckets, module doc)."""
        order, buckets, keys = self._order, self._buckets, self._keys
        while order and order[0] + 1 <= bound:
            keys.difference_update(buckets.pop(heapq.heappop(order)))

    def clear(self) -> None:
        self._keys.clear()
        self._buckets.clear()
        self._order.clear()

    # --- snapshots ---------------------------------------------------------------------------

    def to_plain(self) -> list[list[object]]:
        return [[second, list(self._buckets[second])] for second in sorted(self._buckets)]

    @classmethod
    def from_plain(cls, buckets: Iterable[list[object]]) -> EndedRequests:
        ended = cls()
        for second, keys in buckets:
            for key in keys:  # type: ignore[attr-defined]
                ended._add(int(key), int(second))  # type: ignore[call-overload]
        return ended

    @classmethod
    def from_ids(cls, routed_ts: dict[str, float]) -> EndedRequests:
        """From the older snapshot form: request id -> routed ts."""
        ended = cls()
        for request_id, ts in routed_ts.items():
            ended.add(request_id, ts)
        return ended
