"""Whose turn it is to fill an engine's opening when several replicas hold queued requests
(design.md §6, "Fair sharing").

With a queue threshold, a replica releases its queue's head when an engine's prefill frees up,
and every replica applies the event that frees it at about the same moment. If each released
its own head then, the engine would get one prompt per replica at once and compute them in one
step — each of them waiting for all — and a replica that applies the stream later than its
peers would find the engine busy again every time and wait for openings its peers took.

So the openings go round: an opening made when replica R's prompt finished its prefill (or left
the engine before that) is R's successor's, in the ring of replicas that routed a decision
lately or still have one in flight (their ids in order, R included) — the same on every
replica, since both come from the router stream. The others wait one grace per place they stand
behind the turn-holder, so an opening whose turn-holder has nothing queued is still filled, one
replica at a time. A replica outside the ring (new, or idle for a while) is in nobody's count:
it does not wait either, and its first decision brings it into the ring. Pure: no clock, no
I/O.
"""

from __future__ import annotations

from collections.abc import Iterable


def turn_distance(ring: Iterable[str], freed_by: str | None, me: str) -> int:
    """How many graces ``me`` waits before filling an opening made by ``freed_by``'s request:
    0 when it is ``me``'s turn. Unknown (None): nobody's turn, no one waits; nor does a
    replica outside the ring."""
    if freed_by is None:
        return 0
    order = sorted({*ring, freed_by})
    if me not in order:
        return 0
    return (order.index(me) - order.index(freed_by) - 1) % len(order)
