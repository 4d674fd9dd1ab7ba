"""The router queue shared fairly between tenants (design.md §6, "Fair sharing").

While every engine is busy, requests wait in the router queue (``queue.py``). With tenants, the
next one to leave is chosen in three steps:

1. the highest priority tier waiting (``x-priority``: premium, standard, best effort);
2. within it, the tenant that has received the least service per unit of weight — the Virtual
   Token Counter of Sheng et al. ("Fairness in Serving Large Language Models", OSDI 2024), with
   one change: a tenant's counter is its tokens admitted in the last minute (prompt +
   max_tokens, corrected to the actual output when a request ends) as the replicated tenant
   book holds them, plus the tokens this replica released and the stream has not brought back
   yet, divided by the tenant's weight. The book is the same on every replica, so the counters
   are fleet-wide. As in VTC, a newcomer is *lifted* to the least counter of the tenants it
   finds active (``newcomer_lifts``): the others' service in the part of the window before it
   arrived is not service it is owed. Without the lift a flood starting next to a steady
   tenant would take every opening until its own tokens in the window caught up with the
   steady tenant's (seconds, measured in docs/measurements/tenants.md). The lift is a function
   of the replicated admissions alone — each tenant's first admission in the window and what
   the others were admitted before it — so every replica lifts alike, whichever replica the
   newcomer's first request reached, and it fades by itself as those admissions leave the
   window. A tenant that is only idle between requests keeps its first admission, so its gaps
   are not lifted: its counter already holds its recent service;
3. within that tenant, the replica's queue policy (fcfs, lcfs, wspt).

Requests still waiting are not service received: the counter is passed in by the caller (who
subtracts what is queued, ``queued_tokens``), and so are the lifts. Pure: arrival times,
counters and admissions are passed in.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from typing import Generic, TypeVar

from replicas.core.queue import RequestQueue

T = TypeVar("T")


class FairQueue(Generic[T]):
    """Per (tier, tenant) queues; ``pop`` picks the tier, then the least-served tenant."""

    def __init__(self, policy: str, service: Callable[[str], float],
                 lifts: Callable[[], Mapping[str, float]] = dict) -> None:
        self.policy = policy
        self._service = service  # tenant -> service received per unit of weight
        self._lifts = lifts  # -> newcomers' lifts (``newcomer_lifts``), per unit of weight
        self._queues: dict[tuple[int, str], RequestQueue[T]] = {}
        # Insertion order of each queue's oldest entry breaks ties between equally served
        # tenants: the one waiting longest goes first.
        self._first: dict[tuple[int, str], int] = {}
        self._where: dict[int, tuple[tuple[int, str], int]] = {}  # id(item) -> (queue, tokens)
        self._queued: dict[str, tuple[int, int]] = {}  # tenant -> (requests, tokens) waiting
        self._seq = itertools.count()
        self._len = 0

    def push(self, item: T, *, arrival: float, priority_jump: float = 0.0,
             uncached_isl_tokens: int = 0, tenant: str = "", tier: int = 0,
             tokens: int = 0) -> None:
        key = (tier, tenant)
        queue = self._queues.get(key)
        if queue is None:
            queue = self._queues[key] = RequestQueue(self.policy)
            self._first[key] = next(self._seq)
        queue.push(item, arrival=arrival, priority_jump=priority_jump,
                   uncached_isl_tokens=uncached_isl_tokens)
        self._where[id(item)] = (key, tokens)
        n, queued = self._queued.get(tenant, (0, 0))
        self._queued[tenant] = (n + 1, queued + tokens)
        self._len += 1

    def _taken(self, item: T) -> None:
        key, tokens = self._where.pop(id(item))
        n, queued = self._queued[key[1]]
        if n > 1:
            self._queued[key[1]] = (n - 1, queued - tokens)
        else:
            del self._queued[key[1]]
        if not self._queues[key]:
            del self._queues[key], self._first[key]
        self._len -= 1

    def next_tenant(self, allowed: Callable[[str], bool] | None = None
                    ) -> tuple[int, str] | None:
        """The (tier, tenant) whose request leaves next, or None when nothing waits;
        ``allowed``: only among the tenants it accepts (the others may not take an opening
        now, ``tenant_headroom.py``)."""
        keys = list(self._queues) if allowed is None else [
            k for k in self._queues if allowed(k[1])]
        if not keys:
            return None
        tier = max(k[0] for k in keys)
        keys = [k for k in keys if k[0] == tier]
        if len(keys) == 1:
            return keys[0]  # nothing to compare: the counters are not needed
        lifts = self._lifts()
        return min(keys, key=lambda k: (self.counter(k[1], lifts), self._first[k]))

    def counter(self, tenant: str, lifts: Mapping[str, float] | None = None) -> float:
        """A tenant's virtual token counter: service per weight, plus its lift."""
        if lifts is None:
            lifts = self._lifts()
        return self._service(tenant) + lifts.get(tenant, 0.0)

    def pop(self, allowed: Callable[[str], bool] | None = None) -> T | None:
        key = self.next_tenant(allowed)
        if key is None:
            return None
        item = self._queues[key].pop()
        assert item is not None
        self._taken(item)
        return item

    def remove(self, item: T) -> bool:
        where = self._where.get(id(item))
        if where is None or not self._queues[where[0]].remove(item):
            return False
        self._taken(item)
        return True

    def queued_tokens(self, tenant: str) -> int:
        """Tokens of ``tenant``'s requests still waiting here (not yet service received)."""
        return self._queued.get(tenant, (0, 0))[1]

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0


def newcomer_lifts(firsts: Mapping[str, float],
                   served_before: Callable[[str, float], float]) -> dict[str, float]:
    """VTC's lift for a windowed counter: each tenant is lifted to the least counter, at its
    arrival, of the tenants that arrived before it.

    ``firsts``: each active tenant's first admission in the window (event time);
    ``served_before(t, ts)``: ``t``'s service per weight admitted in the window before ``ts``.
    A tenant's counter when ``u`` arrived is what it was served before then plus its own lift,
    so the lifts are worked out in order of arrival; tenants that arrived at the same instant
    do not lift each other, and the first to arrive has no lift. As the window slides, the
    service a lift stands for leaves it, and so does the lift."""
    order = sorted(firsts.items(), key=lambda kv: (kv[1], kv[0]))
    lifts: dict[str, float] = {}
    for k, (tenant, arrived) in enumerate(order):
        least = min((served_before(other, arrived) + lifts[other]
                     for other, first in order[:k] if first < arrived), default=0.0)
        lifts[tenant] = max(least, 0.0)
    return lifts
