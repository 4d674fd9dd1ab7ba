"""Headroom for tenants under their share: engine capacity an over-share tenant may not take
while another tenant is active and below its share (design.md §6, "Fair sharing"; decision
0085).

The fair queue orders releases, but an engine does not give up a prompt it has started: when
one tenant floods, every engine is computing one of its prompts whenever another tenant's
request arrives, and that request waits for the first of them to finish (~0.9 of a prefill at
p99 with 2 engines; docs/measurements/tenants.md). No release order removes that wait; only
capacity kept free does. So, with ``--tenant-headroom F`` above 0:

- **active**: a tenant with a request in flight fleet-wide, or admitted in the last
  ``ACTIVE_FOR`` seconds of event time (both from the replicated book, so every replica
  agrees), or admitted on this replica and not yet applied;
- **share**: the weighted share of the active tenants. A tenant's standing is the fair queue's
  counter (its service per unit of weight in the window, plus its newcomer lift); the fair
  level is the weight-averaged counter of the active tenants, i.e. all their service divided
  out by weight. A tenant below the level is *under its share*, one at or above it is *over*;
- **held**: while some active tenant is under its share, the over-share tenants leave
  ``min(ceil(F x engines), floor(S x engines)) - B`` of the open engines free, where ``S`` is
  the under-share tenants' joint share of the weights and ``B`` the engines already computing
  one of their prompts. So no more is held than what they would be owed in whole engines, what
  they already use counts against it, and ``F`` caps the fleet's idle capacity. The held
  engines are the first open ones in worker order, so every replica holds the same ones.
  Under-share tenants may use any open engine, and a held one without waiting for its turn
  (``release_turns.py``): the point is that their next request starts at once.

One tenant alone, or every active tenant at the level, holds nothing back: no capacity idles
for nobody. Pure: the time, the counters and the load views are passed in.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from replicas.core.tenants import TenantBook

WorkerKey = tuple[str, int]

# Seconds of event time a tenant counts as active after its newest admission (when nothing of
# it is in flight): longer than the gap between a steady tenant's requests, short enough that
# capacity is not held for long after a tenant has left (not the one-minute window).
ACTIVE_FOR = 2.0
# --tenant-headroom's default: at most a tenth of the engines, and at least one, are held
# (docs/decisions/0085-headroom-for-tenants-under-their-share.md).
DEFAULT_HEADROOM = 0.1


@dataclass(frozen=True, slots=True)
class Standing:
    """An active tenant as headroom judges it."""

    weight: float
    counter: float  # the fair queue's virtual token counter: service per weight, plus its lift


@dataclass(frozen=True, slots=True)
class Headroom:
    """One release pass's view: who is under its share and which open engines (worker ids)
    over-share tenants leave to them."""

    under: frozenset[str] = frozenset()
    held: frozenset[str] = frozenset()
    recheck_at: float | None = None  # event time when an under-share tenant stops being active

    def engines_for(self, tenant: str, mine: AbstractSet[str]) -> frozenset[str]:
        """Which of the open engines ``tenant``'s release may go to, given ``mine`` (the open
        engines whose turn this replica holds): an under-share tenant also the held ones, an
        over-share tenant none of them."""
        if tenant in self.under:
            return frozenset(mine) | self.held
        return frozenset(mine) - self.held


NO_HEADROOM = Headroom()


def active_tenants(book: TenantBook, pending: Iterable[str], at: float) -> set[str]:
    """Tenants in flight fleet-wide or admitted within ``ACTIVE_FOR`` of ``at`` (the book), and
    those with admissions pending here."""
    return book.recent(at - ACTIVE_FOR) | set(pending)


def under_share(standings: Mapping[str, Standing]) -> frozenset[str]:
    """The tenants whose counter is below the fair level (the weight-averaged counter)."""
    weights = sum(s.weight for s in standings.values())
    if len(standings) < 2 or weights <= 0:
        return frozenset()
    level = sum(s.weight * s.counter for s in standings.values()) / weights
    return frozenset(t for t, s in standings.items() if s.counter < level)


def engines_in_prefill(tenants: AbstractSet[str], workers: Iterable[WorkerKey],
                       prefilling: Callable[[WorkerKey], Iterable[str]],
                       tenant_of: Callable[[str], str | None]) -> int:
    """How many of ``workers`` are computing a prompt of one of ``tenants``."""
    return sum(1 for w in workers if any(tenant_of(r) in tenants for r in prefilling(w)))


def held_back(standings: Mapping[str, Standing], under: AbstractSet[str], engines: int,
              busy_with_under: int, fraction: float) -> int:
    """How many open engines over-share tenants leave free: at most ``ceil(fraction x
    engines)`` and the under-share tenants' share of the engines in whole engines, less the
    engines already computing their prompts."""
    if fraction <= 0 or not under or engines <= 0:
        return 0
    weights = sum(s.weight for s in standings.values())
    share = sum(standings[t].weight for t in under) / weights
    # A hair under a whole engine still counts as one: shares are sums of float weights.
    owed = math.floor(share * engines + 1e-9)
    return max(min(math.ceil(fraction * engines - 1e-9), owed) - busy_with_under, 0)


def headroom(standings: Mapping[str, Standing], open_engines: Sequence[WorkerKey],
             engines: int, busy_with: Callable[[AbstractSet[str]], int], fraction: float,
             ends: Callable[[str], float | None]) -> Headroom:
    """The pass's headroom. ``open_engines``: the engines with an opening (below the queue
    threshold); ``engines``: all of them; ``busy_with(tenants)``: engines computing a prompt of
    one of ``tenants`` (asked only when something may be held); ``ends(t)``: event time when
    ``t`` stops being active if nothing else of it happens, None when that takes an event (a
    request in flight)."""
    if fraction <= 0:
        return NO_HEADROOM
    under = under_share(standings)
    if not under:
        return NO_HEADROOM
    n = held_back(standings, under, engines, busy_with(under), fraction)
    held = frozenset(w[0] for w in sorted(open_engines)[:n])
    times = [ends(t) for t in under]
    recheck = min((t for t in times if t is not None), default=None)
    return Headroom(under, held, recheck)
