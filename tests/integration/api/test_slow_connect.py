"""Slow is not dead: a connect to an engine that times out (api/forward/connect_retry.py), end to
end. nats-server and one router replica as real processes (connect timeout 0.5 s); engines are
stand-ins on loopback sockets (tests/standin_engine.py) that register and publish their load
gauges through the custom-engine API (workers/publishing.py), as a bridge does for vLLM. A busy
engine is one whose accept queue is full: its socket listens, SYNs go unanswered, and it accepts
once the test lets it (tests/full_accept_queue.py).

Each test uses a model of its own, so the engines the tests register never route each other's
requests.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from launch.local_cluster import LocalCluster
from natsops.server import free_port
from tests.integration.api.standin_fleet import BLOCK, answer, counter, grew, registered, workers
from tests.standin_engine import standin_engine
from tests.waiting import until
from workers.publishing import stored_blocks

pytestmark = [pytest.mark.timeout(120)]
cluster_test = pytest.mark.asyncio(loop_scope="module")
NS = "slowc"
TIMEOUTS = "jetrouter_engine_connect_timeouts_total"
MIGRATIONS = "jetrouter_migrations_total"


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def cluster(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[LocalCluster]:
    data = tmp_path_factory.mktemp("slow-connect")
    # Canaries off: this is about the request path, not the leader's checks.
    async with LocalCluster(replicas=1, workers=0, data_dir=Path(data), namespace=NS,
                            router_args=["--canary-interval", "0",
                                         "--engine-connect-timeout", "0.5",
                                         "--stream-idle-timeout", "20",
                                         "--migration-limit", "2"]) as c:
        yield c


@cluster_test
@pytest.mark.parametrize("n", [1, 2], ids=["relayed", "verbatim"])
async def test_the_only_engine_busy_but_alive_is_connected_to_again_until_it_accepts(
        cluster: LocalCluster, n: int) -> None:
    """The 502 of the real-vLLM P/D runs: one decode engine, its connect timed out. Now the
    router connects again (n=1: api/forward/run.py, n=2: api/forward/passthrough.py)."""
    model = f"solo-{n}"
    async with standin_engine(answer, accepting=False) as busy, \
            registered(cluster, f"solo{n}", busy.url, model), \
            httpx.AsyncClient(timeout=60) as h:
        before = await counter(h, cluster, TIMEOUTS)
        sent = asyncio.create_task(h.post(
            cluster.router_urls[0] + "/v1/completions",
            json={"model": model, "prompt": "hello", "max_tokens": 3, "n": n}))
        # The router is waiting on the engine: at least one connect timed out and was retried
        # (or, were it given up, the test ends now rather than at the deadline).
        counted = await until(lambda: counter(h, cluster, TIMEOUTS),
                              lambda now: set(grew(now, before)) & {"retried", "failed"},
                              what="a connect timed out")
        assert set(grew(counted, before)) == {"retried"}, counted
        assert not sent.done()
        await busy.accept()  # the engine catches up
        resp = await asyncio.wait_for(sent, 30)
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-jetrouter-worker"] == f"solo{n}"
        assert "x-jetrouter-migrations" not in resp.headers
        assert [c["text"] for c in resp.json()["choices"]] == ["abc"] * n
        # Sent once, however many connects it took.
        assert [r.path for r in busy.received] == ["/v1/completions"]
        counted = grew(await counter(h, cluster, TIMEOUTS), before)
        assert set(counted) == {"retried"}, counted


@cluster_test
async def test_a_busy_engine_s_request_moves_to_another_engine_when_there_is_one(
        cluster: LocalCluster) -> None:
    model = "pair"
    prompt = list(range(100, 100 + 4 * BLOCK))
    async with standin_engine(answer, accepting=False) as busy, \
            standin_engine(answer) as free, \
            registered(cluster, "pair-busy", busy.url, model) as pub, \
            registered(cluster, "pair-free", free.url, model), \
            httpx.AsyncClient(timeout=60) as h:
        # The busy engine holds the prompt's blocks, so the first hop goes there.
        pub.emit(0, [stored_blocks([1, 2, 3, 4], prompt, block_size=BLOCK)])
        await until(lambda: workers(h, cluster),
                    lambda ws: ws["pair-busy"]["cached_blocks"] >= 4, what="blocks known")
        timeouts, migrations = (await counter(h, cluster, TIMEOUTS),
                                await counter(h, cluster, MIGRATIONS))
        resp = await h.post(cluster.router_urls[0] + "/v1/completions",
                            json={"model": model, "prompt": prompt, "max_tokens": 3})
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["text"] == "abc"
        assert resp.headers["x-jetrouter-worker"] == "pair-free"
        assert resp.headers["x-jetrouter-migrations"] == "1"
        assert busy.received == [] and len(free.received) == 1
        assert grew(await counter(h, cluster, TIMEOUTS), timeouts) == {"migrated": 1.0}
        assert grew(await counter(h, cluster, MIGRATIONS), migrations) == \
            {"connect_timeout": 1.0}


@cluster_test
async def test_a_busy_engine_not_heard_from_fails_the_request_after_one_connect(
        cluster: LocalCluster) -> None:
    model = "silent"
    async with standin_engine(answer, accepting=False) as busy, \
            registered(cluster, "silent0", busy.url, model, gauges=False), \
            httpx.AsyncClient(timeout=60) as h:
        before = await counter(h, cluster, TIMEOUTS)
        started = time.monotonic()
        resp = await h.post(cluster.router_urls[0] + "/v1/completions",
                            json={"model": model, "prompt": "hello", "max_tokens": 3})
        assert resp.status_code == 502, resp.text
        assert "connect_timeout" in resp.text
        assert time.monotonic() - started < 10  # one 0.5 s connect, not a 20 s window
        assert grew(await counter(h, cluster, TIMEOUTS), before) == {"failed": 1.0}


@cluster_test
async def test_nothing_listening_still_fails_at_once(cluster: LocalCluster) -> None:
    model = "gone"
    url = f"http://127.0.0.1:{free_port()}"
    async with registered(cluster, "gone0", url, model), httpx.AsyncClient(timeout=60) as h:
        before = await counter(h, cluster, TIMEOUTS)
        started = time.monotonic()
        resp = await h.post(cluster.router_urls[0] + "/v1/completions",
                            json={"model": model, "prompt": "hello", "max_tokens": 3})
        assert resp.status_code == 502, resp.text
        assert "connect_error" in resp.text
        assert time.monotonic() - started < 5
        assert grew(await counter(h, cluster, TIMEOUTS), before) == {}
