"""Busy is not dead before the first byte (api/forward/first_byte.py), end to end: nats-server and
one router replica as real processes (stream idle timeout 1 s, first-byte timeout 60 s), engines
are stand-ins on loopback sockets (tests/standin_engine.py) registered with their load gauges
through the custom-engine API (tests/integration/api/standin_fleet.py), as a bridge registers
vLLM. A silent engine is one that has the request and answers only when the test lets it. A busy
one stores KV blocks meanwhile (it computes prompts: a long prompt on a loaded engine); a hung one
stores nothing, though its load gauges go on.

Each test uses a model of its own, so the engines the tests register never route each other's
requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from launch.local_cluster import LocalCluster
from tests.integration.api.standin_fleet import BLOCK, answer, counter, grew, registered
from tests.standin_engine import Received, Reply, standin_engine
from tests.waiting import until
from workers.publisher import KvPublisher
from workers.publishing import stored_blocks

pytestmark = [pytest.mark.timeout(120)]
cluster_test = pytest.mark.asyncio(loop_scope="module")
WAITS = "jetrouter_engine_first_byte_waits_total"
MIGRATIONS = "jetrouter_migrations_total"


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def cluster(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[LocalCluster]:
    data = tmp_path_factory.mktemp("slow-first-byte")
    # Canaries off: this is about the request path, not the leader's checks.
    async with LocalCluster(replicas=1, workers=0, data_dir=Path(data), namespace="slowfb",
                            router_args=["--canary-interval", "0",
                                         "--stream-idle-timeout", "1",
                                         "--first-byte-timeout", "60",
                                         "--migration-limit", "2"]) as c:
        yield c


def held_answer(release: asyncio.Event):  # type: ignore[no-untyped-def]
    """:func:`answer`, held back until ``release``: a streamed answer sends its head at once
    and its events later, a JSON answer nothing at all."""
    def reply(got: Received) -> Reply:
        r = answer(got)
        if r.events is not None:
            return dataclasses.replace(r, hold_events=release)
        return dataclasses.replace(r, hold=release)
    return reply


@contextlib.asynccontextmanager
async def computing(pub: KvPublisher) -> AsyncIterator[None]:
    """The engine stores a new KV block every 0.2 s: it computes (other prompts)."""
    ids = itertools.count(1)

    async def work() -> None:
        while True:
            block = next(ids)
            pub.emit(0, [stored_blocks([block], [block] * BLOCK, block_size=BLOCK)])
            await asyncio.sleep(0.2)  # the engine's pace of work, not a wait for the router

    task = asyncio.create_task(work())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@cluster_test
@pytest.mark.parametrize(("n", "stream"), [(1, False), (2, True)],
                         ids=["relayed-no-head", "verbatim-head-only"])
async def test_the_only_engine_silent_but_working_is_waited_for(
        cluster: LocalCluster, n: int, stream: bool) -> None:
    """Eight long prompts on a real vLLM kept it silent past the idle timeout, and the request
    failed. Now a live engine that stores KV blocks is waited for until its first byte."""
    model = f"quiet-{n}"
    release = asyncio.Event()
    async with standin_engine(held_answer(release)) as engine, \
            registered(cluster, f"quiet{n}", engine.url, model) as pub, computing(pub), \
            httpx.AsyncClient(timeout=60) as h:
        before = await counter(h, cluster, WAITS)
        sent = asyncio.create_task(h.post(
            cluster.router_urls[0] + "/v1/completions",
            json={"model": model, "prompt": "hello", "max_tokens": 3, "n": n,
                  "stream": stream}))
        # Silent for at least three idle timeouts, each waited through (or, were one to stand,
        # the test ends now rather than at the deadline).
        counted = await until(lambda: counter(h, cluster, WAITS),
                              lambda now: grew(now, before).get("waited", 0) >= 3
                              or "failed" in grew(now, before),
                              what="idle timeouts waited through")
        assert "failed" not in grew(counted, before), counted
        assert not sent.done()
        release.set()  # the engine answers
        resp = await asyncio.wait_for(sent, 30)
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-jetrouter-worker"] == f"quiet{n}"
        assert "x-jetrouter-migrations" not in resp.headers
        if stream:
            assert "data: [DONE]" in resp.text
        else:
            assert [c["text"] for c in resp.json()["choices"]] == ["abc"] * n
        assert engine.paths() == ["/v1/completions"]  # sent once: its prompt computed once


@cluster_test
@pytest.mark.parametrize("gauges", [True, False], ids=["hung", "gone-silent"])
async def test_a_silent_engine_that_stores_nothing_fails_at_the_idle_timeout(
        cluster: LocalCluster, gauges: bool) -> None:
    """A hung engine (its gauges go on, nothing is computed) is left after the idle timeout as
    before, and so is one not heard from at all, however much KV it stores."""
    model = f"hung-{gauges}"
    release = asyncio.Event()
    async with standin_engine(held_answer(release)) as engine, \
            registered(cluster, f"hung{gauges:d}", engine.url, model, gauges=gauges) as pub, \
            contextlib.AsyncExitStack() as stack, httpx.AsyncClient(timeout=60) as h:
        if not gauges:
            await stack.enter_async_context(computing(pub))
        before = await counter(h, cluster, WAITS)
        started = time.monotonic()
        resp = await h.post(cluster.router_urls[0] + "/v1/completions",
                            json={"model": model, "prompt": "hello", "max_tokens": 3})
        assert resp.status_code == 502, resp.text
        assert "idle_timeout" in resp.text
        assert time.monotonic() - started < 30  # one 1 s idle timeout, not the 60 s wait
        assert grew(await counter(h, cluster, WAITS), before) == {"failed": 1.0}
        release.set()
