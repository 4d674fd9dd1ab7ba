"""A short soak (slow; the 30-minute one is `make soak`, not CI): steady load and a fault every
15 s on one chaos cluster; every quiet point has equal digests, nothing is lost, and failures
are only requests in flight on a killed process. RSS is reported, not judged: a short run on a
shared machine says nothing about leaks.

Two cycles are what a soak adds to the single-fault chaos tests (faults in sequence on one
cluster, each followed by a quiet point); with seed 7 they are a NATS node kill and a worker
kill. A third cycle (a replica kill) only repeated tests/chaos/test_chaos.py's
test_replica_sigkill_under_load, which checks the same things."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.chaos import ChaosSession, chaos_cluster
from cluster.chaos_scenarios import Timing
from cluster.chaos_soak import format_report, run_soak, soak_verdict

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(400)]


async def test_short_soak_holds_its_expectations(tmp_path: Path) -> None:
    t = Timing.short()
    async with chaos_cluster(tmp_path, t, namespace="soak") as cluster, \
            ChaosSession(cluster) as session:
        assert session.probe is not None and session.follower is not None
        report = await run_soak(session.probe, session.follower, t, duration=30.0,
                                fault_interval=15.0, seed=7)
    text = format_report(report)
    assert soak_verdict(report, max_growth_pct=1e9) == [], text
    assert report.quiet_points == len(report.cycles) >= 2, text
    assert report.requests_ok > 0 and report.p99_by_window, text
    assert {"r0", "w0"} <= set(report.rss), text
