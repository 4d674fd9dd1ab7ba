"""The soak's verdict (cluster/chaos_soak.py): our processes' RSS growth is judged, a NATS
server's is reported only, and the router stream must have been purged behind the snapshots."""

from __future__ import annotations

from typing import Any

from cluster.chaos_soak import STREAM_SNAPSHOT_SPANS, SoakReport, format_report, soak_verdict


def rss(growth: float | None, judged: bool = True, late: float | None = None) -> dict[str, Any]:
    return {"start_kib": 1000, "mid_kib": 1000, "end_kib": 1000,
            "same_process": growth is not None, "growth_pct": growth,
            "late_growth_pct": late, "judged": judged}


def report(**kw: Any) -> SoakReport:
    r = SoakReport(60.0, 15.0, 60.0, 7, snapshot_threshold=kw.pop("threshold", 5000))
    for k, v in kw.items():
        setattr(r, k, v)
    return r


def test_a_grown_replica_fails_and_a_grown_nats_server_is_only_reported() -> None:
    r = report(rss={"r0": rss(12.0), "jetrouter-n2": rss(33.0, judged=False)})
    assert soak_verdict(r) == ["r0: RSS grew 12.0% (> 10%)"]
    rows = {line.split("|")[1].strip(): line.split("|")[5].strip()
            for line in format_report(r).splitlines() if line.startswith("| r0 ")
            or line.startswith("| jetrouter-n2 ")}
    assert rows == {"r0": "+12.0%", "jetrouter-n2": "+33.0% (NATS server: not judged)"}


def test_the_router_stream_must_stay_within_a_few_snapshot_intervals() -> None:
    bound = STREAM_SNAPSHOT_SPANS * 5000
    ok = report(router_stream={"first_seq": 90_001, "last_seq": 90_000 + bound,
                               "messages": bound})
    assert soak_verdict(ok) == []
    grown = report(router_stream={"first_seq": 1, "last_seq": bound + 1,
                                  "messages": bound + 1})
    (line,) = soak_verdict(grown)
    assert line.startswith(f"the router stream holds {bound + 1} messages")
    assert "router stream at the end: 20001 messages (seq 1-20001)" in format_report(grown)


def test_without_a_threshold_or_a_reading_the_stream_is_not_judged() -> None:
    big = {"first_seq": 1, "last_seq": 10**6, "messages": 10**6}
    assert soak_verdict(report(threshold=None, router_stream=big)) == []
    assert soak_verdict(report(router_stream={})) == []


def test_from_a_baseline_still_growing_the_second_halfs_rate_decides() -> None:
    # A short soak on a busy machine: the baseline was read while the processes still grew.
    tail = {"r0": rss(10.6, late=1.7)}  # the warm-up's tail: growth stopped in the first half
    assert soak_verdict(report(rss=tail, warmup_levelled=False)) == []
    assert "+10.6% (+1.7% at the second half's rate)" in format_report(
        report(rss=tail, warmup_levelled=False))
    leak = {"r0": rss(14.0, late=12.5)}  # a leak goes on growing at its rate
    assert soak_verdict(report(rss=leak, warmup_levelled=False)) == [
        "r0: RSS grew 12.5% at the second half's rate (> 10%)"]
    # Memory given back in the first half and taken again in the second: the whole run's
    # smaller growth stands (a leak shows in both figures).
    regrown = {"r0": rss(3.0, late=12.0)}
    assert soak_verdict(report(rss=regrown, warmup_levelled=False)) == []
    # From a levelled-off baseline the whole run's growth is judged, as before.
    assert soak_verdict(report(rss=tail, warmup_levelled=True)) == [
        "r0: RSS grew 10.6% (> 10%)"]
    # Restarted between the halves: no second-half figure, the whole run's growth stands.
    assert soak_verdict(report(rss={"r0": rss(11.0)}, warmup_levelled=False)) == [
        "r0: RSS grew 11.0% (> 10%)"]
