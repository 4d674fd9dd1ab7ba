"""The whole of NATS down, then back with its data (or without: its store wiped): a real
nats-server SIGKILLed under a cluster of real replica and engine processes, requests through the
official openai client.

While it is down every request still succeeds (degraded mode: routing on the state the replicas
have), `/ready` stays 200 and says ``degraded``, `/admin/state` and the metrics count decisions
not appended. Restarted on the same port with the same store, the replicas reconnect, leave
degraded mode, catch up to equal digests, and no load is left charged anywhere once the traffic
has stopped (every finish of a decision that did land, landed too). Restarted with an empty
store, one replica re-creates the streams from its state, the others follow, and every engine
re-announces its cache."""

from __future__ import annotations

import asyncio
import itertools
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import openai
import pytest

from eventlog import events as ev
from eventlog.names import Names
from eventlog.streams import stream_bounds
from launch.local_cluster import LocalCluster
from natsops.server import NatsServer
from tests.chaos.conftest import MODEL, until

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(240)]


class Traffic:
    """Two clients sending one request after another, alternating replicas, until stopped."""

    def __init__(self, urls: list[str]) -> None:
        self.clients = [openai.AsyncOpenAI(base_url=u + "/v1", api_key="x", max_retries=0,
                                           timeout=30) for u in urls]
        self.ok = 0
        self.errors: list[str] = []
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._n = itertools.count()

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._loop()) for _ in range(2)]

    async def _loop(self) -> None:
        while not self._stop.is_set():
            i = next(self._n)
            client = self.clients[i % len(self.clients)]
            prefix = list(range(100 * (i % 5), 100 * (i % 5) + 64))  # shared prefixes
            try:
                r = await client.completions.create(model=MODEL, prompt=[*prefix, i % 251, 7],
                                                    max_tokens=4)
                assert r.choices[0].text
                self.ok += 1
            except (openai.APIError, AssertionError) as exc:
                self.errors.append(f"{type(exc).__name__}: {exc}"[:200])

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.wait_for(asyncio.gather(*self._tasks), 60)


@pytest.fixture
async def outage_cluster(nats_server: NatsServer, tmp_path: Path
                         ) -> AsyncIterator[LocalCluster]:
    cluster = LocalCluster(replicas=2, workers=2, nats_url=nats_server.url,
                           data_dir=tmp_path / "cluster", ready_timeout=120.0,
                           router_args=["--heartbeat-interval", "0.5"])
    async with cluster:
        yield cluster


async def test_all_of_nats_killed_then_back_with_its_data(
        nats_server: NatsServer, outage_cluster: LocalCluster) -> None:
    await outage_then_back(nats_server, outage_cluster, wipe=False)


async def test_all_of_nats_killed_then_back_empty_is_reseeded(
        nats_server: NatsServer, outage_cluster: LocalCluster, nats_connect) -> None:
    await outage_then_back(nats_server, outage_cluster, wipe=True)
    # Every engine re-announced its cache on the re-created KV stream.
    js = (await nats_connect(nats_server.url)).jetstream()
    stream = Names("jr").stream("kv")
    first, last = await stream_bounds(js, stream)
    cleared = set()
    for seq in range(first, last + 1):
        msg = await js.get_msg(stream, seq)
        cleared |= {e.worker_id for e in ev.decode_batch(msg.data)
                    if isinstance(e, ev.AllBlocksCleared)}
    assert cleared == {"w0", "w1"}


async def outage_then_back(nats_server: NatsServer, c: LocalCluster, *, wipe: bool) -> None:
    auth = {"authorization": f"Bearer {c.admin_token}"}
    replicas = c.router_urls
    restarts = {n: ch.restarts for n, ch in c.children.items()}
    async with httpx.AsyncClient(timeout=10) as h:

        async def states() -> list[dict]:
            return [(await h.get(u + "/admin/state", headers=auth)).json() for u in replicas]

        async def readies() -> list[tuple[int, dict]]:
            out = []
            for u in replicas:
                r = await h.get(u + "/ready")
                out.append((r.status_code, r.json()))
            return out

        traffic = Traffic(replicas)
        traffic.start()
        await until(lambda: asyncio.sleep(0, traffic.ok), lambda n: n >= 10, 60, "warm-up")

        nats_server.kill()  # SIGKILL: the only server, so all of NATS
        ok_at_kill = traffic.ok
        answers = await until(readies, lambda rs: all(
            code == 200 and body.get("degraded") is True for code, body in rs),
            60, "/ready: 200 and degraded on every replica")
        for _, body in answers:
            assert body["event_log"]["connected"] is False
        # Degraded on both: a good number of requests served on the state the replicas have.
        served_from = traffic.ok
        await until(lambda: asyncio.sleep(0, traffic.ok), lambda n: n >= served_from + 20, 60,
                    "requests served while NATS is down")
        assert traffic.errors == [], traffic.errors[:5]
        assert traffic.ok > ok_at_kill
        views = [s["event_log"] for s in await states()]
        assert all(v["degraded"] and v["decisions_not_appended"] > 0 for v in views), views
        metrics = (await h.get(replicas[0] + "/metrics")).text
        assert "jetrouter_event_log_degraded 1.0" in metrics
        assert "jetrouter_decisions_not_appended_total" in metrics

        if wipe:  # the volume lost: nothing of the streams, buckets or snapshots survives
            shutil.rmtree(nats_server.store_dir)
            nats_server.store_dir.mkdir()
        await asyncio.to_thread(nats_server.start, 60)  # same port, same store dir

        def recovered(ss: list[dict]) -> bool:
            return (not any(s["event_log"]["degraded"] for s in ss)
                    and len({str(s["positions"]) for s in ss}) == 1
                    and len({s["digests"]["state"] for s in ss}) == 1
                    and all(max(s["lag"].values()) == 0 for s in ss))

        await until(states, recovered, 90, "degraded mode left, digests equal")
        back_from = traffic.ok
        await until(lambda: asyncio.sleep(0, traffic.ok), lambda n: n >= back_from + 10, 60,
                    "requests served after NATS came back")
        await traffic.stop()
        assert traffic.errors == [], traffic.errors[:5]
        for code, body in await readies():
            assert code == 200 and "degraded" not in body

        # Quiet now: every replica at the streams' ends with equal digests and nothing
        # charged (a finish lost in the outage would leave its request's load everywhere).
        final = await until(states, lambda ss: recovered(ss) and all(
            s["active_requests"] == 0 and s["pending_decisions"] == 0 for s in ss),
            60, "converged with no load left")
        assert all(s["event_log"]["outages"] == 1 for s in final)
        assert all(s["event_log"]["last_outage_s"] > 0 for s in final)
    # Nobody was restarted: the replicas and engines rode the outage out in place.
    assert {n: ch.restarts for n, ch in c.children.items()} == restarts
