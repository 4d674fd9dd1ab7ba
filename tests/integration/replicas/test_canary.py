"""Canary health checks against real simulated workers (child processes, real HTTP), and passive
reports over a real nats-server. Detection is counted in canary rounds, not seconds."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
import pytest
from nats.aio.client import Client as NATS

from eventlog import events as ev
from eventlog.names import KV, Names
from natsops.server import NatsServer
from replicas.core.health import (
    BreakerState,
    HealthBoard,
    HealthConfig,
    HealthStatus,
)
from replicas.core.state import RouterState
from replicas.runtime.canary import CanaryChecker, report_passive
from tests.port_stub import PortIdentity
from workers.procs import WorkerProcess

pytestmark = pytest.mark.timeout(60)
MODEL = "canary-sim"
INTERVAL = 0.3
RECOVERY = 1.0


@pytest.fixture(scope="module")
def workers() -> Iterator[dict[str, WorkerProcess]]:
    procs = {f"w{i}": WorkerProcess(["--worker-id", f"w{i}", "--model", MODEL, "--nats-url", ""])
             for i in range(3)}
    try:
        with ThreadPoolExecutor(len(procs)) as pool:  # start-up is mostly imports: overlap them
            list(pool.map(lambda p: p.start(), procs.values()))
        yield procs
    finally:
        for p in procs.values():
            p.kill()
            p.log_path.unlink(missing_ok=True)


@pytest.fixture
async def urls(workers: dict[str, WorkerProcess]) -> AsyncIterator[dict[str, str]]:
    urls = {w: p.url for w, p in workers.items()}
    yield urls
    async with httpx.AsyncClient() as h:  # leave every worker fault-free for the next test
        for url in urls.values():
            await h.post(f"{url}/fault", json={"action": "clear"})


class Port(PortIdentity):
    """The replica port the checker sees: a RouterState with the simulated workers registered,
    leadership from the test, and the control-stream appends recorded (the checker's output)."""

    def __init__(self, urls: Mapping[str, str], leader: Callable[[], bool],
                 statuses: Mapping[str, str], names: Names) -> None:
        self.rid, self.port_names = "r1", names
        self.state = RouterState()
        self.state.apply(KV, 1, [ev.WorkerRegistered(w, url, MODEL, self.state.config.block_size,
                                                     1000, 8192, 1.0)
                                 for w, url in urls.items()])
        self.state.health.update(statuses)  # what the control stream says before we lead
        self.leads = leader
        self.appended: list[tuple[str, ev.Event, str | None]] = []
        self.on_append: Callable[[ev.Event], None] = lambda _: None

    @property
    def is_leader(self) -> bool:  # asked of the test at each round: leadership changes
        return self.leads()

    async def append(self, subject: str, event: ev.Event, msg_id: str | None) -> int:
        self.appended.append((subject, event, msg_id))
        self.on_append(event)
        return len(self.appended)

    async def wait_ready(self, timeout: float | None = None) -> None:
        return None

    async def wait_applied(self, kind: str, seq: int, timeout: float = 10.0) -> None:
        return None


@dataclass
class Harness:
    checker: CanaryChecker
    # (round, change) for every WorkerHealthChanged the checker appended
    changes: list[tuple[int, ev.WorkerHealthChanged]] = field(default_factory=list)

    def of(self, worker_id: str) -> list[ev.WorkerHealthChanged]:
        return [c for _, c in self.changes if c.worker_id == worker_id]

    def reached(self, worker_id: str, status: str) -> tuple[int, ev.WorkerHealthChanged] | None:
        return next(((r, c) for r, c in self.changes
                     if c.worker_id == worker_id and c.status == status), None)


@contextlib.asynccontextmanager
async def running(urls: Mapping[str, str], *, timeout: float = 2.0,
                  leader: Callable[[], bool] = lambda: True,
                  statuses: Mapping[str, str] | None = None,
                  nc: NATS | None = None, names: Names | None = None,
                  ) -> AsyncIterator[Harness]:
    board = HealthBoard(HealthConfig(recovery_timeout=RECOVERY))
    port = Port(urls, leader, statuses or {}, names or Names())
    async with httpx.AsyncClient() as client:
        checker = CanaryChecker(client, board, port, interval=INTERVAL, timeout=timeout, nc=nc)
        harness = Harness(checker)

        def record(event: ev.Event) -> None:
            assert isinstance(event, ev.WorkerHealthChanged)
            harness.changes.append((checker.rounds, event))

        port.on_append = record
        await checker.start()
        try:
            yield harness
        finally:
            await checker.stop()


async def until(cond: Callable[[], object], timeout: float = 60.0) -> object:
    """Poll ``cond`` until it returns something truthy; fail at the deadline."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        await asyncio.sleep(0.02)
    raise AssertionError(f"condition not met within {timeout}s")


async def fault(url: str, **body: object) -> None:
    async with httpx.AsyncClient() as h:
        r = await h.post(f"{url}/fault", json=body)
        r.raise_for_status()


async def settled(h: Harness, rounds: int) -> None:
    """Every worker has its reference answer pinned and a latency baseline."""
    refs, board = h.checker.references, h.checker.board
    await until(lambda: h.checker.rounds >= rounds
                and all(refs.pinned(w) and board.worker(w).baseline for w in ("w0", "w1", "w2")))


async def test_wrong_output_is_unhealthy_within_two_rounds_and_recovers_half_open(
        urls: dict[str, str]) -> None:
    async with running(urls) as h:
        await settled(h, rounds=2)
        assert h.checker.references.majority(MODEL) is not None
        r0 = h.checker.rounds
        await fault(urls["w1"], action="wrong_output")
        round_, change = await until(lambda: h.reached("w1", HealthStatus.UNHEALTHY))  # type: ignore[misc]
        # Round r0 may have been in flight when the fault landed; round r0 + 1 must see it.
        assert round_ <= r0 + 1, (round_, r0)
        assert [c.status for c in h.of("w1")] == [HealthStatus.SUSPICIOUS, HealthStatus.UNHEALTHY]
        assert "mismatch" in change.reason
        assert all(c.status != HealthStatus.UNHEALTHY for _, c in h.changes if c.worker_id != "w1")

        await fault(urls["w1"], action="clear")
        _, healed = await until(lambda: h.reached("w1", HealthStatus.HEALTHY))  # type: ignore[misc]
        assert "half-open trial passed" in healed.reason
        assert healed.ts - change.ts >= RECOVERY
        assert h.checker.board.breaker_state("w1") == BreakerState.CLOSED


async def test_slow_worker_becomes_suspicious_not_unhealthy(urls: dict[str, str]) -> None:
    async with running(urls) as h:
        await settled(h, rounds=4)  # a few samples past the cold first request
        await fault(urls["w2"], action="slow", factor=10)
        _, change = await until(lambda: h.reached("w2", HealthStatus.SUSPICIOUS))  # type: ignore[misc]
        assert change.reason.startswith("slow")
        r1 = h.checker.rounds
        await until(lambda: h.checker.rounds >= r1 + 3)  # it stays slow for three more rounds
        assert h.reached("w2", HealthStatus.UNHEALTHY) is None
        assert h.checker.board.breaker_state("w2") == BreakerState.CLOSED

        await fault(urls["w2"], action="clear")
        await until(lambda: h.reached("w2", HealthStatus.HEALTHY))


async def test_hung_worker_times_out_and_becomes_unhealthy(urls: dict[str, str]) -> None:
    async with running(urls, timeout=0.5) as h:
        await settled(h, rounds=1)
        await fault(urls["w0"], action="hang")
        _, change = await until(lambda: h.reached("w0", HealthStatus.UNHEALTHY))  # type: ignore[misc]
        assert "timeout" in change.reason
        await fault(urls["w0"], action="clear")
        await until(lambda: h.reached("w0", HealthStatus.HEALTHY))


async def test_a_slow_worker_still_generating_is_busy_not_failed_by_a_timeout(
        urls: dict[str, str]) -> None:
    """Steps 20x slower: the canary's 8 tokens take longer than the timeout, but the engine's
    generation counter moves meanwhile, so the timeouts are not failures (a hung engine's
    counter stands still: the test above)."""
    async with running(urls, timeout=1.0) as h:
        await settled(h, rounds=1)
        await fault(urls["w1"], action="slow", factor=20)
        await until(lambda: h.checker.busy >= 3)
        assert h.reached("w1", HealthStatus.UNHEALTHY) is None
        assert h.checker.board.breaker_state("w1") == BreakerState.CLOSED
        await fault(urls["w1"], action="clear")


async def test_passive_reports_count_only_on_the_leader_and_new_leader_adopts_the_log(
        urls: dict[str, str], nats_server: NatsServer,
        nats_connect: Callable[[str], Awaitable[NATS]]) -> None:
    names = Names("hc")
    nc = await nats_connect(nats_server.url)
    leading = False
    # What the control stream says before this replica leads.
    replicated = {"w2": HealthStatus.UNHEALTHY}
    async with running(urls, leader=lambda: leading, statuses=replicated,
                       nc=nc, names=names) as h:
        for _ in range(3):
            await report_passive(nc, names, "w1", "connection reset")
        await until(lambda: h.checker.reports >= 3 and h.checker.ticks >= 2)
        assert h.checker.rounds == 0 and h.changes == []  # a follower neither checks nor judges
        assert h.checker.board.status("w1") == HealthStatus.HEALTHY

        leading = True
        await until(lambda: h.checker.rounds >= 1)
        assert h.checker.board.status("w2") == HealthStatus.UNHEALTHY  # adopted, not re-announced
        assert h.reached("w2", HealthStatus.UNHEALTHY) is None

        await nc.publish(names.health_report_subject, b"not json")
        await report_passive(nc, names, "ghost", "refused")  # not a registered worker
        for _ in range(3):
            await report_passive(nc, names, "w1", "connection reset")
        _, change = await until(lambda: h.reached("w1", HealthStatus.UNHEALTHY))  # type: ignore[misc]
        assert change.reason == "passive: connection reset"
        assert "ghost" not in h.checker.board.workers()
        # Both recover through their half-open trial canary.
        await until(lambda: h.reached("w1", HealthStatus.HEALTHY)
                    and h.reached("w2", HealthStatus.HEALTHY))
