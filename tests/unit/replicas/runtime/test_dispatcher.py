"""The request dispatcher on its own, behind a port with a real RouterState and a recording
appender (no NATS): decide → count in the overlay → submit the append; the stream reconciles; a
refused append is a `DecisionNotRecorded` from `recorded`, never counted; an append neither
acknowledged nor refused within the grace is served and lands later, exactly once."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from eventlog import events as ev
from eventlog.appender import AppendFailed
from eventlog.names import KV, ROUTER, Names
from replicas.core.routing_errors import NoWorkers
from replicas.core.state import RouterState, StateConfig
from replicas.runtime.background import Background
from replicas.runtime.config import ReplicaConfig
from replicas.runtime.decision_log import DecisionNotRecorded
from replicas.runtime.dispatcher import Dispatcher, RouteRequest
from tests.waiting import until

pytestmark = pytest.mark.timeout(10)
BS = 16
TOKENS = list(range(700, 700 + 4 * BS))


class Port:
    def __init__(self) -> None:
        self.state = RouterState(StateConfig(block_size=BS))
        self.appended: list[tuple[str, ev.Event, str | None]] = []
        self.refuse = False

    @property
    def replica_id(self) -> str:
        return "r1"

    @property
    def names(self) -> Names:
        return Names("jr")

    @property
    def ready(self) -> bool:
        return True

    @property
    def is_leader(self) -> bool:
        return False

    async def append(self, subject: str, event: ev.Event, msg_id: str | None) -> int:
        if self.refuse:
            raise AppendFailed(subject, msg_id or "", RuntimeError("maximum bytes exceeded"))
        self.appended.append((subject, event, msg_id))
        return len(self.appended)

    def append_later(self, subject: str, event: ev.Event) -> None:
        self.appended.append((subject, event, None))

    def submit(self, subject: str, events: list[ev.Event],
               msg_id: str) -> asyncio.Future[int]:
        return asyncio.ensure_future(
            self.append(subject, events[0] if len(events) == 1 else events, msg_id))

    async def wait_ready(self, timeout: float | None = None) -> None:
        return None

    async def wait_applied(self, kind: str, seq: int, timeout: float = 10.0) -> None:
        return None


def _dispatcher(port: Port, **flags: float) -> tuple[Dispatcher, Background]:
    bg = Background()
    cfg = ReplicaConfig("r1", "", state=StateConfig(block_size=BS), seed=1, **flags)
    return Dispatcher(port, cfg, random.Random(1), bg), bg


async def test_a_decision_counts_at_once_and_until_the_stream_has_it() -> None:
    port = Port()
    port.state.apply(KV, 1, [ev.WorkerRegistered("w", "http://w", "m", BS, 1000, 8192, 1.0)])
    d, _ = _dispatcher(port)
    routed = await d.route(RouteRequest("q1", "m", TOKENS))
    assert (routed.worker_id, routed.worker_url, routed.total_blocks) == ("w", "http://w", 4)
    await d.recorded(routed)
    assert "record" in routed.timings
    subject, event, msg_id = port.appended[-1]
    assert subject == "jr.router.r1" and msg_id == "q1.routed" and event == routed.event
    assert d.pending_decisions() == 1
    assert d.overlay.prefill_tokens(("w", 0)) == len(TOKENS)
    assert d.overlay.decode_blocks(("w", 0)) == 4
    # The stream hands the decision back (the replica reconciles on applying it): the state
    # counts it now, the overlay no longer, so it is counted exactly once.
    port.state.apply(ROUTER, 1, [routed.event])
    d.overlay.reconcile("q1")
    assert d.pending_decisions() == 0 and d.overlay.prefill_tokens(("w", 0)) == 0
    assert port.state.load.active_prefill_tokens(("w", 0)) == len(TOKENS)


async def test_a_refused_decision_is_not_counted_and_is_closed_as_not_routed() -> None:
    port = Port()
    port.state.apply(KV, 1, [ev.WorkerRegistered("w", "http://w", "m", BS, 1000, 8192, 1.0)])
    d, _ = _dispatcher(port)
    refused: list[str] = []
    d.on_decision_refused = refused.append
    port.refuse = True
    routed = await d.route(RouteRequest("q1", "m", TOKENS))
    assert d.pending_decisions() == 1  # counted until JetStream answers
    with pytest.raises(DecisionNotRecorded, match="maximum bytes exceeded"):
        await d.recorded(routed)
    assert d.pending_decisions() == 0 and d.overlay.prefill_tokens(("w", 0)) == 0
    assert refused == ["refused"] and d.decision_log.failures == 1
    assert port.appended == []
    # Its owner (the forwarder) ends it: the not_routed finish follows on the same subject.
    port.refuse = False
    d.finished("q1", "not_routed", 0)
    (_, finish, _), = port.appended
    assert isinstance(finish, ev.RequestFinished) and finish.outcome == "not_routed"
    await d.recorded(await d.route(RouteRequest("q2", "m", TOKENS)))  # the failure run ends
    assert d.decision_log.last_failure_at is None


class SlowPort(Port):
    """Holds every RequestRouted append until the test opens the gate (an election)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()

    async def append(self, subject: str, event: ev.Event | list[ev.Event],
                     msg_id: str | None) -> int:
        if isinstance(event, ev.RequestRouted):
            await self.gate.wait()
        return await super().append(subject, event, msg_id)  # type: ignore[arg-type]


async def test_a_slow_decision_is_served_after_the_grace_and_lands_once_later() -> None:
    port = SlowPort()
    port.state.apply(KV, 1, [ev.WorkerRegistered("w", "http://w", "m", BS, 1000, 8192, 1.0)])
    d, _ = _dispatcher(port, decision_record_grace=0.05, decision_append_timeout=60.0)
    first = await d.route(RouteRequest("q1", "m", TOKENS))
    await d.recorded(first)  # returns past the grace: served, the append still waiting
    health = d.decision_log
    assert health.served_unrecorded == 1 and health.unrecorded_since is not None
    assert health.view(0.0)["ok"] is True  # not refusing: /ready stays up
    # In the spell a later decision does not wait the grace again (it queues behind).
    await d.recorded(await d.route(RouteRequest("q2", "m", TOKENS)))
    assert health.served_unrecorded == 2 and port.appended == []
    assert d.pending_decisions() == 2  # still counted here until the stream has them
    port.gate.set()  # the election is over: each lands, once
    await until(lambda: health.recorded_late, lambda n: n == 2)
    # (this stand-in port keeps no order; the group commit does: tests/integration)
    assert sorted((e.request_id, mid) for _, e, mid in port.appended) == [("q1", "q1.routed"),
                                                                          ("q2", "q2.routed")]
    assert health.unrecorded_since is None and health.lost == 0 and health.failures == 0


async def test_strict_mode_refuses_a_decision_not_acknowledged_in_time() -> None:
    port = SlowPort()
    port.state.apply(KV, 1, [ev.WorkerRegistered("w", "http://w", "m", BS, 1000, 8192, 1.0)])
    d, _ = _dispatcher(port, decision_record_grace=0.0, decision_append_timeout=0.05)
    routed = await d.route(RouteRequest("q1", "m", TOKENS))
    with pytest.raises(DecisionNotRecorded, match="in time"):
        await d.recorded(routed)
    assert d.pending_decisions() == 0 and d.decision_log.served_unrecorded == 0
    port.gate.set()
    await until(lambda: port.appended, lambda a: len(a) == 1)  # landed late: the finish closes it


async def test_a_spell_longer_than_the_timeout_is_degraded_mode_not_refusals() -> None:
    """JetStream silent for longer than an election can last: requests keep being served; new
    decisions are counted here only and nothing of them is appended; the log answering again
    ends degraded mode."""
    port = SlowPort()
    port.state.apply(KV, 1, [ev.WorkerRegistered("w", "http://w", "m", BS, 1000, 8192, 1.0)])
    d, _ = _dispatcher(port, decision_record_grace=0.02, decision_append_timeout=0.1)
    await d.recorded(await d.route(RouteRequest("q1", "m", TOKENS)))  # served: the spell starts
    spell = d.decision_log.unrecorded_since
    assert spell is not None
    await until(time.monotonic, lambda now: now - spell > 0.1)
    await d.recorded(await d.route(RouteRequest("q2", "m", TOKENS)))  # served, not refused
    assert d.outage.degraded(time.monotonic())
    assert d.decision_log.failures == 0 and d.decision_log.served_unrecorded == 2
    q3 = await d.route(RouteRequest("q3", "m", TOKENS))
    assert q3.record is None  # not submitted: nothing to wait for
    await d.recorded(q3)
    assert d.outage.not_appended == 1 and d.pending_decisions() == 3  # its load counts here
    d.finished("q3", "ok", 5)
    assert d.pending_decisions() == 2 and d.outage.followups_skipped == 1
    port.gate.set()  # the log is back: what was submitted before lands, once
    await until(lambda: d.decision_log.recorded_late, lambda n: n == 2)
    assert {e.request_id for _, e, _ in port.appended} == {"q1", "q2"}  # nothing of q3
    d.outage.log_answered(time.monotonic())
    assert not d.outage.degraded(time.monotonic()) and d.outage.last_outage_s is not None
    assert d.decision_log.unrecorded_since is None


async def test_strict_mode_in_degraded_mode_refuses_at_once_and_appends_nothing() -> None:
    port = Port()
    port.state.apply(KV, 1, [ev.WorkerRegistered("w", "http://w", "m", BS, 1000, 8192, 1.0)])
    d, bg = _dispatcher(port, decision_record_grace=0.0, decision_append_timeout=60.0)
    d.outage.connection_lost(time.monotonic() - 60.0)  # every NATS server gone for a minute
    routed = await d.route(RouteRequest("q1", "m", TOKENS))
    with pytest.raises(DecisionNotRecorded, match="unavailable"):
        await asyncio.wait_for(d.recorded(routed), 1.0)  # no waiting on the append
    assert d.pending_decisions() == 0 and d.outage.not_appended == 0
    d.finished("q1", "not_routed", 0)
    await bg.wait(timeout=5)
    assert port.appended == []


async def test_finishing_first_reconciles_and_appends_the_finish() -> None:
    port = Port()
    port.state.apply(KV, 1, [ev.WorkerRegistered("w", "http://w", "m", BS, 1000, 8192, 1.0)])
    d, bg = _dispatcher(port)
    await d.recorded(await d.route(RouteRequest("q1", "m", TOKENS)))
    d.finished("q1", "ok", 12)
    assert d.pending_decisions() == 0
    await bg.wait(timeout=5)
    assert [type(e).__name__ for _, e, _ in port.appended] == ["RequestRouted",
                                                               "RequestFinished"]


async def test_no_workers_is_refused_before_anything_is_appended() -> None:
    port = Port()
    d, _ = _dispatcher(port)
    with pytest.raises(NoWorkers):
        await d.route(RouteRequest("q1", "m", TOKENS))
    assert port.appended == [] and d.pending_decisions() == 0
