"""Admission against a tenant's limits: the verdicts and what the rate-limit headers say."""

from __future__ import annotations

from eventlog import events as ev
from replicas.core.tenant_admission import TenantPending, admit, duration
from replicas.core.tenants import TenantBook


def _book(**limits: object) -> TenantBook:
    book = TenantBook()
    book.set_limits(ev.TenantLimitsSet("t", limits.get("rpm"), limits.get("tpm"),  # type: ignore[arg-type]
                                       limits.get("conc"), 1.0, False, 0.0))  # type: ignore[arg-type]
    return book


def _routed(book: TenantBook, rid: str, ts: float, tokens: int) -> None:
    book.routed(ev.RequestRouted(rid, "r0", "w0", 0, 10, [], 0, 8, 0, ts, tenant="t",
                                 tenant_tokens=tokens))


def test_requests_per_minute_counts_applied_and_pending_admissions() -> None:
    book, pending = _book(rpm=3), TenantPending()
    _routed(book, "a", 100.0, 10)
    pending.add("b", "t", 110.0, 10)
    ok = admit(book, pending, "t", 120.0, 10)
    assert ok.admitted and ok.headers()["x-ratelimit-remaining-requests"] == "0"
    pending.add("c", "t", 120.0, 10)
    refused = admit(book, pending, "t", 121.0, 10)
    assert not refused.admitted and refused.reason == "requests"
    # The oldest admission (ts 100) leaves the window at 160: 39 s from 121.
    assert refused.retry_after == 39.0
    h = refused.headers()
    assert h["retry-after"] == "39" and h["retry-after-ms"] == "39000"
    assert h["x-ratelimit-limit-requests"] == "3" and "x-ratelimit-limit-tokens" not in h
    assert admit(book, pending, "t", 160.5, 10).admitted  # "a" is out of the window


def test_tokens_and_concurrency() -> None:
    book, pending = _book(tpm=100, conc=2), TenantPending()
    _routed(book, "a", 0.0, 60)
    refused = admit(book, pending, "t", 1.0, 50)
    assert refused.reason == "tokens" and refused.retry_after == 59.0
    assert refused.headers()["x-ratelimit-remaining-tokens"] == "40"
    book.finished("a", "ok", 5)  # corrected to prompt 10 + output 5
    assert book.usage("t", 1.0).tokens == 15
    assert admit(book, pending, "t", 1.0, 50).admitted
    pending.add("b", "t", 1.0, 20)
    refused = admit(book, pending, "t", 1.0, 20)
    assert refused.reason == "concurrent" and refused.retry_after == 1.0
    pending.settle("b")
    book.ended_one("a")
    assert admit(book, pending, "t", 1.0, 20).usage.concurrent == 1


def test_a_tenant_without_limits_is_always_admitted_and_gets_no_headers() -> None:
    v = admit(TenantBook(), TenantPending(), "nobody", 0.0, 10**9)
    assert v.admitted and v.headers() == {}


def test_reset_durations_read_like_openais() -> None:
    assert [duration(s) for s in (0.02, 1.5, 59.0, 360.0)] == ["20ms", "1.5s", "59s", "6m0s"]
