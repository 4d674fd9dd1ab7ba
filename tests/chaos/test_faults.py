"""Worker fault tolerance end to end: canaries fence an engine that answers wrong tokens
on every replica and let it back through the half-open trial; SIGTERM on a replica under load
drains its streams and hands the lease over; with half the engines down and load above capacity,
best_effort requests are shed while premium ones are served.

One cluster for the module (2 replicas, 4 simulated engines, real processes), canaries every
0.5 s. Each test starts from a fleet where every replica is ready, sees four healthy engines and
one leader whose canaries have pinned every engine's answer, and leaves no fault behind.

The fourth required scenario — a hung engine (no tokens) is left after ``--stream-idle-timeout``
and the request migrates — is ``tests/integration/api/test_migration.py::
test_engine_hanging_mid_stream_is_left_after_the_idle_timeout`` (and the migration-limit test
next to it); it is not repeated here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import re
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import nats
import pytest
import pytest_asyncio

from eventlog.events import RequestFinished, WorkerHealthChanged
from eventlog.names import CONTROL, ROUTER, Names
from eventlog.reader import StreamReader
from eventlog.streams import stream_bounds
from launch.local_cluster import LocalCluster
from tests.chaos.conftest import MODEL, until
from tokenization import tokens
from workers.generation import expected_tokens

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(120)]
module_loop = pytest.mark.asyncio(loop_scope="module")

NS = "flt"
REPLICAS = ["r0", "r1"]
WORKERS = ["w0", "w1", "w2", "w3"]
CANARY_INTERVAL = 0.5
RECOVERY = 2.0
# Long enough that "the next leader took over at once" and "the lease had to expire" differ.
LEASE_TTL = 10.0
GPU_BLOCKS = 128  # small caches: a dozen 512-token prompts exceed what two engines offer
BLOCK = 16
WORKER_HEADER = "x-jetrouter-worker"


def expected_text(prompt: list[int], n: int) -> str:
    return tokens.decode(expected_tokens(prompt, n))


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def cluster(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[LocalCluster]:
    data = Path(tmp_path_factory.mktemp("faults"))
    async with LocalCluster(
            replicas=len(REPLICAS), workers=len(WORKERS), data_dir=data, namespace=NS,
            router_args=["--canary-interval", str(CANARY_INTERVAL),
                         "--canary-recovery-timeout", str(RECOVERY), "--canary-timeout", "2",
                         "--lease-ttl", str(LEASE_TTL), "--graceful-shutdown-timeout", "30"],
            worker_args=["--num-gpu-blocks", str(GPU_BLOCKS)]) as c:
        yield c


# --- a view of the cluster ---------------------------------------------------------------------


_SAMPLE = re.compile(r'^(\w+)(?:\{([^}]*)\})? (\S+)$')


def parse_metrics(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """(labels, value) of every sample of metric ``name`` in a Prometheus text page."""
    out = []
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and m.group(1) == name:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            out.append((labels, float(m.group(3))))
    return out


@dataclass
class Fleet:
    c: LocalCluster
    h: httpx.AsyncClient
    auth: dict[str, str] = field(init=False)

    def __post_init__(self) -> None:
        self.auth = {"authorization": f"Bearer {self.c.admin_token}"}

    def url(self, name: str) -> str:
        return self.c.children[name].url

    async def admin(self, name: str, path: str) -> dict[str, Any]:
        r = await self.h.get(self.url(name) + path, headers=self.auth, timeout=10)
        r.raise_for_status()
        return r.json()

    async def workers(self, name: str) -> dict[str, dict[str, Any]]:
        return {w["worker_id"]: w for w in (await self.admin(name, "/admin/workers"))["workers"]}

    async def health(self, name: str) -> dict[str, str]:
        return {w: d["health"] for w, d in (await self.workers(name)).items()}

    async def everywhere(self, worker: str, status: str, timeout: float = 60.0) -> None:
        for name in REPLICAS:
            await until(lambda name=name: self.health(name), lambda s: s.get(worker) == status,
                        timeout, f"{name} sees {worker} {status}")

    async def leader(self) -> str:
        states = {n: await self.admin(n, "/admin/state") for n in REPLICAS}
        leaders = [n for n, s in states.items() if s["leader"]]
        assert len(leaders) == 1, states
        return leaders[0]

    async def metrics(self, name: str, metric: str) -> list[tuple[dict[str, str], float]]:
        return parse_metrics((await self.h.get(self.url(name) + "/metrics")).text, metric)

    async def checks(self, name: str, worker: str) -> dict[str, float]:
        """Canary checks ``name`` has run against ``worker``, by outcome."""
        samples = await self.metrics(name, "jetrouter_health_check_duration_seconds_count")
        return {lb["outcome"]: v for lb, v in samples if lb.get("worker") == worker}

    async def fault(self, worker: str, **body: Any) -> None:
        r = await self.h.post(self.url(worker) + "/fault", json=body, timeout=10)
        assert r.status_code == 200, r.text

    async def complete(self, name: str, prompt: list[int], max_tokens: int,
                       headers: dict[str, str] | None = None, **extra: Any) -> httpx.Response:
        return await self.h.post(self.url(name) + "/v1/completions", headers=headers or {},
                                 json={"model": MODEL, "prompt": prompt,
                                       "max_tokens": max_tokens, **extra}, timeout=60)


async def settled(f: Fleet) -> None:
    """Every replica ready with four healthy engines, one leader, and the leader's canaries past
    their first passing check of every engine (so each engine's right answer is pinned)."""
    await f.c.wait_ready(timeout=60)
    for name in REPLICAS:
        await until(lambda name=name: f.health(name),
                    lambda s: s == {w: "healthy" for w in WORKERS}, 60, f"{name}: all healthy")
    leader = await until(f.leader, lambda _: True, 30, "one leader")
    assert isinstance(leader, str)
    await until(lambda: asyncio.gather(*(f.checks(leader, w) for w in WORKERS)),
                lambda per: all(c.get("ok", 0) >= 1 for c in per), 30, "canaries pinned")


@pytest_asyncio.fixture(loop_scope="module")
async def fleet(cluster: LocalCluster) -> AsyncIterator[Fleet]:
    async with httpx.AsyncClient() as h:
        f = Fleet(cluster, h)
        await settled(f)
        try:
            yield f
        finally:
            for w in WORKERS:  # no fault outlives its test
                with contextlib.suppress(httpx.HTTPError, AssertionError):
                    await f.fault(w, action="clear")


async def control_events(c: LocalCluster) -> list[WorkerHealthChanged]:
    nc = await nats.connect(c.nats_url)
    try:
        js = nc.jetstream()
        stream = Names(NS).stream(CONTROL)
        first, last = await stream_bounds(js, stream)
        out: list[WorkerHealthChanged] = []
        if last == 0:
            return out
        async with StreamReader(js, stream, start_seq=max(first, 1)) as reader:
            async for seq, batch in reader:
                out.extend(e for e in batch if isinstance(e, WorkerHealthChanged))
                if seq >= last:
                    break
        return out
    finally:
        await nc.close()


async def finished_outcomes(c: LocalCluster, request_ids: set[str]) -> dict[str, str]:
    nc = await nats.connect(c.nats_url)
    try:
        js = nc.jetstream()
        stream = Names(NS).stream(ROUTER)
        first, last = await stream_bounds(js, stream)
        out: dict[str, str] = {}
        async with StreamReader(js, stream, start_seq=max(first, 1)) as reader:
            async for seq, batch in reader:
                out.update((e.request_id, e.outcome) for e in batch
                           if isinstance(e, RequestFinished) and e.request_id in request_ids)
                if seq >= last:
                    break
        return out
    finally:
        await nc.close()


@dataclass
class HeldStream:
    """One streaming completion read in the background."""

    prompt: list[int]
    max_tokens: int
    text: str = ""
    status: int | None = None
    request_id: str | None = None
    worker: str | None = None
    first_token: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None

    async def run(self, h: httpx.AsyncClient, url: str, headers: dict[str, str]) -> None:
        body = {"model": MODEL, "prompt": self.prompt, "max_tokens": self.max_tokens,
                "stream": True}
        try:
            async with h.stream("POST", url + "/v1/completions", json=body, headers=headers,
                                timeout=60) as r:
                self.status = r.status_code
                self.request_id = r.headers.get("x-jetrouter-request-id")
                self.worker = r.headers.get(WORKER_HEADER)
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    doc = json.loads(line[6:])
                    if "error" in doc:
                        self.text += f"<error: {doc['error']}>"
                        continue
                    for choice in doc.get("choices", []):
                        self.text += choice.get("text", "")
                    if self.text:
                        self.first_token.set()
        finally:
            self.first_token.set()  # never leave a waiter hanging on a failed stream

    def start(self, h: httpx.AsyncClient, url: str, headers: dict[str, str] | None = None
              ) -> HeldStream:
        self.task = asyncio.create_task(self.run(h, url, headers or {}))
        return self

    @property
    def expected(self) -> str:
        return expected_text(self.prompt, self.max_tokens)


@contextlib.asynccontextmanager
async def streaming_client() -> AsyncIterator[httpx.AsyncClient]:
    """A client for held streams; on the way out (a failed assert) their readers are cancelled
    before the client closes, so nothing is left reading a closed connection."""
    async with httpx.AsyncClient() as h:
        before = asyncio.all_tasks()
        try:
            yield h
        finally:
            mine = [t for t in asyncio.all_tasks() - before if not t.done()]
            for t in mine:
                t.cancel()
            await asyncio.gather(*mine, return_exceptions=True)


# --- wrong output: canaries fence the engine everywhere, the half-open trial lets it back -----


@module_loop
async def test_wrong_output_engine_is_fenced_on_every_replica_then_used_again(
        fleet: Fleet) -> None:
    f = fleet
    prefix = [20_000 + i for i in range(BLOCK * 8)]
    r = await f.complete("r0", [*prefix, 1], 2)
    assert r.status_code == 200, r.text
    home = r.headers[WORKER_HEADER]  # KV overlap pulls every later request with `prefix` here
    for name in REPLICAS:
        await until(lambda name=name: f.workers(name), lambda ws: ws[home]["cached_blocks"] >= 8,
                    20, f"{name} knows {home} caches the prefix")
    leader = await f.leader()
    before = await f.checks(leader, home)
    fault_wall, t0 = time.time(), time.monotonic()
    await f.fault(home, action="wrong_output")
    await f.everywhere(home, "unhealthy")
    detected_s = time.monotonic() - t0
    after = await f.checks(leader, home)
    # Detection in canary rounds: at most one round that was already in flight passed, and the
    # next one failed the first check and both retries (3 failures open the breaker).
    assert after.get("ok", 0) - before.get("ok", 0) <= 1, (before, after)
    assert after.get("mismatch", 0) - before.get("mismatch", 0) >= 3, (before, after)
    print(f"\n{home} fenced on every replica {detected_s:.2f} s after the fault "
          f"(canary interval {CANARY_INTERVAL} s)")

    # No new request reaches it through any replica: neither prompts that share its cached
    # prefix (it would win on KV overlap) nor fresh ones.
    seen: dict[str, set[str]] = {}
    for name in REPLICAS:
        for k in range(8):
            prompt = [*prefix, 100 + k] if k % 2 == 0 else [40_000 + 97 * k + i for i in range(48)]
            r = await f.complete(name, prompt, 4)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == expected_text(prompt, 4)
            seen.setdefault(name, set()).add(r.headers[WORKER_HEADER])
    assert all(home not in ws for ws in seen.values()), seen

    await f.fault(home, action="clear")
    await f.everywhere(home, "healthy")
    events = [e for e in await control_events(f.c)
              if e.worker_id == home and e.ts >= fault_wall - 1]
    assert [e.status for e in events] == ["suspicious", "unhealthy", "healthy"], events
    assert "mismatch" in events[1].reason
    assert "half-open trial passed" in events[2].reason
    assert events[2].ts - events[1].ts >= RECOVERY  # the breaker stayed open its full timeout
    breaker = {lb["worker"]: v for lb, v in
               await f.metrics(await f.leader(), "jetrouter_circuit_breaker_state")}
    assert breaker[home] == 0, breaker  # closed

    # And it is used again, from every replica.
    for name in REPLICAS:
        async def lands_home(name: str = name) -> set[str]:
            got = set()
            for k in range(6):
                prompt = [60_000 + 1000 * len(REPLICAS) * k + i for i in range(48)]
                r = await f.complete(name, [*prompt, hash(name) % 200], 2)
                assert r.status_code == 200, r.text
                got.add(r.headers[WORKER_HEADER])
            return got

        await until(lands_home, lambda ws: home in ws, 20, f"{name} routes to {home} again")


# --- SIGTERM on a replica under load ---------------------------------------------------------


@module_loop
async def test_sigterm_on_a_replica_under_load_drains_its_streams_and_releases_the_lease(
        fleet: Fleet) -> None:
    f = fleet
    victim = await f.leader()  # the leader: its lease must move on at once
    other = next(n for n in REPLICAS if n != victim)
    child = f.c.children[victim]
    exits_before = child.exits
    max_tokens = 300  # ~8 ms a token: seconds of streaming left when the signal lands
    held = [HeldStream([30_000 + 1000 * k + i for i in range(40)], max_tokens)
            for k in range(6)]
    async with streaming_client() as streams, httpx.AsyncClient() as probes:
        for s in held:
            s.start(streams, f.url(victim))
        await asyncio.wait_for(asyncio.gather(*(s.first_token.wait() for s in held)), 20)
        at_signal = [len(s.text) for s in held]
        assert all(s.status == 200 for s in held), [s.status for s in held]
        f.c.kill(victim, signal.SIGTERM)

        async def ready_status() -> int:
            return (await probes.get(f.url(victim) + "/ready", timeout=2)).status_code

        # Still listening while its streams run: not ready (503), alive to a balancer (404),
        # so HAProxy drains it instead of marking it down and cutting the streams.
        await until(ready_status, lambda s: s == 503, 2, f"{victim} /ready 503 after SIGTERM")
        balancer = await probes.get(f.url(victim) + "/ready/balancer", timeout=2)
        assert balancer.status_code == 404 and balancer.json()["draining"] is True, balancer.text
        r = await probes.post(f.url(victim) + "/v1/completions", timeout=5,
                              json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2})
        assert r.status_code == 503, r.text
        assert r.headers.get("retry-after"), r.headers
        assert all(not s.task.done() for s in held if s.task), "streams were still in flight"

        await asyncio.wait_for(asyncio.gather(*(s.task for s in held if s.task)), 60)
    for s, n in zip(held, at_signal, strict=True):
        assert n < max_tokens, "the stream was mid-way when the signal landed"
        assert s.text == s.expected, (s.request_id, len(s.text), s.text[-80:])

    await until(lambda: asyncio.sleep(0, child.exits), lambda n: n > exits_before, 30,
                f"{victim} exited")
    exited = time.monotonic()
    # (Its exit status is -SIGTERM either way: uvicorn re-raises the signal it caught once its
    # graceful shutdown is over, so the status cannot tell a drain from a kill. The finished
    # streams above and the lease hand-over below do.)

    async def leads() -> bool:
        return bool((await f.admin(other, "/admin/state"))["leader"])

    await until(leads, bool, LEASE_TTL, f"{other} takes the lease")
    handover_s = time.monotonic() - exited
    print(f"\nlease moved {victim} -> {other} {handover_s:.2f} s after {victim} exited "
          f"(lease TTL {LEASE_TTL} s)")
    assert handover_s < LEASE_TTL / 2, "released, not left to expire"

    # The drained replica closed its requests in the log itself (no ReplicaLost needed).
    ids = {s.request_id for s in held if s.request_id}
    assert len(ids) == len(held)
    outcomes = await until(lambda: finished_outcomes(f.c, ids), lambda o: len(o) == len(ids),
                           20, "RequestFinished for every drained request")
    assert set(outcomes.values()) == {"ok"}, outcomes
    await f.c.wait_ready([victim], timeout=60)  # the cluster restarts it


# --- half the engines down, load above capacity: shed best_effort, serve premium -------------


def demand_blocks(workers: dict[str, dict[str, Any]]) -> int:
    return sum(w["active_decode_blocks"] + math.ceil(w["active_prefill_tokens"] / BLOCK)
               for w in workers.values())


@module_loop
async def test_half_the_engines_down_and_overloaded_sheds_best_effort_serves_premium(
        fleet: Fleet) -> None:
    f = fleet
    down, up = ["w2", "w3"], ["w0", "w1"]
    r = await f.complete("r0", [5, 6, 7], 2, headers={"x-priority": "best_effort"})
    assert r.status_code == 200, r.text  # a healthy, idle fleet serves every tier

    for w in down:  # "down" as the router knows it: canaries mark them UNHEALTHY
        await f.fault(w, action="wrong_output")
    for w in down:
        await f.everywhere(w, "unhealthy")
    ws = await f.workers("r0")
    capacity = sum(ws[w]["kv_total_blocks"] for w in up)

    # Premium load that needs more than the two healthy engines hold: 12 distinct 512-token
    # prompts (32 blocks each, 64 until their first token) against 2 x 128 blocks.
    held = [HeldStream([50_000 + 1000 * k + i for i in range(512)], 300) for k in range(12)]
    async with streaming_client() as streams:
        for s in held:
            s.start(streams, f.url("r0"), {"x-priority": "premium"})
        for name in REPLICAS:  # load is replicated: every replica sees the same pressure
            await until(lambda name=name: f.workers(name),
                        lambda ws: demand_blocks(ws) * 0.75 > capacity, 20,
                        f"{name} sees demand above healthy capacity")

        # Every best_effort probe comes first, while the pressure is known to be there: a shed
        # never reaches an engine, so these take milliseconds, and no held stream can finish
        # before its 300 decode steps. The premium probes must wait: the engines' KV caches are
        # full and their queues first come, first served, so a premium probe is answered only
        # once held streams finish — lowering demand below the shedding level (on a busy machine
        # before the next replica was probed), while the canaries stuck in the same queues may
        # or may not have halved the engines' weight by then.
        for name in REPLICAS:
            for how in ("header", "hint"):
                ws = await f.workers(name)  # the condition the shed relies on, right before it
                assert demand_blocks(ws) * 0.75 > capacity, (name, how, demand_blocks(ws))
                shed = await tiered(f, name, "best_effort", how)
                assert shed.status_code == 503, (name, how, shed.text)
                assert int(shed.headers["retry-after"]) >= 1, shed.headers
                assert shed.json()["code"] == 503  # the seed's busy body
        # Premium is admitted at the level that sheds best_effort (the level only falls after a
        # cool-down), all at once so none is admitted late, then served by a healthy engine.
        probes = [(name, how) for name in REPLICAS for how in ("header", "hint")]
        answers = await asyncio.gather(*(tiered(f, name, "premium", how)
                                         for name, how in probes))
        for (name, how), served in zip(probes, answers, strict=True):
            assert served.status_code == 200, (name, how, served.text)
            assert served.headers[WORKER_HEADER] in up
            assert served.json()["choices"][0]["text"] == expected_text(PROBE, 4)
        for name in REPLICAS:
            level = await f.metrics(name, "jetrouter_degradation_level")
            assert level and 2 <= level[0][1] <= 3, level  # premium is only shed at level 4

        await asyncio.wait_for(asyncio.gather(*(s.task for s in held if s.task)), 60)
    assert all(s.status == 200 and s.worker in up for s in held), \
        [(s.status, s.worker) for s in held]
    assert all(s.text == s.expected for s in held)


PROBE = [7, 7, 7, 1]


async def tiered(f: Fleet, name: str, tier: str, how: str) -> httpx.Response:
    """One small request of ``tier``, by the ``x-priority`` header or ``nvext.agent_hints``."""
    if how == "header":
        return await f.complete(name, PROBE, 4, headers={"x-priority": tier})
    return await f.complete(name, PROBE, 4, nvext={"agent_hints": {"priority": tier}})


# --- the fault bench's bookkeeping (pure: no processes) --------------------------------------


def test_fault_bench_counts_a_request_caught_in_flight_in_the_fault_window() -> None:
    from bench.faults import Phase, Sample, format_table, split, window_stats

    phase = Phase("wrong", "w1", base_start=100.0, fault_start=110.0, fault_end=120.0)
    samples = [
        Sample(0, 101.0, ended=101.3, ttft=0.02, e2e=0.3, outcome="ok"),
        Sample(1, 109.9, ended=110.2, ttft=0.02, e2e=0.3, outcome="wrong", error="wrong tokens"),
        Sample(2, 111.0, ended=111.4, ttft=0.05, e2e=0.4, outcome="ok", retried=True),
        Sample(3, 112.0, ended=112.1, outcome="failed", error="ReadError"),
        Sample(4, 121.0, ended=121.3, ttft=0.02, e2e=0.3, outcome="ok"),  # after: recovery
        Sample(5, 99.0, ended=99.3, ttft=0.02, e2e=0.3, outcome="ok"),    # before the phase
    ]
    base, fault = split(samples, phase)
    assert [s.index for s in base] == [0]
    assert [s.index for s in fault] == [1, 2, 3]
    stats = window_stats(fault)
    assert (stats.requests, stats.ok, stats.wrong, stats.failed, stats.retried) == (3, 1, 1, 1, 1)
    assert stats.errors == {"wrong tokens": 1, "ReadError": 1}
    assert stats.e2e_p50 == pytest.approx(0.35)  # answered requests only (wrong ones answered)
    table = format_table([(phase, window_stats(base), stats)])
    assert "engine wrong output" in table and "300 -> 350 (+50)" in table
