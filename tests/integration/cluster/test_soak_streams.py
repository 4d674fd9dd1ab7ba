"""The soak reads the router stream's size at the end (cluster/chaos_soak.py
``router_stream_state``) from a real nats-server: its bounds after appends and a purge, and
nothing when the stream cannot be read."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from cluster.chaos_soak import router_stream_state
from eventlog.events import RequestFinished, encode_batch
from eventlog.names import ROUTER, Names

pytestmark = pytest.mark.timeout(60)


def probe_of(js: JetStreamContext, namespace: str = "jr") -> Any:
    # router_stream_state reads only these two attributes of the soak's Probe.
    return SimpleNamespace(js=js, names=Names(namespace))


async def test_the_router_stream_after_appends_and_a_purge(
        js: tuple[NATS, JetStreamContext]) -> None:
    _, context = js
    names = Names("jr")
    for n in range(5):
        await context.publish(names.router_subject("r0"),
                              encode_batch([RequestFinished(f"q{n}", "ok", 1, 1.0)]))
    assert await router_stream_state(probe_of(context)) == {
        "first_seq": 1, "last_seq": 5, "messages": 5}
    await context.purge_stream(names.stream(ROUTER), seq=4)
    assert await router_stream_state(probe_of(context)) == {
        "first_seq": 4, "last_seq": 5, "messages": 2}


async def test_a_stream_that_cannot_be_read_gives_no_reading(
        js: tuple[NATS, JetStreamContext]) -> None:
    _, context = js
    assert await router_stream_state(probe_of(context, "no-such-namespace")) == {}
