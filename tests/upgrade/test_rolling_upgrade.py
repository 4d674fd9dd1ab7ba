"""A rolling upgrade from the previous release, and its rollback, under load (opt-in).

A cluster of the previous release (replicas and engines run by its own interpreter, installed
from this repository's history: tests/upgrade/README.md) takes steady load from the chaos
suite's client (cluster/chaos_load.py). Its replicas are then upgraded one by one to this tree
(a graceful stop, then a start with the new code), and afterwards rolled back one by one. At
every step:

* no request fails except ones in flight at the replica being restarted (the process that was
  stopped on purpose);
* once the load pauses, every replica reaches the streams' ends with one state digest, whatever
  mix of releases is running;
* the restarted replica started from a snapshot, written by whichever release led then.

Opt-in: it runs only when ``JETROUTER_PREVIOUS_PYTHON`` names the previous release's
interpreter; otherwise it is skipped (CI has no second install).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import nats
import pytest

from cluster.chaos_load import LoadDriver, Sent, summarize_failures
from cluster.chaos_scenarios import Probe
from launch.children import Child
from launch.local_cluster import LocalCluster
from tests.waiting import until

PREVIOUS = os.environ.get("JETROUTER_PREVIOUS_PYTHON", "")
pytestmark = [
    pytest.mark.upgrade,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not PREVIOUS, reason="set JETROUTER_PREVIOUS_PYTHON to the previous "
                                            "release's interpreter (tests/upgrade/README.md)"),
]
# -I: the previous release must import its own installed packages, not this tree (which the
# cluster puts on PYTHONPATH and is the working directory); -u: what -I drops of the env.
OLD = [PREVIOUS, "-I", "-u"]
NEW = [sys.executable]
ROUTER_ARGS = ["--replica-timeout", "4", "--heartbeat-interval", "0.5", "--worker-timeout", "4",
               "--lease-ttl", "2", "--canary-interval", "0"]


class MixedCluster(LocalCluster):
    """A LocalCluster whose children each run under the interpreter named for them."""

    def __init__(self, interpreters: dict[str, list[str]], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.interpreters = interpreters

    def _finish_argv(self, child: Child) -> None:
        super()._finish_argv(child)
        child.argv[:1] = self.interpreters.get(child.name, NEW)


def _casualty(s: Sent, url: str, window: tuple[float, float]) -> bool:
    """A request to the replica being restarted, in flight while it was down on purpose."""
    return s.url == url and s.in_flight_during(*window)


async def _versions(h: httpx.AsyncClient, c: LocalCluster) -> dict[str, str]:
    """Each replica's release as a replica of this tree reports it ("previous": none there)."""
    auth = {"authorization": f"Bearer {c.admin_token}"}
    for url in c.router_urls:
        r = await h.get(f"{url}/admin/replicas", headers=auth)
        rows = r.json()["replicas"]
        if any("version" in row for row in rows):
            return {row["replica_id"]: row.get("version") or "previous" for row in rows}
    return {}


async def _step(probe: Probe, h: httpx.AsyncClient, c: MixedCluster, name: str,
                to: Sequence[str], report: list[str]) -> None:
    """Restart replica ``name`` under ``to`` while the load runs; check the step."""
    child = c.children[name]
    driver = LoadDriver(c.router_urls, concurrency=4, max_tokens=8)
    driver.start(h)
    await until(lambda: driver.ok >= 20, timeout=120, what="load flowing")
    r = await h.post(f"{c.router_urls[0]}/admin/snapshot",
                     headers={"authorization": f"Bearer {c.admin_token}"})
    assert r.status_code == 200, r.text
    writer = r.json().get("created_by", "?")
    c.interpreters[name] = list(to)
    c._finish_argv(child)  # the supervisor restarts it with this command line
    old_pid = child.pid
    t0 = time.monotonic()
    c.kill(name, signal.SIGTERM)  # a graceful stop, as an orchestrator's rolling update does
    await until(lambda: child.pid not in (None, old_pid), timeout=60, what=f"{name} restarted")
    await c.wait_ready([name], timeout=120)
    t1 = time.monotonic()
    served = driver.ok
    await until(lambda: driver.ok >= served + 20 and any(
        s.ok and s.url == child.url and s.started > t1 for s in driver.sent), timeout=120,
                what=f"{name} serving again")
    await driver.stop()
    failed = [s for s in driver.failed if not _casualty(s, child.url, (t0, t1))]
    casualties = sorted({s.error for s in driver.failed if _casualty(s, child.url, (t0, t1))})
    n_casualties = len(driver.failed) - len(failed)
    assert not failed, summarize_failures(failed)
    converged = await until(probe.converged, lambda v: v[1], timeout=90,
                            what="replicas at the streams' ends with one digest")
    states = await probe.states()
    digests = {s["digests"]["state"] for s in states.values() if s}
    assert converged[1] and len(digests) == 1
    assert states[name] is not None and states[name]["restores"] >= 1  # from the snapshot
    versions = await _versions(h, c)
    report.append(f"{name} -> {'new' if list(to) == NEW else 'previous'}: "
                  f"{driver.ok} ok, {len(failed)} failed, {n_casualties} failed at {name} "
                  f"while it restarted ({', '.join(casualties) or '-'}); digest "
                  f"{digests.pop()} on all; snapshot before it taken by {writer}; "
                  f"versions {versions}")


async def test_rolling_upgrade_then_rollback_under_load(tmp_path: Path) -> None:
    names = [f"r{i}" for i in range(3)]
    interpreters = {n: OLD for n in [*names, "w0", "w1"]}
    report: list[str] = []
    async with MixedCluster(interpreters, replicas=3, workers=2, data_dir=tmp_path,
                            namespace="upg", router_args=ROUTER_ARGS,
                            worker_args=["--num-gpu-blocks", "4096"],
                            ready_timeout=120.0) as c, httpx.AsyncClient() as h:
        nc = await nats.connect(c.nats_url)
        try:
            probe = Probe(c, h, nc)
            await until(probe.all_see_workers, timeout=60, what="every replica sees the engines")
            for name in names:
                await _step(probe, h, c, name, NEW, report)
            for name in names:
                await _step(probe, h, c, name, OLD, report)
        finally:
            await nc.close()
            print("\nrolling upgrade (previous -> this tree), then rollback:")
            print("\n".join(report))
