"""Headroom for tenants under their share (``replicas/core/tenant_headroom.py``): an over-share
tenant may not take the last openings while an under-share tenant is active, takes everything
when alone, and weights set both who is under and how much is held.
"""

from __future__ import annotations

from collections.abc import Mapping

from eventlog import events as ev
from replicas.core.fair_queue import FairQueue
from replicas.core.load import ActiveLoad
from replicas.core.overlay import Overlay, PendingDecision
from replicas.core.tenant_admission import TenantPending
from replicas.core.tenant_headroom import (
    ACTIVE_FOR,
    NO_HEADROOM,
    Standing,
    active_tenants,
    engines_in_prefill,
    headroom,
    held_back,
    under_share,
)
from replicas.core.tenants import TenantBook

A, B, C, D = ("e0", 0), ("e1", 0), ("e2", 0), ("e3", 0)


def _room(standings: Mapping[str, Standing], open_engines: list[tuple[str, int]],
          engines: int, fraction: float = 0.5, busy: int = 0,
          ends: Mapping[str, float | None] | None = None):  # type: ignore[no-untyped-def]
    return headroom(standings, open_engines, engines, lambda under: busy, fraction,
                    lambda t: (ends or {}).get(t))


FLOOD_AND_VICTIM = {"flood": Standing(1.0, 9000.0), "victim": Standing(1.0, 3000.0)}


def test_an_over_share_tenant_may_not_take_the_last_opening_while_one_under_share_is_active(
        ) -> None:
    # Two engines, the flood computing a prompt on one: the other is the last opening.
    room = _room(FLOOD_AND_VICTIM, [B], engines=2)
    assert room.under == {"victim"} and room.held == {"e1"}
    assert room.engines_for("flood", {"e1"}) == frozenset()
    assert room.engines_for("victim", {"e1"}) == {"e1"}
    # The victim needs no turn for a held engine: it is free for it alone.
    assert room.engines_for("victim", frozenset()) == {"e1"}
    # With both engines open the flood takes one and leaves the other.
    room = _room(FLOOD_AND_VICTIM, [A, B], engines=2)
    assert room.held == {"e0"}  # the first in worker order: every replica holds the same one
    assert room.engines_for("flood", {"e0", "e1"}) == {"e1"}


def test_what_the_under_share_tenant_already_computes_counts_against_what_is_held() -> None:
    # The victim's prompt is on one engine: the flood may take the other one.
    room = _room(FLOOD_AND_VICTIM, [A], engines=2, busy=1)
    assert room.held == frozenset()
    assert room.engines_for("flood", {"e0"}) == {"e0"}


def test_a_tenant_alone_or_tenants_at_the_level_hold_nothing() -> None:
    assert _room({"flood": Standing(1.0, 9000.0)}, [A], engines=2) is NO_HEADROOM
    even = {"t1": Standing(1.0, 5000.0), "t2": Standing(1.0, 5000.0)}
    assert _room(even, [A], engines=2) is NO_HEADROOM
    assert _room(FLOOD_AND_VICTIM, [A], engines=2, fraction=0.0) is NO_HEADROOM
    assert NO_HEADROOM.engines_for("anyone", {"e0"}) == {"e0"}


def test_weights_decide_who_is_under_its_share() -> None:
    # Counters are service per weight already; the level weighs them by weight. t1 (weight 3)
    # has 1000 per weight, t2 (weight 1) 1200: level (3000 + 1200) / 4 = 1050, t1 is under.
    standings = {"t1": Standing(3.0, 1000.0), "t2": Standing(1.0, 1200.0)}
    assert under_share(standings) == {"t1"}
    # The same counters with the weights swapped: level 1150, still t1 alone under.
    assert under_share({"t1": Standing(1.0, 1000.0), "t2": Standing(3.0, 1200.0)}) == {"t1"}
    # With equal weights three tenants: the level is the mean.
    three = {"a": Standing(1.0, 100.0), "b": Standing(1.0, 200.0), "c": Standing(1.0, 600.0)}
    assert under_share(three) == {"a", "b"}


def test_weights_bound_what_is_held_by_the_under_share_tenants_whole_engines() -> None:
    victim_heavy = {"flood": Standing(1.0, 900.0), "victim": Standing(3.0, 100.0)}
    victim_light = {"flood": Standing(3.0, 900.0), "victim": Standing(1.0, 100.0)}
    # Four engines, as much held as allowed: the victim's share is 3 or 1 whole engines.
    assert held_back(victim_heavy, {"victim"}, 4, 0, 1.0) == 3
    assert held_back(victim_light, {"victim"}, 4, 0, 1.0) == 1
    # One engine: half of it is no whole engine, so nothing is held (the flood keeps it).
    assert held_back(FLOOD_AND_VICTIM, {"victim"}, 1, 0, 1.0) == 0
    # The fraction caps it, rounded up: a tenth of 10 engines is 1, of 11 is 2.
    assert held_back(FLOOD_AND_VICTIM, {"victim"}, 10, 0, 0.1) == 1
    assert held_back(FLOOD_AND_VICTIM, {"victim"}, 11, 0, 0.1) == 2
    assert held_back(FLOOD_AND_VICTIM, {"victim"}, 2, 0, 0.1) == 1
    assert held_back(FLOOD_AND_VICTIM, {"victim"}, 10, 4, 1.0) == 1  # 5 owed, 4 in use
    assert held_back(FLOOD_AND_VICTIM, set(), 10, 0, 1.0) == 0


def test_more_held_than_open_holds_every_open_engine() -> None:
    room = _room({"flood": Standing(1.0, 900.0), "victim": Standing(3.0, 100.0)}, [C],
                 engines=4, fraction=1.0)
    assert room.held == {"e2"}
    assert room.engines_for("flood", {"e2"}) == frozenset()


def test_the_headroom_is_rechecked_when_an_idle_under_share_tenant_stops_being_active() -> None:
    room = _room(FLOOD_AND_VICTIM, [B], engines=2, ends={"victim": 12.0})
    assert room.recheck_at == 12.0
    # A request in flight ends by an event: nothing to recheck on the clock.
    assert _room(FLOOD_AND_VICTIM, [B], engines=2, ends={"victim": None}).recheck_at is None


def _routed(book: TenantBook, rid: str, tenant: str, ts: float) -> None:
    book.routed(ev.RequestRouted(rid, "r0", "e0", 0, 10, [], 0, 8, 0, ts, tenant=tenant,
                                 tenant_tokens=10))


def test_active_is_in_flight_or_admitted_lately_from_the_book_or_pending_here() -> None:
    book, pending = TenantBook(), TenantPending()
    _routed(book, "f0", "flood", 100.0)
    _routed(book, "v0", "victim", 50.0)
    book.ended_one("v0")
    assert active_tenants(book, pending.tenants(), 101.0) == {"flood"}  # victim: 51 s idle
    _routed(book, "v1", "victim", 100.5)
    book.ended_one("v1")
    assert active_tenants(book, pending.tenants(), 101.0) == {"flood", "victim"}
    assert book.last_admission("victim") == 100.5
    assert active_tenants(book, pending.tenants(), 100.5 + ACTIVE_FOR + 0.1) == {"flood"}
    pending.add("n0", "newcomer", 101.0, 10)
    assert "newcomer" in active_tenants(book, pending.tenants(), 101.0)
    assert book.tenant_of("f0") == "flood" and book.tenant_of("v1") is None
    assert pending.tenant_of("n0") == "newcomer" and pending.tenant_of("f0") is None


def test_engines_in_prefill_count_the_tenants_prompts_applied_and_pending_here() -> None:
    book, load, overlay = TenantBook(), ActiveLoad(), Overlay()
    _routed(book, "v0", "victim", 1.0)
    _routed(book, "f0", "flood", 1.0)
    load.add("v0", "r0", A, 100, [], 1.0)
    load.add("f0", "r0", B, 100, [], 1.0)
    load.add("f1", "r0", C, 100, [], 1.0)
    load.prefill_completed("f1")  # decoding: not in prefill
    overlay.add("f2", PendingDecision(D, 100, 0))
    tenant = {"f2": "flood"}

    def tenant_of(r: str) -> str | None:
        return book.tenant_of(r) or tenant.get(r)

    def prefilling(w: tuple[str, int]) -> list[str]:
        return [*load.prefilling(w), *overlay.prefilling(w)]

    engines = [A, B, C, D]
    assert engines_in_prefill({"victim"}, engines, prefilling, tenant_of) == 1
    assert engines_in_prefill({"flood"}, engines, prefilling, tenant_of) == 2
    assert load.prefilling(C) == [] and load.prefilling(("nobody", 0)) == []


def test_the_fair_queue_releases_the_best_tenant_among_those_allowed() -> None:
    q: FairQueue[str] = FairQueue("fcfs", {"flood": 9.0, "victim": 1.0, "bulk": 5.0}.__getitem__)
    q.push("f", arrival=0.0, tenant="flood", tier=2)
    q.push("b", arrival=1.0, tenant="bulk")
    q.push("v", arrival=2.0, tenant="victim")
    # The flood's higher tier goes first, unless it may not take an opening now: then the
    # best of the others, by tier then counter.
    assert q.pop(lambda t: t != "flood") == "v"
    assert q.pop(lambda t: t != "flood") == "b"
    assert q.pop(lambda t: t != "flood") is None
    assert q.pop() == "f"
