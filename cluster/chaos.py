"""`jetrouter chaos`: kill things in a local cluster under load and print what it cost.

Starts a `LocalCluster` with three clustered nats-servers, three replicas and four simulated
workers (short replica/worker timeouts so a run takes minutes), then runs each scenario of
:mod:`cluster.chaos_scenarios` in turn on the same cluster: requests failed (and whether they were
in flight at the fault), events lost, recovery time, phantom load and digest equality. Prints a
table and, with ``--json OUT``, writes every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from cluster.chaos_outage import OUTAGE_FAULTS, OUTAGE_SCENARIOS
from cluster.chaos_scenarios import (
    FAULTS,
    SCENARIOS,
    Probe,
    RouterFollower,
    ScenarioResult,
    Timing,
    run_scenario,
)
from eventlog.connect import connect
from launch.local_cluster import LocalCluster

ALL_SCENARIOS = (*SCENARIOS, *OUTAGE_SCENARIOS)
ALL_FAULTS = {**FAULTS, **OUTAGE_FAULTS}


def cluster_args(t: Timing) -> tuple[list[str], list[str]]:
    """(router_args, worker_args) for a chaos cluster: timeouts short enough to see in a run."""
    router = ["--replica-timeout", str(t.replica_timeout), "--heartbeat-interval", "0.5",
              "--worker-timeout", str(t.replica_timeout), "--lease-ttl", "2"]
    worker = ["--num-gpu-blocks", "4096"]
    return router, worker


def chaos_cluster(data_dir: Path, t: Timing, *, replicas: int = 3, workers: int = 4,
                  namespace: str = "chaos", extra_router_args: Sequence[str] = ()
                  ) -> LocalCluster:
    router, worker = cluster_args(t)
    router += list(extra_router_args)
    return LocalCluster(replicas=replicas, workers=workers, data_dir=data_dir,
                        namespace=namespace, nats_cluster=3, router_args=router,
                        worker_args=worker, ready_timeout=120.0)


class ChaosSession:
    """A running cluster plus the connections the scenarios read it with."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        self.http: httpx.AsyncClient | None = None
        self.nc: Any = None
        self.probe: Probe | None = None
        self.follower: RouterFollower | None = None

    async def __aenter__(self) -> ChaosSession:
        self.http = httpx.AsyncClient()
        self.nc = await connect(self.cluster.client_options, name="jetrouter-chaos",
                                max_reconnect_attempts=-1, reconnect_time_wait=0.5)
        self.probe = Probe(self.cluster, self.http, self.nc)
        self.follower = RouterFollower(self.probe.js, self.probe.names)
        self.follower.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.follower is not None:
            await self.follower.stop()
        if self.nc is not None:
            await self.nc.close()
        if self.http is not None:
            await self.http.aclose()

    async def run(self, name: str, t: Timing) -> ScenarioResult:
        assert self.probe is not None and self.follower is not None
        return await run_scenario(name, self.probe, self.follower, t, faults=ALL_FAULTS)


async def run_chaos(scenarios: Sequence[str], t: Timing, data_dir: Path,
                    progress: bool = True) -> list[ScenarioResult]:
    results = []
    async with chaos_cluster(data_dir, t) as cluster, ChaosSession(cluster) as session:
        for name in scenarios:
            if progress:
                print(f"chaos: {name} ...", file=sys.stderr, flush=True)
            res = await session.run(name, t)
            if progress:
                print("chaos: " + format_row(res), file=sys.stderr, flush=True)
            results.append(res)
    return results


# --- report --------------------------------------------------------------------------------

HEADER = ("scenario", "victim", "ok", "failed", "in-flight@fault", "failed not in flight",
          "events lost", "serving gap s", "recovery s", "phantom gone s", "digests equal")


def _cells(r: ScenarioResult) -> list[str]:
    recovery = "-" if r.recovery_s is None else f"{r.recovery_s:.1f}"
    if r.resume_s is not None:
        recovery += f" (resumed {r.resume_s:.1f})"
    phantom = (f"{r.phantom_cleared_s:.1f}" if r.phantom_cleared_s is not None
               else f"NO ({r.phantom_left} left)")
    digests = "yes" if r.digests_equal else ("no" if r.converged else "not converged")
    gap = "-" if r.serving_gap_s is None else f"{r.serving_gap_s:.1f}"
    return [r.scenario, r.victim, str(r.requests_ok), str(r.requests_failed),
            str(r.in_flight_at_fault), str(r.failed_not_in_flight), str(r.events_lost),
            gap, recovery, phantom, digests]


def format_row(r: ScenarioResult) -> str:
    return " | ".join(f"{h}={c}" for h, c in zip(HEADER, _cells(r), strict=True))


def format_table(results: Sequence[ScenarioResult]) -> str:
    rows = [list(HEADER), *(_cells(r) for r in results)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(HEADER))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"
             for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    notes = [f"- {r.scenario}: {n}" for r in results for n in r.notes]
    notes += [f"- {r.scenario} failure: {f}" for r in results for f in r.failures]
    return "\n".join(lines + (["", "notes:", *notes] if notes else []))


def verdict(results: Sequence[ScenarioResult]) -> list[str]:
    """What every scenario must hold (no event lost, equal digests, ...), as failures
    (empty: all held)."""
    bad = []
    for r in results:
        if r.events_lost:
            bad.append(f"{r.scenario}: {r.events_lost} events lost")
        if not r.digests_equal:
            bad.append(f"{r.scenario}: replicas did not converge to equal digests")
        if r.failed_not_in_flight:
            bad.append(f"{r.scenario}: {r.failed_not_in_flight} failures not in flight")
        if r.recovery_s is None:
            bad.append(f"{r.scenario}: did not recover")
        if r.phantom_cleared_s is None:
            bad.append(f"{r.scenario}: phantom load left ({r.phantom_left})")
    return bad


# --- the verb ------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scenario", action="append", choices=ALL_SCENARIOS, default=None,
                   help="run only this scenario (repeatable; default: all, in order: "
                   + ", ".join(ALL_SCENARIOS) + ")")
    p.add_argument("--short", action="store_true",
                   help="shorter warm-up, outage and settle times (the CI variant)")
    p.add_argument("--json", type=Path, default=None, metavar="OUT",
                   help="write every figure of every scenario to this JSON file")
    p.add_argument("--data-dir", type=Path, default=None,
                   help="cluster data and logs (default: a fresh temporary directory)")
    p.add_argument("--soak", type=_duration, default=None, metavar="DURATION",
                   help="instead of the scenarios: steady load and a random fault every "
                        "--fault-interval for this long (e.g. 30m), then a report of requests, "
                        "events lost, digests at quiet points, RSS and p99 per window")
    p.add_argument("--fault-interval", type=_duration, default=60.0, metavar="DURATION",
                   help="soak: time between faults (default 60s)")
    p.add_argument("--seed", type=int, default=None, help="soak: seed of the fault choice")


def _duration(text: str) -> float:
    from cluster.chaos_soak import parse_duration

    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


async def run_soak_cluster(args: argparse.Namespace, t: Timing, data_dir: Path) -> int:
    from cluster.chaos_soak import format_report, run_soak, soak_verdict

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    # A soak runs long enough for the streams to matter: the leader snapshots and purges as a
    # production deployment would (so restarted replicas also load snapshots mid-soak). At the
    # soak's ~100 router messages a second this is a snapshot about every minute, so faults keep
    # landing during snapshots and purges, and the router stream's size is judged by it.
    threshold = 5000
    extra = ["--router-snapshot-threshold", str(threshold)]
    async with chaos_cluster(data_dir, t, extra_router_args=extra) as cluster, \
            ChaosSession(cluster) as session:
        assert session.probe is not None and session.follower is not None
        report = await run_soak(session.probe, session.follower, t, duration=args.soak,
                                fault_interval=args.fault_interval, seed=args.seed,
                                progress=progress, snapshot_threshold=threshold)
    print(format_report(report))
    bad = soak_verdict(report)
    if args.json is not None:
        args.json.write_text(json.dumps({"timing": dataclasses.asdict(t),
                                         "soak": report.as_dict(), "violations": bad},
                                        indent=2) + "\n")
    for line in bad:
        print(f"expectation not met: {line}", file=sys.stderr)
    return 1 if bad else 0


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s chaos: %(message)s",
                        datefmt="%H:%M:%S")
    t = Timing.short() if args.short else Timing()
    if args.soak is not None:
        if args.data_dir is not None:
            args.data_dir.mkdir(parents=True, exist_ok=True)
            return asyncio.run(run_soak_cluster(args, t, args.data_dir))
        with tempfile.TemporaryDirectory(prefix="jetrouter-soak-") as tmp:
            return asyncio.run(run_soak_cluster(args, t, Path(tmp)))
    scenarios = args.scenario or list(ALL_SCENARIOS)
    if args.data_dir is not None:
        args.data_dir.mkdir(parents=True, exist_ok=True)
        results = asyncio.run(run_chaos(scenarios, t, args.data_dir))
    else:
        with tempfile.TemporaryDirectory(prefix="jetrouter-chaos-") as tmp:
            results = asyncio.run(run_chaos(scenarios, t, Path(tmp)))
    print(format_table(results))
    bad = verdict(results)
    if args.json is not None:
        args.json.write_text(json.dumps({
            "timing": dataclasses.asdict(t),
            "scenarios": [r.as_dict() for r in results], "violations": bad}, indent=2) + "\n")
    for line in bad:
        print(f"expectation not met: {line}", file=sys.stderr)
    return 1 if bad else 0
