"""The soak's warm-up reads its RSS baseline only after the leader has purged the router stream
(cluster/chaos_soak.py): before that, nats-servers have not yet been through the memory jump a
purge brings, and the leak check judged them by a baseline they were bound to outgrow."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from cluster.chaos_soak import router_stream_purged
from eventlog.events import RequestFinished, encode_batch
from eventlog.names import ROUTER, Names

pytestmark = pytest.mark.timeout(60)


def probe_of(js: JetStreamContext) -> Any:
    # router_stream_purged reads only these two attributes of the soak's Probe.
    return SimpleNamespace(js=js, names=Names("jr"))


async def test_the_router_stream_counts_as_purged_once_its_first_message_is_gone(
        js: tuple[NATS, JetStreamContext]) -> None:
    _, context = js
    probe = probe_of(context)
    stream = Names("jr").stream(ROUTER)
    assert not await router_stream_purged(probe)  # empty, never purged
    for n in range(3):
        await context.publish(Names("jr").router_subject("r0"),
                              encode_batch([RequestFinished(f"q{n}", "ok", 1, 1.0)]))
    assert not await router_stream_purged(probe)  # holds its first message
    await context.purge_stream(stream, seq=3)
    assert await router_stream_purged(probe)


async def test_an_unreadable_stream_is_not_purged(js: tuple[NATS, JetStreamContext]) -> None:
    _, context = js
    probe = SimpleNamespace(js=context, names=Names("no-such-namespace"))
    assert not await router_stream_purged(probe)
