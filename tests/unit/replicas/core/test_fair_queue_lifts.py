"""Newcomers' lifts in the fair queue (``newcomer_lifts``) and the book queries they are worked
out from: a tenant arriving next to tenants already served is lifted to the least counter it
finds, the lift fades as that service leaves the window, and a steady tenant is never lifted.
"""

from __future__ import annotations

from eventlog import events as ev
from replicas.core.fair_queue import FairQueue, newcomer_lifts
from replicas.core.tenant_admission import TenantPending
from replicas.core.tenants import WINDOW, TenantBook


def _routed(book: TenantBook, rid: str, tenant: str, ts: float, tokens: int) -> None:
    book.routed(ev.RequestRouted(rid, "r0", "w0", 0, 10, [], 0, 8, 0, ts, tenant=tenant,
                                 tenant_tokens=tokens))


def _lifts(book: TenantBook, now: float) -> dict[str, float]:
    firsts = {t: ts for t in book.active()
              if (ts := book.first_admission(t, now)) is not None}
    return newcomer_lifts(firsts, lambda t, ts: float(book.tokens_before(t, ts, now)))


def test_the_book_answers_first_admission_and_tokens_before_within_the_window() -> None:
    book = TenantBook()
    for i, ts in enumerate((10.0, 20.0, 30.0)):
        _routed(book, f"a{i}", "a", ts, 100 * (i + 1))
    assert book.first_admission("a", 40.0) == 10.0
    assert book.first_admission("a", 10.0 + WINDOW) == 20.0  # the first left the window
    assert book.first_admission("a", 100.0) is None
    assert book.first_admission("nobody", 40.0) is None
    assert book.tokens_before("a", 30.0, 40.0) == 300  # 100 + 200; ts 30 itself is not before
    assert book.tokens_before("a", 31.0, 40.0) == 600
    assert book.tokens_before("a", 31.0, 10.0 + WINDOW) == 500  # 100 left the window
    assert book.tokens_before("a", 5.0, 40.0) == 0
    pending = TenantPending()
    assert pending.first_admission("a") is None
    pending.add("p1", "a", 7.0, 10)
    pending.add("p0", "a", 3.0, 10)
    assert pending.first_admission("a") == 3.0


def test_a_flood_arriving_next_to_a_steady_tenant_is_lifted_to_its_counter() -> None:
    book = TenantBook()
    for i in range(10):  # steady: 10 requests of 264 tokens over 10 s
        _routed(book, f"s{i}", "steady", float(i), 264)
    _routed(book, "f0", "flood", 12.0, 264)
    lifts = _lifts(book, 12.5)
    assert lifts == {"steady": 0.0, "flood": 2640.0}
    # The flood's counter (264 served + 2640 lifted) is above the steady tenant's (2640), so
    # the steady tenant's next request leaves the queue first. Without the lift the flood
    # (264) would take every opening until it had been served 2640 tokens.
    for i in range(1, 5):  # both go on; the steady tenant's first admission stays first
        _routed(book, f"f{i}", "flood", 12.0 + i / 10, 264)
    _routed(book, "s10", "steady", 12.5, 264)
    assert _lifts(book, 13.0) == {"steady": 0.0, "flood": 2640.0}


def test_the_lift_fades_as_the_service_it_stands_for_leaves_the_window() -> None:
    book = TenantBook()
    for i in range(10):
        _routed(book, f"s{i}", "steady", float(i), 100)
    for i in range(70):  # the flood runs on, one request a second from ts 12
        _routed(book, f"f{i}", "flood", 12.0 + i, 100)
    assert _lifts(book, 13.0)["flood"] == 1000.0
    # At 65 the window starts at 5: the steady tenant's admissions at 0..5 have left it.
    assert _lifts(book, 65.0)["flood"] == 400.0  # those at 6, 7, 8, 9
    # The steady tenant comes back at 74.5 after more than a window away: it is the newcomer
    # now, lifted to the flood's counter, and the flood (first in the window) is not lifted.
    _routed(book, "s10", "steady", 74.5, 100)
    lifts = _lifts(book, 75.0)
    assert lifts["flood"] == 0.0
    assert lifts["steady"] == book.tokens_before("flood", 74.5, 75.0) == 5900


def test_tenants_are_lifted_in_order_of_arrival_and_the_same_instant_lifts_nobody() -> None:
    firsts = {"a": 0.0, "b": 10.0, "c": 20.0, "d": 20.0}
    served = {"a": [(0.0, 500.0), (15.0, 500.0)], "b": [(10.0, 50.0)], "c": [(20.0, 7.0)],
              "d": [(20.0, 9.0)]}

    def before(t: str, ts: float) -> float:
        return sum(n for at, n in served[t] if at < ts)

    lifts = newcomer_lifts(firsts, before)
    # b finds a at 500; c finds a at 1000 and b at 50 + its lift 500: the least is 550. d
    # arrived with c and is not lifted by it.
    assert lifts == {"a": 0.0, "b": 500.0, "c": 550.0, "d": 550.0}
    assert newcomer_lifts({"only": 5.0}, before) == {"only": 0.0}
    assert newcomer_lifts({}, before) == {}


def test_the_queue_adds_the_lifts_to_the_counters_and_asks_only_when_there_is_a_choice() -> None:
    service = {"steady": 2640.0, "flood": 264.0}
    asked = []

    def lifts() -> dict[str, float]:
        asked.append(1)
        return {"flood": 2640.0}

    q: FairQueue[str] = FairQueue("fcfs", service.__getitem__, lifts)
    q.push("f1", arrival=0.0, tenant="flood", tokens=264)
    assert q.pop() == "f1" and not asked  # one tenant waiting: no counters needed
    q.push("f2", arrival=1.0, tenant="flood", tokens=264)
    q.push("s1", arrival=2.0, tenant="steady", tokens=264)
    assert q.counter("flood") == 2904.0 and q.counter("steady") == 2640.0
    assert q.pop() == "s1"
    assert q.pop() == "f2"
