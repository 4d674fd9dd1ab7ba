"""Sticky sessions, nvext response fields and Dynamo's frontend flags end to end: a real
nats-server, 2 router replicas and simulated engines as real processes, over real sockets."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import pytest_asyncio

from launch.local_cluster import LocalCluster
from natsops.server import free_port
from tests.integration.registered_cluster import (
    admin,
    registered_cluster,
    unsupervised_engine,
    workers,
)
from tests.waiting import until

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(180)]
MODEL = "jetrouter-sim"
NAMESPACE = "sticky"


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def cluster(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[LocalCluster]:
    data = tmp_path_factory.mktemp("sticky")
    async with registered_cluster(Path(data), replicas=2, workers=2, namespace=NAMESPACE,
                                  worker_args=["--num-gpu-blocks", "2048"]) as c:
        yield c


async def sessions(h: httpx.AsyncClient, c: LocalCluster, url: str) -> dict[str, Any]:
    r = await h.get(f"{url}/admin/sessions", headers=admin(c))
    return {s["session_id"]: s for s in r.json()["sessions"]}


def turn(prompt: list[int], session: str, action: str = "bind",
         timeout: float | None = None, **extra: Any) -> dict[str, Any]:
    control: dict[str, Any] = {"session_id": session, "action": action}
    if timeout is not None:
        control["timeout"] = timeout
    return {"model": MODEL, "prompt": prompt, "max_tokens": 2,
            "nvext": {"session_control": control}, **extra}


async def cache_on(h: httpx.AsyncClient, c: LocalCluster, prefix: list[int],
                   avoid: str) -> str:
    """Put ``prefix`` in the cache of an engine other than ``avoid`` (sent straight to it) and
    wait until both replicas know; returns that engine's id."""
    ws = await workers(h, c, c.router_urls[0])
    other = next(w for w in ws if w != avoid)
    r = await h.post(ws[other]["url"] + "/v1/completions",
                     json={"model": MODEL, "prompt": prefix, "max_tokens": 1})
    assert r.status_code == 200
    for url in c.router_urls:
        await until(lambda url=url: workers(h, c, url),
                    lambda ws: ws[other]["cached_blocks"] >= len(prefix) // 16)
    return other


async def test_a_session_stays_on_its_engine_across_replicas_and_closes(
        cluster: LocalCluster) -> None:
    urls = cluster.router_urls
    async with httpx.AsyncClient(timeout=30) as h:
        first = await h.post(urls[0] + "/v1/completions",
                             json=turn(list(range(100, 180)), "chat-1", "open"))
        assert first.status_code == 200
        home = first.headers["x-jetrouter-worker"]
        # A prompt cached on the OTHER engine: KV cost alone would send it there.
        lure = list(range(3000, 3000 + 16 * 30))
        elsewhere = await cache_on(h, cluster, lure, avoid=home)
        assert elsewhere != home
        for i in range(4):
            r = await h.post(urls[i % 2] + "/v1/completions",
                             json=turn([*lure, 5, i], "chat-1"))
            assert r.status_code == 200 and r.headers["x-jetrouter-worker"] == home, i
        # Without the session the same prompt goes where its cache is.
        r = await h.post(urls[1] + "/v1/completions",
                         json={"model": MODEL, "prompt": [*lure, 6], "max_tokens": 2})
        assert r.headers["x-jetrouter-worker"] == elsewhere
        for url in urls:  # every replica holds the pin, refreshed by each turn
            found = await until(lambda url=url: sessions(h, cluster, url),
                                lambda s: s.get("chat-1", {}).get("requests") == 5)
            assert found["chat-1"]["worker_id"] == home
        metrics = (await h.get(urls[0] + "/metrics")).text
        assert 'jetrouter_session_routes_total{how="pinned"}' in metrics
        assert "jetrouter_sticky_sessions " in metrics
        engine = (await workers(h, cluster, urls[0]))[home]["url"]
        opened = (await h.get(engine + "/sessions")).json()["sessions"]
        assert opened["chat-1"]["turns"] == 5  # the router opened it there: SGLang's call
        last = await h.post(urls[1] + "/v1/completions",
                            json=turn([*lure, 9], "chat-1", "close"))
        assert last.headers["x-jetrouter-worker"] == home
        for url in urls:
            await until(lambda url=url: sessions(h, cluster, url), lambda s: "chat-1" not in s)
        await until(lambda: h.get(engine + "/sessions"),
                    lambda r: "chat-1" not in r.json()["sessions"])


async def test_the_header_pins_too(cluster: LocalCluster) -> None:
    urls = cluster.router_urls
    async with httpx.AsyncClient(timeout=30) as h:
        seen = set()
        for i in range(4):
            r = await h.post(urls[i % 2] + "/v1/completions",
                             headers={"x-dynamo-session-id": "hdr-1"},
                             json={"model": MODEL, "prompt": list(range(7000 + 50 * i,
                                                                        7040 + 50 * i)),
                                   "max_tokens": 2})
            assert r.status_code == 200
            seen.add(r.headers["x-jetrouter-worker"])
        assert len(seen) == 1
        pins = await until(lambda: sessions(h, cluster, urls[0]), lambda s: "hdr-1" in s)
        assert pins["hdr-1"]["ttl_s"] == 300.0  # --session-ttl-secs default
        cli = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "api.cli", "admin", "--url", urls[1],
            f"--token={cluster.admin_token}", "sessions",
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        out, _ = await cli.communicate()
        assert cli.returncode == 0 and b"hdr-1" in out and b"engine_usable" in out, out
        bad = await h.post(urls[0] + "/v1/completions",
                           json=turn([1, 2, 3], "s", action="pause"))
        assert bad.status_code == 400
        assert bad.json()["error"]["param"] == "nvext.session_control.action"


async def test_a_session_expires_by_ttl_in_event_time(cluster: LocalCluster) -> None:
    url = cluster.router_urls[0]
    async with httpx.AsyncClient(timeout=30) as h:
        r = await h.post(url + "/v1/completions",
                         json=turn(list(range(200, 260)), "short", "open", timeout=1.0))
        assert r.status_code == 200
        await until(lambda: sessions(h, cluster, url), lambda s: "short" in s)

        async def traffic_then_pins() -> dict[str, Any]:
            # Event time moves with the events applied: other requests carry it past the TTL.
            await h.post(url + "/v1/completions",
                         json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 1})
            return await sessions(h, cluster, url)

        await until(traffic_then_pins, lambda s: "short" not in s, interval=0.3)
        # The next turn starts a fresh pin.
        r = await h.post(url + "/v1/completions", json=turn([4, 5, 6], "short"))
        assert r.status_code == 200
        pins = await until(lambda: sessions(h, cluster, url), lambda s: "short" in s)
        assert pins["short"]["requests"] == 1


async def test_extra_fields_name_the_worker_and_timing(cluster: LocalCluster) -> None:
    url = cluster.router_urls[0]
    body = {"model": MODEL, "prompt": list(range(400, 480)), "max_tokens": 3,
            "nvext": {"extra_fields": ["worker_id", "timing"]}}
    async with httpx.AsyncClient(timeout=30) as h:
        r = await h.post(url + "/v1/completions", json=body)
        assert r.status_code == 200
        nv = r.json()["nvext"]
        assert nv["worker_id"]["decode_worker_id"] == r.headers["x-jetrouter-worker"]
        assert nv["worker_id"]["prompt_blocks"] == 5
        assert nv["worker_id"]["predicted_cached_tokens"] == int(
            r.headers["x-jetrouter-predicted-cached-tokens"])
        assert nv["timing"]["total_time_ms"] >= nv["timing"]["routing_ms"] > 0
        frames = []
        async with h.stream("POST", url + "/v1/chat/completions",
                            json={"model": MODEL, "max_tokens": 3, "stream": True,
                                  "messages": [{"role": "user", "content": "hello"}],
                                  "nvext": {"extra_fields": ["timing"]}}) as s:
            async for line in s.aiter_lines():
                if line.startswith("data: "):
                    frames.append(line[6:])
        assert frames[-1] == "[DONE]"
        tail = msgspec.json.decode(frames[-2])
        assert tail["choices"] == [] and "worker_id" not in tail["nvext"]
        assert tail["nvext"]["timing"]["ttft_ms"] > 0
        plain = await h.post(url + "/v1/completions", json={**body, "nvext": {}})
        assert "nvext" not in plain.json()


async def test_a_dynamo_frontend_command_line_starts(cluster: LocalCluster,
                                                     tmp_path: Path) -> None:
    port = free_port()
    log_file = tmp_path / "dynamo.log"
    with open(log_file, "wb") as out:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "api.cli", "serve", "--router-mode", "kv",
            "--http-port", str(port), "--http-host", "127.0.0.1", "--kv-cache-block-size", "16",
            "--router-replica-sync", "--router-durable-kv-events",
            "--no-router-track-active-blocks", "--no-router-assume-kv-reuse",
            "--router-track-prefill-tokens", "--replica-id", "rdyn",
            "--nats-url", cluster.nats_url, "--namespace", NAMESPACE,
            "--data-dir", str(tmp_path / "rdyn"), "--canary-interval", "0",
            stdout=out, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient(timeout=30) as h:
            await until(lambda: h.get(url + "/ready"), lambda r: r.status_code == 200,
                        tolerate=(httpx.TransportError,), timeout=90,
                        what=f"the Dynamo-style replica to be ready ({log_file})")
            r = await h.post(url + "/v1/completions",
                             json={"model": MODEL, "prompt": "hello", "max_tokens": 2})
            assert r.status_code == 200 and r.headers["x-jetrouter-replica"] == "rdyn"
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        await proc.wait()


async def test_a_session_moves_when_its_engine_is_retired(cluster: LocalCluster,
                                                          tmp_path: Path) -> None:
    """An engine outside the cluster's supervision (so it stays gone once stopped)."""
    urls = cluster.router_urls
    async with unsupervised_engine(cluster, "wx", tmp_path, "--num-gpu-blocks", "2048") as proc:
        async with httpx.AsyncClient(timeout=30) as h:
            for url in urls:
                await until(lambda url=url: workers(h, cluster, url), lambda ws: "wx" in ws)
            wx_url = (await workers(h, cluster, urls[0]))["wx"]["url"]
            prefix = list(range(9000, 9000 + 16 * 30))
            r = await h.post(wx_url + "/v1/completions",
                             json={"model": MODEL, "prompt": prefix, "max_tokens": 1})
            assert r.status_code == 200
            for url in urls:
                await until(lambda url=url: workers(h, cluster, url),
                            lambda ws: ws["wx"]["cached_blocks"] >= 30)
            r = await h.post(urls[0] + "/v1/completions", json=turn([*prefix, 1], "mv", "open"))
            assert r.headers["x-jetrouter-worker"] == "wx"
            proc.send_signal(signal.SIGTERM)  # graceful: WorkerRetired first
            await proc.wait()
            for url in urls:
                await until(lambda url=url: workers(h, cluster, url),
                            lambda ws: "wx" not in ws)
                assert (await sessions(h, cluster, url))["mv"]["engine_usable"] is False
            r = await h.post(urls[1] + "/v1/completions", json=turn([*prefix, 2], "mv"))
            assert r.status_code == 200  # the client is answered, by another engine
            moved = r.headers["x-jetrouter-worker"]
            assert moved != "wx"
            for url in urls:
                await until(lambda url=url: sessions(h, cluster, url),
                            lambda s: s["mv"]["worker_id"] == moved)
            r = await h.post(urls[0] + "/v1/completions", json=turn([7, 7, 7], "mv"))
            assert r.headers["x-jetrouter-worker"] == moved
            engine = (await workers(h, cluster, urls[0]))[moved]["url"]
            opened = (await h.get(engine + "/sessions")).json()["sessions"]
            assert opened["mv"]["turns"] == 2  # re-opened on the new engine, then one more turn


async def test_a_session_survives_a_replica_sigkill(cluster: LocalCluster) -> None:
    """Runs last: it kills a replica (the cluster restarts it)."""
    urls = cluster.router_urls
    async with httpx.AsyncClient(timeout=30) as h:
        r = await h.post(urls[0] + "/v1/completions",
                         json=turn(list(range(500, 580)), "survivor", "open"))
        home = r.headers["x-jetrouter-worker"]
        lure = list(range(12000, 12000 + 16 * 30))
        await cache_on(h, cluster, lure, avoid=home)
        # A snapshot taken now holds the pin: the restarted replica restores it from there.
        await until(lambda: sessions(h, cluster, urls[1]), lambda s: "survivor" in s)
        snap = await h.post(urls[1] + "/admin/snapshot", headers=admin(cluster))
        assert snap.status_code == 200, snap.text
        pid = cluster.kill("r0", signal.SIGKILL)
        await until(lambda: cluster.processes.get("r0"), lambda p: p not in (None, pid),
                    timeout=60, what="r0 to be restarted")
        await cluster.wait_ready(["r0"], timeout=90)
        pins = await sessions(h, cluster, urls[0])  # restored from the snapshot + replay
        assert pins["survivor"]["worker_id"] == home
        state = (await h.get(urls[0] + "/admin/state", headers=admin(cluster))).json()
        assert state["restores"] >= 1
        for i in range(3):
            r = await h.post(urls[i % 2] + "/v1/completions",
                             json=turn([*lure, 3, i], "survivor"))
            assert r.status_code == 200 and r.headers["x-jetrouter-worker"] == home
