"""The chaos scenarios of `jetrouter chaos` and the probes that judge them.

Every scenario runs the same way against a running `LocalCluster` under steady load
(:class:`~cluster.chaos_load.LoadDriver`): wait until traffic flows, inject the fault, measure
*recovery* (from the fault until the victim is back and every replica is ready and has applied
router events appended after that point), keep the load going a little, stop it, then measure
*phantom load* (time until no replica charges any worker with an active request: with no load
left, anything still charged belongs to a dead owner) and finally check *convergence*: every
replica at the streams' last sequences with equal state digests.

*Events lost* adds two independent counts: holes in each stream's sequence range (JetStream's
own message count against ``last - first + 1``), and requests the client saw succeed whose
`RequestRouted` never showed up in the router stream (a replica appends the decision, and waits
for the ack, before proxying, so a 200 without one is an acknowledged event that vanished).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext

from cluster.chaos_load import LoadDriver, summarize_failures
from eventlog import events as ev
from eventlog.names import ROUTER, STREAM_KINDS, Names
from eventlog.reader import StreamReader
from eventlog.streams import stream_bounds
from launch.local_cluster import LocalCluster

SCENARIOS = ("replica-kill", "nats-kill", "replica-stop", "worker-kill", "cold-start")


@dataclass(frozen=True, slots=True)
class Timing:
    """How long things last; `short` is the CI variant."""

    warmup_requests: int = 30
    settle_s: float = 4.0  # load kept on after recovery
    nats_down_s: float = 5.0
    nats_outage_s: float = 10.0  # every node down (cluster/chaos_outage.py)
    replica_timeout: float = 3.0
    recovery_timeout: float = 90.0
    phantom_slack: float = 10.0  # phantom load must go within replica_timeout + this

    @classmethod
    def short(cls) -> Timing:
        return cls(warmup_requests=12, settle_s=1.5, nats_down_s=2.0, nats_outage_s=6.0,
                   recovery_timeout=75.0)


@dataclass(slots=True)
class ScenarioResult:
    scenario: str
    victim: str = ""
    fault_at: float = 0.0  # monotonic: the signal was sent
    fault_end: float = 0.0  # monotonic: the fault stopped acting (SIGCONT; = fault_at for kills)
    requests_ok: int = 0
    requests_failed: int = 0
    in_flight_at_fault: int = 0
    failed_not_in_flight: int = 0  # failures that were NOT in flight at the fault: real ones
    events_lost: int = 0
    stream_holes: dict[str, int] = field(default_factory=dict)
    acked_routed_missing: int = 0
    decisions_not_appended: int = 0  # served in degraded mode: no RequestRouted by design
    resume_s: float | None = None  # nats-kill: replicas applying new events while a node is down
    # From the fault to the first answer (200) of a request sent after it: how long new
    # requests went unserved (a request sent during a stream leader election waits for it
    # unless --decision-record-grace lets it through).
    serving_gap_s: float | None = None
    recovery_s: float | None = None
    phantom_cleared_s: float | None = None  # None: still there at the deadline
    phantom_left: int = 0
    converged: bool = False
    digests_equal: bool = False
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class RouterFollower:
    """Reads the router stream from its start for the whole run: the ids of every
    `RequestRouted` it ever held, and any sequence hole seen on the way."""

    def __init__(self, js: JetStreamContext, names: Names) -> None:
        self.js, self.stream = js, names.stream(ROUTER)
        self.routed: set[str] = set()
        self.last_seq = 0
        self.holes = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="chaos-router-follower")

    async def _run(self) -> None:
        reader = StreamReader(self.js, self.stream, start_seq=1)
        try:
            async for seq, batch in reader:
                if self.last_seq and seq != self.last_seq + 1:
                    self.holes += seq - self.last_seq - 1
                self.last_seq = seq
                self.routed.update(e.request_id for e in batch
                                   if isinstance(e, ev.RequestRouted))
        finally:
            with contextlib.suppress(Exception):
                await reader.close()

    async def caught_up(self, timeout: float = 30.0) -> None:
        _, last = await stream_bounds(self.js, self.stream)
        deadline = time.monotonic() + timeout
        while self.last_seq < last:
            if self._task is not None and self._task.done():
                self._task.result()  # the follower died: say why
            if time.monotonic() > deadline:
                raise TimeoutError(f"router follower at {self.last_seq}, stream at {last}")
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task


class Probe:
    """Reads the cluster: replica admin states and loads, stream bounds and holes."""

    def __init__(self, cluster: LocalCluster, http: httpx.AsyncClient, nc: NatsClient) -> None:
        self.c, self.http, self.nc = cluster, http, nc
        # Short API waits: during a stream leader election a request with nats-py's default 5 s
        # wait would blur the recovery times measured here by up to 5 s (callers retry).
        self.js = nc.jetstream(timeout=2.0)
        self.names = Names(cluster.namespace)
        self.auth = {"authorization": f"Bearer {cluster.admin_token}"}
        self.replicas = [n for n, ch in cluster.children.items() if ch.kind == "replica"]
        self.workers = [n for n, ch in cluster.children.items() if ch.kind == "worker"]

    async def get(self, name: str, path: str) -> Any:
        r = await self.http.get(self.c.children[name].url + path, headers=self.auth, timeout=5)
        r.raise_for_status()
        return r.json()

    async def states(self) -> dict[str, dict[str, Any] | None]:
        async def one(name: str) -> dict[str, Any] | None:
            try:
                return await self.get(name, "/admin/state")
            except (httpx.HTTPError, ValueError):
                return None

        answers = await asyncio.gather(*(one(n) for n in self.replicas))
        return dict(zip(self.replicas, answers, strict=True))

    async def leader(self) -> str | None:
        leaders = [n for n, s in (await self.states()).items() if s and s["leader"]]
        return leaders[0] if len(leaders) == 1 else None

    async def stream_lasts(self, timeout: float = 30.0) -> dict[str, int]:
        """Last sequence per stream; retried through a NATS node's death and the election
        that follows (our own connection fails over too)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                out = {}
                for kind in STREAM_KINDS:
                    out[kind] = (await stream_bounds(self.js, self.names.stream(kind)))[1]
                return out
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)

    async def holes(self) -> dict[str, int]:
        """Per stream: sequences between first and last that the stream does not hold."""
        out = {}
        for kind in STREAM_KINDS:
            st = (await self.js.stream_info(self.names.stream(kind))).state
            span = st.last_seq - st.first_seq + 1 if st.messages else 0  # empty: no span
            out[kind] = max(span - st.messages, 0)
        return out

    async def active_load(self) -> int:
        """Active requests plus charged prefill tokens and decode blocks, summed over replicas
        (a replica that does not answer counts as 1: nothing is proven about it)."""
        total = 0
        for name in self.replicas:
            try:
                state = await self.get(name, "/admin/state")
                workers = (await self.get(name, "/admin/workers"))["workers"]
            except (httpx.HTTPError, ValueError, KeyError):
                total += 1
                continue
            total += int(state["active_requests"])
            total += sum(w["active_prefill_tokens"] + w["active_decode_blocks"] for w in workers)
        return total

    async def all_see_workers(self) -> bool:
        for name in self.replicas:
            try:
                ws = (await self.get(name, "/admin/workers"))["workers"]
            except (httpx.HTTPError, ValueError, KeyError):
                return False
            if {w["worker_id"] for w in ws} != set(self.workers):
                return False
        return True

    async def router_positions(self) -> dict[str, int | None]:
        """Each replica's applied router-stream position (None: it did not answer)."""
        return {n: (s["positions"][ROUTER] if s is not None else None)
                for n, s in (await self.states()).items()}

    async def applied_past(self, lasts: dict[str, int]) -> bool:
        """Every replica ready and at or past `lasts` on every stream."""
        states = await self.states()
        return all(s is not None and s["ready"]
                   and all(s["positions"][k] >= lasts[k] for k in STREAM_KINDS)
                   for s in states.values())

    async def converged(self) -> tuple[bool, bool]:
        """(every replica ready at the streams' last sequences, their state digests equal)."""
        lasts = await self.stream_lasts()
        states = await self.states()
        if any(s is None or not s["ready"] for s in states.values()):
            return False, False
        at_end = all(s is not None and all(s["positions"][k] == lasts[k] for k in STREAM_KINDS)
                     for s in states.values())
        digests = {s["digests"]["state"] for s in states.values() if s is not None}
        return at_end, at_end and len(digests) == 1


async def wait_for(check: Callable[[], Awaitable[bool]], timeout: float,
                   interval: float = 0.1) -> float | None:
    """Seconds until `check()` held, or None at the deadline (errors count as not yet)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        with contextlib.suppress(Exception):
            if await check():
                return time.monotonic() - t0
        await asyncio.sleep(interval)
    return None


async def until_new_events_applied(probe: Probe, timeout: float) -> bool:
    """Wait for the router stream to grow (the load appends), then for every replica to be
    ready and to have applied it: proof that every replica follows events written from now."""
    start = await probe.stream_lasts()

    async def grown() -> bool:
        return (await probe.stream_lasts())[ROUTER] > start[ROUTER]

    t0 = time.monotonic()
    if await wait_for(grown, timeout) is None:
        return False
    target = await probe.stream_lasts()
    rest = max(timeout - (time.monotonic() - t0), 1.0)
    return await wait_for(lambda: probe.applied_past(target), rest) is not None


# --- faults --------------------------------------------------------------------------------


async def _reaped(probe: Probe, names: list[str], res: ScenarioResult) -> None:
    """A SIGKILLed process dies a moment after the signal: connections its kernel socket
    accepted meanwhile fail too, so they count as in flight until it has been reaped."""
    await wait_for(lambda: asyncio.sleep(0, not any(probe.c.children[n].running
                                                     for n in names)), 10.0, interval=0.01)
    res.fault_end = time.monotonic()


def _pid_changed(cluster: LocalCluster, name: str, old: int) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        child = cluster.children[name]
        return child.running and child.pid not in (None, old)

    return check


async def _kill_one(probe: Probe, victim: str, res: ScenarioResult) -> Callable[
        [], Awaitable[bool]]:
    """SIGKILL ``victim`` and wait until it is reaped; returns whether it is back (a new pid)."""
    res.victim = victim
    res.fault_at = res.fault_end = time.monotonic()
    old = probe.c.kill(victim, signal.SIGKILL)
    await _reaped(probe, [victim], res)
    return _pid_changed(probe.c, victim, old)


async def _child_ready(probe: Probe, name: str) -> bool:
    child = probe.c.children[name]
    if not child.running:
        return False
    try:
        r = await probe.http.get(child.url + child.probe_path, timeout=1.0)
    except httpx.HTTPError:
        return False
    return r.status_code == 200


async def fault_replica_kill(probe: Probe, t: Timing, res: ScenarioResult) -> Callable[
        [], Awaitable[bool]]:
    victim = await probe.leader() or probe.replicas[0]  # the leader: the harder case
    changed = await _kill_one(probe, victim, res)

    async def back() -> bool:
        return await changed() and await _child_ready(probe, victim)

    return back


async def fault_replica_stop(probe: Probe, t: Timing, res: ScenarioResult) -> Callable[
        [], Awaitable[bool]]:
    leader = await probe.leader()
    victim = next(n for n in probe.replicas if n != leader)
    res.victim = victim
    res.fault_at = time.monotonic()
    pid = probe.c.kill(victim, signal.SIGSTOP)
    try:
        # Longer than --replica-timeout, and until the leader has declared it lost (or a
        # generous bound, noted if it passes without a declaration).
        await asyncio.sleep(t.replica_timeout + 1.0)  # the fault's own duration, not a sync
        note = await await_declared_lost(probe, victim, t)
        if note is not None:
            res.notes.append(note)
    finally:
        os.killpg(pid, signal.SIGCONT)  # the group, as it was stopped
        res.fault_end = time.monotonic()

    async def back() -> bool:
        return await _child_ready(probe, victim)

    return back


async def _declared_lost(probe: Probe, victim: str) -> bool:
    for name in probe.replicas:
        if name == victim:
            continue
        rows = (await probe.get(name, "/admin/replicas"))["replicas"]
        if any(r.get("replica_id") == victim and r.get("declared_lost") for r in rows):
            return True
    return False


async def _owned_by(probe: Probe, victim: str) -> int:
    """In-flight requests the other replicas see ``victim`` owning (the most any one sees)."""
    owned = 0
    for name in probe.replicas:
        if name != victim:
            rows = (await probe.get(name, "/admin/replicas"))["replicas"]
            owned = max([owned, *(int(r.get("owned_requests", 0)) for r in rows
                                  if r.get("replica_id") == victim)])
    return owned


async def await_declared_lost(probe: Probe, victim: str, t: Timing) -> str | None:
    """Once a stopped replica has been silent past ``--replica-timeout``: wait (with a generous
    bound) for the leader to declare it lost. Only a replica that owns in-flight requests is
    declared (design.md §7): one whose decisions all finished, or were still in its own
    group-commit buffer when it froze, owns nothing, and waiting for it would only pad the
    recovery figure. Returns a note for the report, or None when it was declared."""
    if await _declared_lost(probe, victim):
        return None
    if await _owned_by(probe, victim) == 0:
        return f"{victim} owned no in-flight request while stopped: nothing to declare"
    if await wait_for(lambda: _declared_lost(probe, victim), t.replica_timeout + 10.0) is None:
        return f"{victim} owned in-flight requests and was not declared lost while stopped"
    return None


async def fault_worker_kill(probe: Probe, t: Timing, res: ScenarioResult) -> Callable[
        [], Awaitable[bool]]:
    victim = probe.workers[0]
    changed = await _kill_one(probe, victim, res)

    async def back() -> bool:
        return (await changed() and await _child_ready(probe, victim)
                and await probe.all_see_workers())

    return back


async def fault_cold_start(probe: Probe, t: Timing, res: ScenarioResult) -> Callable[
        [], Awaitable[bool]]:
    leader = await probe.leader()
    if leader is not None:  # cold start *from a snapshot*: make sure a recent one exists
        # A 503 (a write JetStream timed out after an earlier scenario's NATS node loss) is
        # worth another try: the point is to restart from a recent snapshot.
        deadline = time.monotonic() + 30.0
        attempts = 0
        while True:
            attempts += 1
            r = await probe.http.post(probe.c.children[leader].url + "/admin/snapshot",
                                      headers=probe.auth, timeout=60)
            if r.status_code != 503 or time.monotonic() > deadline:
                break
            await asyncio.sleep(1.0)  # pacing between admin retries, not synchronisation
        detail = "" if r.status_code == 200 else f" ({r.text[:200]})"
        res.notes.append(f"snapshot before restart: HTTP {r.status_code} after {attempts} "
                         f"attempt(s){detail}")
    res.victim = "all replicas"
    res.fault_at = res.fault_end = time.monotonic()
    old = {n: probe.c.kill(n, signal.SIGKILL) for n in probe.replicas}
    await _reaped(probe, probe.replicas, res)

    async def back() -> bool:
        for name, pid in old.items():
            if not (await _pid_changed(probe.c, name, pid)() and await _child_ready(probe, name)):
                return False
        return True

    return back


def nats_cluster_of(cluster: LocalCluster) -> Any:
    nats = getattr(cluster, "nats", None) or cluster._nats  # no public accessor yet
    if nats is None or not hasattr(nats, "servers") or len(nats.servers) < 3:
        raise RuntimeError("nats-kill needs LocalCluster(nats_cluster=3)")
    return nats


async def fault_nats_kill(probe: Probe, t: Timing, res: ScenarioResult) -> Callable[
        [], Awaitable[bool]]:
    nats = nats_cluster_of(probe.c)
    # The router stream's leader: killing it forces an election on the hot path.
    info = await probe.js.stream_info(probe.names.stream(ROUTER))
    leader = info.cluster.leader if info.cluster else None
    index = next((i for i, s in enumerate(nats.servers) if s.server_name == leader), 0)
    res.victim = f"{nats.servers[index].server_name} (router stream leader)"
    before = info.state.last_seq
    t0 = res.fault_at = res.fault_end = time.monotonic()
    await asyncio.to_thread(nats.kill, index)
    elected = asyncio.create_task(_new_leader_after(probe, leader, t.recovery_timeout))
    # Resumed: every replica applied router events the *new* leader appended. Read from the
    # replicas (no JetStream API call that would wait out the election); the margin covers
    # appends the old leader acknowledged between reading `before` and the kill.
    margin = 16

    async def applied() -> bool:
        pos = await probe.router_positions()
        return all(p is not None and p > before + margin for p in pos.values())

    if await wait_for(applied, t.recovery_timeout, interval=0.05) is not None:
        res.resume_s = round(time.monotonic() - t0, 2)
    else:
        res.notes.append("replicas did not apply new events while the node was down")
    election = await elected
    if election is not None:
        res.notes.append(f"router stream leader elected after {election:.1f}s (nats-server Raft "
                         "election timeout: 4-9 s); replicas resumed "
                         + ("-" if res.resume_s is None else f"{res.resume_s - election:+.1f}s")
                         + " after it")
    remaining = t.nats_down_s - (time.monotonic() - t0)
    if remaining > 0:
        await asyncio.sleep(remaining)  # keep the node down for the scenario's duration
    await asyncio.to_thread(nats.restart, index, 30.0)

    async def back() -> bool:
        return bool(nats.servers[index].running)

    return back


async def _new_leader_after(probe: Probe, old: str | None, timeout: float) -> float | None:
    """Seconds until the router stream reports a leader other than `old` (polled with short
    API waits by a separate connection's context; None at the deadline)."""
    t0 = time.monotonic()
    js = probe.nc.jetstream(timeout=0.5)

    async def elected() -> bool:
        info = await js.stream_info(probe.names.stream(ROUTER))
        return bool(info.cluster and info.cluster.leader and info.cluster.leader != old)

    got = await wait_for(elected, timeout, interval=0.1)
    return None if got is None else time.monotonic() - t0


FaultTable = dict[str, Callable[[Probe, Timing, ScenarioResult],
                                Awaitable[Callable[[], Awaitable[bool]]]]]
FAULTS: FaultTable = {
    "replica-kill": fault_replica_kill,
    "nats-kill": fault_nats_kill,
    "replica-stop": fault_replica_stop,
    "worker-kill": fault_worker_kill,
    "cold-start": fault_cold_start,
}


# --- one scenario, end to end --------------------------------------------------------------


async def healthy_baseline(probe: Probe, timeout: float) -> bool:
    async def ok() -> bool:
        if not all([await _child_ready(probe, n) for n in probe.c.children]):
            return False
        return await probe.all_see_workers() and await probe.leader() is not None

    return await wait_for(ok, timeout) is not None


async def run_scenario(name: str, probe: Probe, follower: RouterFollower, t: Timing,
                       *, concurrency: int = 4, faults: FaultTable = FAULTS) -> ScenarioResult:
    res = ScenarioResult(name)
    if not await healthy_baseline(probe, t.recovery_timeout):
        res.notes.append("cluster not healthy before the fault")
    # Phantom load left behind by an earlier scenario on the same cluster is not this one's.
    baseline = await probe.active_load()
    if baseline:
        res.notes.append(f"load already charged before the fault (earlier scenario): {baseline}")
    load = LoadDriver(probe.c.router_urls, concurrency=concurrency)
    load.start(probe.http)
    try:
        if await wait_for(lambda: asyncio.sleep(0, load.ok >= t.warmup_requests), 60) is None:
            res.notes.append(f"warm-up: only {load.ok} requests ok")
        t_fault = time.monotonic()
        back = await faults[name](probe, t, res)
        recovered = await wait_for(back, t.recovery_timeout)
        if recovered is not None:
            left = max(t.recovery_timeout - (time.monotonic() - t_fault), 5.0)
            if await until_new_events_applied(probe, left):
                res.recovery_s = round(time.monotonic() - t_fault, 2)
        await asyncio.sleep(t.settle_s)  # steady load after recovery is part of the scenario
    finally:
        await load.stop()
    answered = load.first_answer_after(res.fault_at or t_fault)
    if answered is not None:
        res.serving_gap_s = round(answered - (res.fault_at or t_fault), 2)
    t_stop = time.monotonic()
    bound = t.replica_timeout + t.phantom_slack
    cleared = await wait_for(lambda: _no_load(probe, baseline), bound, interval=0.25)
    res.phantom_cleared_s = None if cleared is None else round(time.monotonic() - t_stop, 2)
    if cleared is None:
        res.phantom_left = await probe.active_load() - baseline
    conv = await wait_for(lambda: _converged(probe), 30.0)
    res.converged = conv is not None
    # A second read may land after one more append (a ReplicaLost, a health change): wait for
    # a read where every replica sits at the streams' ends and agrees.
    res.digests_equal = res.converged and await wait_for(
        lambda: _digests_equal(probe), 30.0) is not None
    res.requests_ok = load.ok
    failed = load.failed
    res.requests_failed = len(failed)
    hit = load.in_flight_during(res.fault_at or t_fault, res.fault_end or t_fault)
    res.in_flight_at_fault = len(hit)
    stray = [s for s in failed if s not in hit]
    res.failed_not_in_flight = len(stray)
    res.failures = summarize_failures(failed)
    res.stream_holes = await probe.holes()
    await follower.caught_up()
    missing = load.ok_request_ids() - follower.routed
    # Degraded mode serves requests whose decisions are deliberately not appended (counted by
    # the replicas); only what goes beyond that count is lost.
    res.acked_routed_missing = len(missing) if len(missing) > res.decisions_not_appended else 0
    if res.acked_routed_missing:
        res.notes.append(f"acknowledged requests without RequestRouted: {sorted(missing)[:3]}")
    res.events_lost = sum(res.stream_holes.values()) + follower.holes + res.acked_routed_missing
    return res


async def _no_load(probe: Probe, baseline: int) -> bool:
    return await probe.active_load() <= baseline


async def _digests_equal(probe: Probe) -> bool:
    return (await probe.converged())[1]


async def _converged(probe: Probe) -> bool:
    at_end, _ = await probe.converged()
    return at_end
