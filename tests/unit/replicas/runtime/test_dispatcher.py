"""The request dispatcher on its own, behind a port with a real RouterState and a recording
appender (no NATS): decide → count in the overlay → append; the stream reconciles; a refused
append is a `DecisionNotRecorded`, never counted, followed by a `not_routed` finish."""

from __future__ import annotations

import random

import pytest

from eventlog import events as ev
from eventlog.appender import AppendFailed
from eventlog.names import KV, ROUTER, Names
from replicas.core.routing_errors import NoWorkers
from replicas.core.state import RouterState, StateConfig
from replicas.runtime.background import Background
from replicas.runtime.config import ReplicaConfig
from replicas.runtime.dispatcher import DecisionNotRecorded, Dispatcher, RouteRequest

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

    async def wait_ready(self, timeout: float | None = None) -> None:
        return None

    async def wait_applied(self, kind: str, seq: int, timeout: float = 10.0) -> None:
        return None


def _dispatcher(port: Port) -> tuple[Dispatcher, Background]:
    bg = Background()
    cfg = ReplicaConfig("r1", "", state=StateConfig(block_size=BS), seed=1)
    return Dispatcher(port, cfg, random.Random(1), bg), bg


async def test_a_decision_counts_at_once_and_until_the_stream_has_it() -> None:
    port = Port()
    port.state.apply(KV, 1, [ev.WorkerRegistered("w", "http://w", "m", BS, 1000, 8192, 1.0)])
    d, _ = _dispatcher(port)
    routed = await d.route(RouteRequest("q1", "m", TOKENS))
    assert (routed.worker_id, routed.worker_url, routed.total_blocks) == ("w", "http://w", 4)
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
    d, bg = _dispatcher(port)
    refused: list[str] = []
    d.on_decision_refused = refused.append
    port.refuse = True
    with pytest.raises(DecisionNotRecorded, match="maximum bytes exceeded"):
        await d.route(RouteRequest("q1", "m", TOKENS))
    assert d.pending_decisions() == 0 and d.overlay.prefill_tokens(("w", 0)) == 0
    assert refused == ["refused"] and d.decision_log.failures == 1
    port.refuse = False
    await bg.wait(timeout=5)
    (_, finish, msg_id), = port.appended
    assert isinstance(finish, ev.RequestFinished) and finish.outcome == "not_routed"
    assert msg_id == "q1.finished"
    await d.route(RouteRequest("q2", "m", TOKENS))  # recorded again: the failure run ends
    assert d.decision_log.last_failure_at is None


async def test_finishing_first_reconciles_and_appends_the_finish() -> None:
    port = Port()
    port.state.apply(KV, 1, [ev.WorkerRegistered("w", "http://w", "m", BS, 1000, 8192, 1.0)])
    d, bg = _dispatcher(port)
    await d.route(RouteRequest("q1", "m", TOKENS))
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
