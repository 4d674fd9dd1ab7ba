"""Router-side request queue (Dynamo's --router-queue-threshold and --router-queue-policy).

While every worker is over ``queue_threshold * max_num_batched_tokens`` active prefill tokens, new
requests wait here instead of being routed, so the decision is made later on fresher load. The
queue is a priority queue whose key depends on the policy (highest key leaves first):

- ``fcfs``: ``priority_jump - arrival``  -- earliest arrival first; optimises tail TTFT
- ``lcfs``: ``priority_jump + arrival``  -- latest arrival first; for comparison experiments
- ``wspt``: ``(1 + priority_jump) / max(uncached_isl_tokens, 1)`` -- shortest work first; optimises
  mean TTFT

``priority_jump`` (seconds for fcfs/lcfs, a weight for wspt) comes from ``nvext.agent_hints``.
Items with equal keys leave in insertion order. Pure: arrival times are passed in.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable
from enum import StrEnum
from typing import Generic, Protocol, TypeVar


class QueuePolicy(StrEnum):
    """Which waiting request leaves first (``--router-queue-policy``)."""

    FCFS = "fcfs"   # first come, first served
    LCFS = "lcfs"   # last come, first served
    WSPT = "wspt"   # weighted shortest processing time: fewest uncached tokens per priority


POLICIES: tuple[str, ...] = tuple(QueuePolicy)
# Plain-name copies for queue_key (per queued request): an enum member read off its class is a
# descriptor call on Python 3.11.
_FCFS, _LCFS, _WSPT = QueuePolicy.FCFS, QueuePolicy.LCFS, QueuePolicy.WSPT

T = TypeVar("T")


class _LoadView(Protocol):
    """What ``should_queue`` reads from a candidate (``selection.Candidate`` fits)."""

    @property
    def active_prefill_tokens(self) -> int: ...
    @property
    def max_num_batched_tokens(self) -> int: ...


def queue_key(policy: str, arrival: float, priority_jump: float, uncached_isl_tokens: int) -> float:
    """Priority of a queued request under ``policy``; higher leaves first."""
    if policy == _FCFS:
        return priority_jump - arrival
    if policy == _LCFS:
        return priority_jump + arrival
    if policy == _WSPT:
        return (1.0 + priority_jump) / max(uncached_isl_tokens, 1)
    raise ValueError(f"unknown queue policy {policy!r}; expected one of {POLICIES}")


class RequestQueue(Generic[T]):
    """Priority queue of waiting requests (``remove`` matches by identity, then equality)."""

    def __init__(self, policy: str = QueuePolicy.FCFS) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown queue policy {policy!r}; expected one of {POLICIES}")
        self.policy = policy
        # heapq is a min-heap: store (-key, insertion seq) so the highest key, then the earliest
        # insertion, is at the top. Removed entries stay in the heap and are skipped lazily.
        self._heap: list[tuple[float, int]] = []
        self._items: dict[int, T] = {}
        self._seq = itertools.count()

    def push(
        self,
        item: T,
        *,
        arrival: float,
        priority_jump: float = 0.0,
        uncached_isl_tokens: int = 0,
    ) -> None:
        key = queue_key(self.policy, arrival, priority_jump, uncached_isl_tokens)
        seq = next(self._seq)
        self._items[seq] = item
        heapq.heappush(self._heap, (-key, seq))

    def _top(self) -> int | None:
        heap = self._heap
        while heap:
            seq = heap[0][1]
            if seq in self._items:
                return seq
            heapq.heappop(heap)  # removed earlier
        return None

    def peek(self) -> T | None:
        seq = self._top()
        return None if seq is None else self._items[seq]

    def pop(self) -> T | None:
        seq = self._top()
        if seq is None:
            return None
        heapq.heappop(self._heap)
        return self._items.pop(seq)

    def remove(self, item: T) -> bool:
        """Drop a waiting item (e.g. its client went away). False if it is not queued."""
        for seq, queued in self._items.items():
            if queued is item or queued == item:
                del self._items[seq]
                if len(self._heap) > 2 * len(self._items) + 64:
                    self._heap = [e for e in self._heap if e[1] in self._items]
                    heapq.heapify(self._heap)
                return True
        return False

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)


def should_queue(candidates: Iterable[_LoadView], queue_threshold: float) -> bool:
    """True while EVERY candidate has more than ``queue_threshold * max_num_batched_tokens``
    active prefill tokens. No candidates at all is not a reason to wait (that is "no workers")."""
    any_candidate = False
    for c in candidates:
        any_candidate = True
        if c.active_prefill_tokens <= queue_threshold * c.max_num_batched_tokens:
            return False
    return any_candidate
