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
   are fleet-wide. As in VTC, a tenant that arrives idle — nothing waiting here and nothing in
   flight anywhere in the fleet — is *lifted* to the least counter of the active tenants (the
   caller says which: those waiting here count with their own counters), for as long as it
   keeps waiting: time it spent without requests is not service it is owed, and a newcomer
   cannot take every opening from tenants that were served while it was away. The replica
   counts as active every tenant served in the last minute, the stand-in for VTC's "counter of
   the last client served" when nobody else is waiting at the instant the newcomer arrives. A
   tenant with requests in flight keeps its own counter when its queue here runs empty between
   requests: it is still backlogged fleet-wide, only spread over replicas;
3. within that tenant, the replica's queue policy (fcfs, lcfs, wspt).

Requests still waiting are not service received: the counter is passed in by the caller (who
subtracts what is queued, ``queued_tokens``). Pure: arrival times and counters are passed in.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

from replicas.core.queue import RequestQueue

T = TypeVar("T")


class FairQueue(Generic[T]):
    """Per (tier, tenant) queues; ``pop`` picks the tier, then the least-served tenant."""

    def __init__(self, policy: str, service: Callable[[str], float],
                 in_flight: Callable[[str], int],
                 active: Callable[[], Iterable[str]] = tuple) -> None:
        self.policy = policy
        self._service = service  # tenant -> service received per unit of weight
        self._in_flight = in_flight  # tenant -> its requests released and not ended, fleet-wide
        self._active = active  # tenants served recently or with requests in flight
        self._queues: dict[tuple[int, str], RequestQueue[T]] = {}
        # Insertion order of each queue's oldest entry breaks ties between equally served
        # tenants: the one waiting longest goes first.
        self._first: dict[tuple[int, str], int] = {}
        self._where: dict[int, tuple[tuple[int, str], int]] = {}  # id(item) -> (queue, tokens)
        self._queued: dict[str, tuple[int, int]] = {}  # tenant -> (requests, tokens) waiting
        self._lift: dict[str, float] = {}  # tenant -> what its counter is lifted by while waiting
        self._seq = itertools.count()
        self._len = 0

    def push(self, item: T, *, arrival: float, priority_jump: float = 0.0,
             uncached_isl_tokens: int = 0, tenant: str = "", tier: int = 0,
             tokens: int = 0) -> None:
        key = (tier, tenant)
        if tenant not in self._queued:
            self._lift[tenant] = 0.0 if self._in_flight(tenant) else self._lift_for(tenant)
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
            del self._queued[key[1]], self._lift[key[1]]
        if not self._queues[key]:
            del self._queues[key], self._first[key]
        self._len -= 1

    def _lift_for(self, tenant: str) -> float:
        """How far an idle tenant's counter is lifted: up to the least counter of the active
        tenants (waiting here: their counters; in flight elsewhere: their service)."""
        counters = {t: self.counter(t) for t in self._queued}
        for t in self._active():
            if t != tenant and t not in counters:
                counters[t] = self._service(t)
        if not counters:
            return 0.0
        return max(0.0, min(counters.values()) - self._service(tenant))

    def next_tenant(self) -> tuple[int, str] | None:
        """The (tier, tenant) whose request leaves next, or None when nothing waits."""
        if not self._queues:
            return None
        tier = max(k[0] for k in self._queues)
        return min((k for k in self._queues if k[0] == tier),
                   key=lambda k: (self.counter(k[1]), self._first[k]))

    def counter(self, tenant: str) -> float:
        """A waiting tenant's virtual token counter: service per weight, lifted."""
        return self._service(tenant) + self._lift.get(tenant, 0.0)

    def pop(self) -> T | None:
        key = self.next_tenant()
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

    def queued(self, tenant: str) -> int:
        """How many of ``tenant``'s requests wait here."""
        return self._queued.get(tenant, (0, 0))[0]

    def queued_tokens(self, tenant: str) -> int:
        """Tokens of ``tenant``'s requests still waiting here (not yet service received)."""
        return self._queued.get(tenant, (0, 0))[1]

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0
