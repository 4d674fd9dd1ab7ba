"""The dispatcher records the load-model flags on each decision and appends output progress,
one append in flight per request carrying the newest count (no NATS: a recording port)."""

from __future__ import annotations

import asyncio
import random

import pytest

from eventlog import events as ev
from eventlog.names import KV
from replicas.core.state import StateConfig
from replicas.runtime.background import Background
from replicas.runtime.config import ReplicaConfig
from replicas.runtime.dispatcher import Dispatcher, RouteRequest
from tests.unit.replicas.runtime.test_dispatcher import BS, TOKENS, Port
from tests.waiting import until

pytestmark = pytest.mark.timeout(10)


class GatedPort(Port):
    """Holds every OutputProgress append until the test opens the gate."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.waiting = 0

    async def append(self, subject: str, event: ev.Event, msg_id: str | None) -> int:
        if isinstance(event, ev.OutputProgress):
            self.waiting += 1
            await self.gate.wait()
            self.waiting -= 1
        return await super().append(subject, event, msg_id)


def _dispatcher(port: Port, **flags: object) -> tuple[Dispatcher, Background]:
    bg = Background()
    cfg = ReplicaConfig("r1", "", state=StateConfig(block_size=BS), seed=1, **flags)  # type: ignore[arg-type]
    port.state.apply(KV, 1, [ev.WorkerRegistered("w", "http://w", "m", BS, 1000, 8192, 1.0)])
    return Dispatcher(port, cfg, random.Random(1), bg), bg


async def first_progress_held() -> tuple[GatedPort, Dispatcher, Background]:
    """Request q1 routed by a dispatcher that tracks output blocks, its first progress (16
    tokens) held at the port's gate: (the port, the dispatcher, its background tasks)."""
    port = GatedPort()
    d, bg = _dispatcher(port, track_output_blocks=True)
    await d.route(RouteRequest("q1", "m", TOKENS))
    d.output_progress("q1", 16)
    await until(lambda: port.waiting, lambda n: n == 1)
    return port, d, bg


async def test_decisions_carry_the_flags_and_the_osl_hint() -> None:
    port = Port()
    d, _ = _dispatcher(port, track_output_blocks=True, prefill_load_model="linear")
    routed = await d.route(RouteRequest("q1", "m", TOKENS, expected_osl=50, osl_hint=50))
    e = routed.event
    assert (e.track_output_blocks, e.osl_hint, e.prefill_load_model) == (True, 50, "linear")
    plain = Port()
    d2, _ = _dispatcher(plain)
    e2 = (await d2.route(RouteRequest("q2", "m", TOKENS))).event
    assert (e2.track_output_blocks, e2.osl_hint, e2.prefill_load_model) == (False, 0, "none")


async def test_progress_appends_coalesce_to_the_newest_count() -> None:
    port, d, bg = await first_progress_held()
    for count in (32, 48, 64):  # while the first is on its way
        d.output_progress("q1", count)
    port.gate.set()
    await bg.wait(5)
    sent = [(e.output_tokens, msg_id) for _, e, msg_id in port.appended
            if isinstance(e, ev.OutputProgress)]
    assert sent == [(16, "q1.out16"), (64, "q1.out64")]


async def test_a_finished_request_sends_no_more_progress() -> None:
    port, d, bg = await first_progress_held()
    d.output_progress("q1", 32)
    d.finished("q1", "ok", 40)
    port.gate.set()
    await bg.wait(5)
    kinds = [(type(e).__name__, getattr(e, "output_tokens", None)) for _, e, _ in port.appended]
    assert ("OutputProgress", 32) not in kinds
    assert kinds[-2:] in ([("RequestFinished", 40), ("OutputProgress", 16)],
                          [("OutputProgress", 16), ("RequestFinished", 40)])
