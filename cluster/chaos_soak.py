"""`jetrouter chaos --soak DURATION`: steady load through every replica and a random fault about
every ``fault_interval`` seconds, for a long time, on one chaos cluster.

The run is a sequence of *cycles*. Each cycle sends load (round-robin over healthy replicas, as a
load balancer would), injects one fault chosen at random — a replica SIGKILLed (restarted by the
supervisor) or SIGSTOPped past ``--replica-timeout`` then SIGCONTinued, the router stream
leader's NATS node SIGKILLed and restarted, an engine SIGKILLed (restarted), a bridge SIGKILLed
when the cluster has any — waits for recovery, keeps the load on until the cycle's time is up,
then stops the load and checks a *quiet point*: every replica at the streams' last sequences with
equal state digests, no hole in any stream, every request the client saw succeed present as a
``RequestRouted`` in the router stream (events lost), no load left charged.

A failed request is excused only when it was in flight on the process that was killed: sent to
the killed replica and in flight between the signal and its reaping, or in flight during the
fault on any replica for the other faults (a dead engine's request fails only if every migration
failed too, which the report shows).

Leak check: the RSS of every long-lived process is read after a warm-up without faults, once no
process grew more than 1% over 30 s (at most 5 minutes), and again at the end. NATS servers are
reported, not judged by it: their memory follows the streams they hold and jumps each time a
purge rewrites a stream's files, and Go keeps its heap, so it rose for 10+ minutes in every soak
(by a third in 25 minutes) with no consumer or message left behind. What jetrouter controls there
is judged instead: the router stream is purged behind the snapshots, so at the end it holds no
more than ``STREAM_SNAPSHOT_SPANS`` snapshot intervals of messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import random
import re
import signal
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cluster.chaos_load import LoadDriver, Sent, summarize_failures
from cluster.chaos_scenarios import (
    Probe,
    RouterFollower,
    Timing,
    _child_ready,
    await_declared_lost,
    healthy_baseline,
    nats_cluster_of,
    until_new_events_applied,
    wait_for,
)
from eventlog.names import ROUTER
from eventlog.streams import stream_bounds
from launch.children import children_of

FAULT_KINDS = ("replica-kill", "replica-stop", "nats-kill", "worker-kill", "bridge-kill")
SENTINELS = ("r0", "w0")  # never SIGKILLed: their RSS spans the whole soak
# The leader purges a stream up to the previous snapshot: it holds about two snapshot intervals,
# more while a snapshot is being written under load (2.9 seen with a 20,000 threshold).
STREAM_SNAPSHOT_SPANS = 4
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*$")


def parse_duration(text: str) -> float:
    """'30m', '90s', '1h' or plain seconds → seconds (ValueError with a clear message)."""
    m = _DURATION.match(text)
    if not m:
        raise ValueError(f"not a duration: {text!r} (use e.g. 90s, 30m, 1h)")
    value = float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]
    if value <= 0:
        raise ValueError(f"duration must be positive, got {text!r}")
    return value


@dataclass(slots=True)
class Cycle:
    index: int
    fault: str
    victim: str = ""
    fault_at: float = 0.0
    fault_end: float = 0.0
    requests_ok: int = 0
    requests_failed: int = 0
    failed_excused: int = 0  # in flight on the killed process
    failed_not_excused: int = 0
    recovery_s: float | None = None
    converged: bool = False
    digests_equal: bool = False
    events_lost: int = 0
    load_left: int = 0
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


@dataclass(slots=True)
class SoakReport:
    duration_s: float
    fault_interval_s: float
    window_s: float
    seed: int
    cycles: list[Cycle] = field(default_factory=list)
    p99_by_window: list[tuple[int, int, float | None]] = field(default_factory=list)
    rss: dict[str, dict[str, Any]] = field(default_factory=dict)
    # The router stream at the end ({"first_seq", "last_seq", "messages"}) and the snapshot
    # threshold the replicas ran with (None: not set, the stream is not judged).
    router_stream: dict[str, int] = field(default_factory=dict)
    snapshot_threshold: int | None = None
    warmup_s: float = 0.0  # load without faults before the RSS baseline
    warmup_levelled: bool = False  # every RSS had levelled off when the baseline was taken
    requests_ok: int = 0
    requests_failed: int = 0
    failed_not_excused: int = 0
    events_lost: int = 0
    quiet_points: int = 0
    quiet_points_equal: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# --- processes and memory ---------------------------------------------------------------------


def rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def long_lived(probe: Probe) -> dict[str, int]:
    """name → pid of every process the soak cares about: replicas and their projector
    children, engines (and bridges), NATS servers."""
    out: dict[str, int] = {}
    for name, child in probe.c.children.items():
        if child.pid is None or not child.running:
            continue
        out[name] = child.pid
        for k, sub in enumerate(children_of(child.pid)):
            out[f"{name}/child{k}"] = sub
    for server in nats_servers(probe):
        if server.proc is not None and server.proc.poll() is None:
            out[server.server_name] = server.proc.pid
    return out


def nats_servers(probe: Probe) -> list[Any]:
    """The cluster's NATS servers (none for a cluster without a 3-node NATS cluster)."""
    with contextlib.suppress(RuntimeError):
        return list(nats_cluster_of(probe.c).servers)
    return []


def memory(probe: Probe) -> dict[str, tuple[int, int | None]]:
    return {name: (pid, rss_kib(pid)) for name, pid in long_lived(probe).items()}


# A fresh process grows for minutes under load (its allocator's arenas, the caches and state that
# the traffic fills) and then levels off; the leak check measures from there, so the baseline is
# taken once no process grew more than WARMUP_SETTLED_PCT over one WARMUP_SAMPLE_S sample.
WARMUP_MAX_S = 300.0
WARMUP_SAMPLE_S = 30.0
WARMUP_SETTLED_PCT = 1.0


def grew(before: dict[str, tuple[int, int | None]],
         after: dict[str, tuple[int, int | None]]) -> float:
    """The largest RSS growth in percent of any process alive (the same pid) in both readings."""
    most = 0.0
    for name, (pid, kib) in after.items():
        pid0, kib0 = before.get(name, (None, None))
        if pid0 == pid and kib and kib0:
            most = max(most, 100.0 * (kib - kib0) / kib0)
    return most


async def warm_up(probe: Probe, t: Timing, concurrency: int,
                  max_s: float) -> tuple[dict[str, tuple[int, int | None]], bool]:
    """Load without faults until every process's memory has levelled off (or `max_s` passed);
    returns the RSS baseline of the leak check and whether it had levelled off."""
    warm = LoadDriver(probe.c.router_urls, concurrency=concurrency)
    warm.start(probe.http)
    deadline = time.monotonic() + max_s
    try:
        await wait_for(lambda: asyncio.sleep(0, warm.ok >= 10 * t.warmup_requests), 120)
        sample = min(WARMUP_SAMPLE_S, max_s / 3)
        last = memory(probe)
        while time.monotonic() + sample <= deadline:
            await asyncio.sleep(sample)  # the sampling period of the reading, not a sync
            now = memory(probe)
            if grew(last, now) <= WARMUP_SETTLED_PCT:
                return now, True
            last = now
        return memory(probe), False
    finally:
        await warm.stop()


async def router_stream_state(probe: Probe) -> dict[str, int]:
    """The router stream's first and last sequence and its message count; empty when it cannot
    be read (a report without it is not judged on it)."""
    try:
        first, last = await stream_bounds(probe.js, probe.names.stream(ROUTER))
    except Exception:  # nats-py's timeouts and API errors alike
        return {}
    return {"first_seq": first, "last_seq": last, "messages": max(last - first + 1, 0)}


# --- faults -------------------------------------------------------------------------------------


async def _reaped(probe: Probe, name: str) -> None:
    await wait_for(lambda: asyncio.sleep(0, not probe.c.children[name].running), 10.0,
                   interval=0.01)


async def _ready_again(probe: Probe, name: str, old_pid: int | None, timeout: float) -> bool:
    async def back() -> bool:
        child = probe.c.children[name]
        return (child.running and (old_pid is None or child.pid != old_pid)
                and await _child_ready(probe, name))

    return await wait_for(back, timeout) is not None


async def inject(kind: str, probe: Probe, t: Timing, rng: random.Random, cyc: Cycle) -> bool:
    """Inject one fault; True once the victim is back (recovery is measured by the caller)."""
    if kind in ("replica-kill", "worker-kill", "bridge-kill"):
        pool = {"replica-kill": probe.replicas, "worker-kill": probe.workers,
                "bridge-kill": bridges(probe)}[kind]
        pool = [n for n in pool if n not in SENTINELS] or pool
        cyc.victim = rng.choice(pool)
        cyc.fault_at = time.monotonic()
        old = probe.c.kill(cyc.victim, signal.SIGKILL)
        await _reaped(probe, cyc.victim)
        cyc.fault_end = time.monotonic()
        return await _ready_again(probe, cyc.victim, old, t.recovery_timeout)
    if kind == "replica-stop":
        cyc.victim = rng.choice(probe.replicas)
        # Stopping the leader is part of the fault space; the report says when it was, since
        # a peer is then declared lost only once another replica has taken the lease.
        was_leader = await probe.leader() == cyc.victim
        cyc.fault_at = time.monotonic()
        pid = probe.c.kill(cyc.victim, signal.SIGSTOP)
        try:
            await asyncio.sleep(t.replica_timeout + 1.0)  # the fault's own length, not a sync
            note = await await_declared_lost(probe, cyc.victim, t)
            if note is not None:
                cyc.notes.append(note)
            if was_leader:
                cyc.notes.append(f"{cyc.victim} held the leader lease when stopped")
        finally:
            os.killpg(pid, signal.SIGCONT)  # the group, as it was stopped
            cyc.fault_end = time.monotonic()
        return await _ready_again(probe, cyc.victim, None, t.recovery_timeout)
    if kind == "nats-kill":
        nats = nats_cluster_of(probe.c)
        info = await probe.js.stream_info(probe.names.stream(ROUTER))
        leader = info.cluster.leader if info.cluster else None
        index = next((i for i, s in enumerate(nats.servers) if s.server_name == leader), 1)
        cyc.victim = f"{nats.servers[index].server_name} (router stream leader)"
        cyc.fault_at = cyc.fault_end = time.monotonic()
        await asyncio.to_thread(nats.kill, index)
        if not await until_new_events_applied(probe, t.recovery_timeout):
            cyc.notes.append("replicas did not apply new events while the node was down")
        else:
            cyc.notes.append(f"resumed {time.monotonic() - cyc.fault_at:.1f}s after the kill")
        remaining = t.nats_down_s - (time.monotonic() - cyc.fault_at)
        if remaining > 0:
            await asyncio.sleep(remaining)  # keep the node down for the fault's length
        await asyncio.to_thread(nats.restart, index, 30.0)
        return bool(nats.servers[index].running)
    raise ValueError(f"unknown fault {kind!r}")


def bridges(probe: Probe) -> list[str]:
    return [n for n, ch in probe.c.children.items() if ch.kind == "bridge"]


def fault_kinds(probe: Probe) -> list[str]:
    kinds = list(FAULT_KINDS)
    if not bridges(probe):
        kinds.remove("bridge-kill")  # no bridges in this cluster: nothing to kill
    return kinds


def excused(s: Sent, cyc: Cycle, probe: Probe) -> bool:
    """Was this failed request in flight on the process the cycle's fault killed?"""
    if not s.in_flight_during(cyc.fault_at, cyc.fault_end):
        return False
    if cyc.fault == "replica-kill":
        return s.url == probe.c.children[cyc.victim].url
    return True


# --- quiet points ---------------------------------------------------------------------------


async def quiet_point(probe: Probe, follower: RouterFollower, load: LoadDriver,
                      cyc: Cycle, t: Timing) -> None:
    """Load stopped: digests equal at the streams' ends, no events lost, no load left."""

    async def no_load() -> bool:
        return await probe.active_load() == 0

    if await wait_for(no_load, t.replica_timeout + t.phantom_slack, interval=0.25) is None:
        cyc.load_left = await probe.active_load()

    async def at_end() -> bool:
        return (await probe.converged())[0]

    async def equal() -> bool:
        return (await probe.converged())[1]

    # A leader may still append after the load stopped (a ReplicaLost, a health change, an
    # engine's evictions): wait for a read where every replica sits at the ends and agrees.
    cyc.converged = await wait_for(at_end, 30.0) is not None
    cyc.digests_equal = cyc.converged and await wait_for(equal, 30.0) is not None
    if cyc.converged and not cyc.digests_equal:
        states = await probe.states()
        cyc.notes.append("digests: " + ", ".join(
            f"{n}@{s['positions']}={s['digests']['state']}" for n, s in states.items() if s))
    holes = sum((await probe.holes()).values())
    await follower.caught_up()
    missing = load.ok_request_ids() - follower.routed
    if missing:
        cyc.notes.append(f"acknowledged requests without RequestRouted: {sorted(missing)[:3]}")
    cyc.events_lost = holes + len(missing)


# --- the soak -----------------------------------------------------------------------------------


def _p99(values: Sequence[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


async def run_soak(probe: Probe, follower: RouterFollower, t: Timing, *, duration: float,
                   fault_interval: float = 60.0, seed: int | None = None,
                   concurrency: int = 4, progress: Any = None,
                   warmup_s: float | None = None,
                   snapshot_threshold: int | None = None) -> SoakReport:
    """``snapshot_threshold``: the replicas' ``--router-snapshot-threshold``, by which the
    router stream's size at the end is judged (None: not judged)."""
    seed = seed if seed is not None else random.SystemRandom().randrange(2**31)
    rng = random.Random(seed)
    window = min(300.0, duration / 6) if duration >= 60 else duration
    report = SoakReport(duration, fault_interval, window, seed,
                        snapshot_threshold=snapshot_threshold)
    t_warm = time.monotonic()
    all_sent: list[Sent] = []
    if not await healthy_baseline(probe, t.recovery_timeout):
        raise RuntimeError("chaos cluster not healthy before the soak")

    rss_start, report.warmup_levelled = await warm_up(
        probe, t, concurrency, min(WARMUP_MAX_S, duration / 6) if warmup_s is None else warmup_s)
    report.warmup_s = round(time.monotonic() - t_warm, 1)
    t0 = time.monotonic()
    rss_mid: dict[str, tuple[int, int | None]] | None = None  # after the cycle past half-time
    t_mid = t0
    kinds = fault_kinds(probe)
    index = 0
    while time.monotonic() - t0 < duration:
        cycle_end = min(t0 + duration, time.monotonic() + fault_interval)
        cyc = Cycle(index, rng.choice(kinds))
        index += 1
        if progress:
            progress(f"soak: cycle {cyc.index} at {time.monotonic() - t0:.0f}s: {cyc.fault}")
        load = LoadDriver(probe.c.router_urls, concurrency=concurrency)
        load.start(probe.http)
        try:
            # Fault at a random point in the first half of the cycle, under load.
            lead = rng.uniform(0.2, 0.5) * (cycle_end - time.monotonic())
            await asyncio.sleep(lead)  # when to strike: part of the workload, not a sync
            t_fault = time.monotonic()
            back = await inject(cyc.fault, probe, t, rng, cyc)
            if back and await until_new_events_applied(
                    probe, max(t.recovery_timeout - (time.monotonic() - t_fault), 5.0)):
                cyc.recovery_s = round(time.monotonic() - t_fault, 2)
            else:
                cyc.notes.append("did not recover within the deadline")
            rest = cycle_end - time.monotonic()
            if rest > 0:
                await asyncio.sleep(rest)  # steady load until the cycle's time is up
        finally:
            await load.stop()
        await quiet_point(probe, follower, load, cyc, t)
        failed = load.failed
        cyc.requests_ok = load.ok
        cyc.requests_failed = len(failed)
        cyc.failed_excused = sum(1 for s in failed if excused(s, cyc, probe))
        cyc.failed_not_excused = cyc.requests_failed - cyc.failed_excused
        cyc.failures = summarize_failures(failed)
        all_sent.extend(load.sent)
        report.cycles.append(cyc)
        if progress:
            progress("soak: " + format_cycle(cyc))
        if rss_mid is None and time.monotonic() - t0 >= duration / 2:
            rss_mid, t_mid = memory(probe), time.monotonic()
    rss_end, t_end = memory(probe), time.monotonic()
    nats_names = {server.server_name for server in nats_servers(probe)}
    # The second half's growth, at its rate over the whole run: what a steady leak shows even
    # when the baseline was taken before the warm-up had levelled off.
    scale = (t_end - t0) / (t_end - t_mid) if rss_mid is not None and t_end > t_mid else None
    for name in sorted(set(rss_start) | set(rss_end)):
        pid0, kib0 = rss_start.get(name, (None, None))
        pidm, kibm = (rss_mid or {}).get(name, (None, None))
        pid1, kib1 = rss_end.get(name, (None, None))
        same = pid0 is not None and pid0 == pid1
        growth = (round(100.0 * (kib1 - kib0) / kib0, 1)
                  if same and kib0 and kib1 is not None else None)
        late = (round(100.0 * (kib1 - kibm) / kibm * scale, 1)
                if scale is not None and pidm == pid1 and kibm and kib1 is not None else None)
        report.rss[name] = {"start_kib": kib0, "mid_kib": kibm, "end_kib": kib1,
                            "same_process": same, "growth_pct": growth,
                            "late_growth_pct": late, "judged": name not in nats_names}
    report.router_stream = await router_stream_state(probe)
    n_windows = max(1, math.ceil(duration / window))
    for w in range(n_windows):
        lo, hi = t0 + w * window, t0 + (w + 1) * window
        lat = [s.ended - s.started for s in all_sent if s.ok and lo <= s.started < hi]
        report.p99_by_window.append((int(w * window), len(lat), _p99(lat)))
    report.requests_ok = sum(c.requests_ok for c in report.cycles)
    report.requests_failed = sum(c.requests_failed for c in report.cycles)
    report.failed_not_excused = sum(c.failed_not_excused for c in report.cycles)
    report.events_lost = sum(c.events_lost for c in report.cycles)
    report.quiet_points = len(report.cycles)
    report.quiet_points_equal = sum(1 for c in report.cycles if c.digests_equal)
    return report


# --- report ---------------------------------------------------------------------------------


def format_cycle(c: Cycle) -> str:
    rec = "-" if c.recovery_s is None else f"{c.recovery_s:.1f}"
    return (f"#{c.index} {c.fault} {c.victim}: ok={c.requests_ok} failed={c.requests_failed} "
            f"(in flight on the killed process {c.failed_excused}) recovery={rec}s "
            f"events_lost={c.events_lost} digests_equal={'yes' if c.digests_equal else 'no'}"
            + (f" load_left={c.load_left}" if c.load_left else ""))


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    cells = [list(header), *[list(r) for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |"
             for r in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return lines


def format_report(r: SoakReport) -> str:
    out = [f"soak: {r.duration_s:.0f}s, a fault every ~{r.fault_interval_s:.0f}s, seed {r.seed}"
           f" (RSS baseline after {r.warmup_s:.0f}s of warm-up load: "
           + ("levelled off)" if r.warmup_levelled else "still growing at the warm-up's end, "
              "so the second half's rate is judged too)"),
           "", *_table(
               ("requests ok", "failed", "failed not in flight on a killed process",
                "events lost", "quiet points with equal digests"),
               [(str(r.requests_ok), str(r.requests_failed), str(r.failed_not_excused),
                 str(r.events_lost), f"{r.quiet_points_equal}/{r.quiet_points}")]), ""]
    out += _table(("cycle", "fault", "victim", "ok", "failed", "in flight on killed",
                   "recovery s", "events lost", "digests equal", "notes"),
                  [(str(c.index), c.fault, c.victim, str(c.requests_ok),
                    str(c.requests_failed), str(c.failed_excused),
                    "-" if c.recovery_s is None else f"{c.recovery_s:.1f}",
                    str(c.events_lost), "yes" if c.digests_equal else "NO",
                    "; ".join(c.notes + ([f"load left {c.load_left}"] if c.load_left else [])))
                   for c in r.cycles])
    out.append("")
    out += _table(("window start s", "requests ok", "p99 latency s"),
                  [(str(s), str(n), "-" if p is None else f"{p:.3f}")
                   for s, n, p in r.p99_by_window])
    out.append("")
    out += _table(("process", "RSS start MiB", "RSS mid MiB", "RSS end MiB", "growth"),
                  [(name, _mib(v["start_kib"]), _mib(v.get("mid_kib")), _mib(v["end_kib"]),
                    _growth(v)) for name, v in r.rss.items()])
    if r.router_stream:
        out += ["", f"router stream at the end: {r.router_stream['messages']} messages "
                f"(seq {r.router_stream['first_seq']}-{r.router_stream['last_seq']}); "
                f"snapshot threshold {r.snapshot_threshold or '-'}"]
    return "\n".join(out)


def _growth(v: dict[str, Any]) -> str:
    if v["growth_pct"] is None:
        return "restarted (not judged)"
    late = v.get("late_growth_pct")
    return (f"{v['growth_pct']:+.1f}%"
            + ("" if late is None else f" ({late:+.1f}% at the second half's rate)")
            + ("" if v["judged"] else " (NATS server: not judged)"))


def judged_growth(v: dict[str, Any], warmup_levelled: bool) -> float | None:
    """The growth a process is judged by: over the whole run from a levelled-off baseline;
    from a baseline taken while processes still grew (a short soak on a busy machine), the
    smaller of that and the second half's growth at its rate over the run, since the tail of a
    warm-up stops while a leak goes on."""
    growth, late = v["growth_pct"], v.get("late_growth_pct")
    if growth is None or warmup_levelled or late is None:
        return growth
    return min(growth, late)


def _mib(kib: int | None) -> str:
    return "-" if kib is None else f"{kib / 1024:.1f}"


def soak_verdict(r: SoakReport, max_growth_pct: float = 10.0) -> list[str]:
    bad = []
    if r.failed_not_excused:
        bad.append(f"{r.failed_not_excused} requests failed that were not in flight on a "
                   "killed process")
    if r.events_lost:
        bad.append(f"{r.events_lost} events lost")
    if r.quiet_points_equal != r.quiet_points:
        bad.append(f"digests equal at only {r.quiet_points_equal}/{r.quiet_points} quiet points")
    for name, v in r.rss.items():
        growth = judged_growth(v, r.warmup_levelled)
        if v["judged"] and growth is not None and growth > max_growth_pct:
            how = "" if growth == v["growth_pct"] else " at the second half's rate"
            bad.append(f"{name}: RSS grew {growth:.1f}%{how} (> {max_growth_pct:.0f}%)")
    held, threshold = r.router_stream.get("messages"), r.snapshot_threshold
    if held is not None and threshold and held > STREAM_SNAPSHOT_SPANS * threshold:
        bad.append(f"the router stream holds {held} messages at the end (> "
                   f"{STREAM_SNAPSHOT_SPANS} x the snapshot threshold {threshold}): "
                   "it is not purged behind the snapshots")
    return bad
