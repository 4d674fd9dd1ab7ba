"""deploy/haproxy.cfg in front of real replicas: what each way of losing a replica costs.

The balancer config compose.yaml mounts, with only the addresses changed for loopback (backend
servers, the bind port; Docker's resolver section dropped), run by a real `haproxy` in front of
a LocalCluster. SIGKILL: requests in flight on the killed replica got no byte back and are
retried on the other one (`retry-on empty-response`, `option redispatch`). SIGSTOP: the paused
replica stops answering its health check, is marked down within seconds, and its sessions are
cut (`on-marked-down shutdown-sessions`) instead of hanging until `timeout server`. SIGTERM: the
draining replica answers its check with 404 (`disable-on-404`): no new requests, its streams run
to their end. Skipped where no haproxy binary exists.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from launch.local_cluster import LocalCluster
from natsops.server import free_port
from tests.waiting import until
from tokenization import tokens
from workers.generation import expected_tokens

HAPROXY = shutil.which("haproxy")
pytestmark = [pytest.mark.skipif(HAPROXY is None, reason="no haproxy binary"),
              pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(240)]
ROOT = Path(__file__).resolve().parents[3]
MODEL = "jetrouter-sim"


def loopback_config(replicas: list[str], port: int, stats_port: int) -> str:
    """deploy/haproxy.cfg with loopback addresses; every timeout, check and retry rule kept."""
    text = (ROOT / "deploy" / "haproxy.cfg").read_text()
    text = re.sub(r"(?m)^resolvers docker\n(?:[ \t]+.*\n)*", "", text)
    text = text.replace(" resolvers docker init-addr last,libc,none", "")
    text = re.sub(r"^    log stdout.*\n", "", text, flags=re.M)
    text = text.replace("bind :8080", f"bind 127.0.0.1:{port}")
    servers = "".join(f"    server r{i} {u.removeprefix('http://')}\n"
                      for i, u in enumerate(replicas))
    text = re.sub(r"(?m)^    server r\d .*\n", "", text).rstrip("\n") + "\n" + servers
    # the real rules are kept
    assert "inter 250ms" in text and "empty-response" in text and "shutdown-sessions" in text
    return text + (f"\nfrontend stats\n    bind 127.0.0.1:{stats_port}\n    stats enable\n"
                   "    stats uri /stats\n")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def cluster(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[LocalCluster]:
    data = tmp_path_factory.mktemp("lb")
    # restart: each test kills or stops a replica, and the next one starts with both back.
    async with LocalCluster(replicas=2, workers=2, data_dir=Path(data), namespace="lb") as c:
        yield c


@pytest.fixture(scope="module")
def balancer(cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[tuple[str, str]]:
    port, stats = free_port(), free_port()
    cfg = tmp_path_factory.mktemp("haproxy") / "haproxy.cfg"
    cfg.write_text(loopback_config(cluster.router_urls, port, stats))
    assert HAPROXY is not None
    proc = subprocess.Popen([HAPROXY, "-db", "-f", str(cfg)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        yield f"http://127.0.0.1:{port}", f"http://127.0.0.1:{stats}/stats;csv"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


def _field(csv: str, server: str, name: str) -> str:
    """One column of the stats CSV for a backend server (status, scur: current sessions...)."""
    header = csv.lstrip("# ").splitlines()[0].split(",")
    for line in csv.splitlines()[1:]:
        row = dict(zip(header, line.split(","), strict=False))
        if row.get("pxname") == "routers" and row.get("svname") == server:
            return row.get(name, "")
    return ""


def _status(csv: str, server: str) -> str:
    return _field(csv, server, "status")


async def both_up(h: httpx.AsyncClient, stats: str) -> None:
    await until(lambda: h.get(stats), lambda r: _status(r.text, "r0") == "UP"
                and _status(r.text, "r1") == "UP", timeout=90, what="both replicas UP",
                tolerate=(httpx.HTTPError,))  # haproxy still binding


async def test_sigkill_of_a_replica_fails_no_request(cluster: LocalCluster,
                                                     balancer: tuple[str, str]) -> None:
    url, stats = balancer
    async with httpx.AsyncClient(timeout=120) as h:
        await both_up(h, stats)

        async def one(i: int) -> httpx.Response:
            # ~1-2 s of decoding: long enough to be in flight when the replica dies.
            return await h.post(f"{url}/v1/completions",
                                json={"model": MODEL, "prompt": f"haproxy {i}",
                                      "max_tokens": 150})

        requests = [asyncio.create_task(one(i)) for i in range(12)]
        # Kill r1 while it holds requests in flight.
        await until(lambda: _in_flight(h, cluster), lambda busy: "r1" in busy,
                    timeout=60, interval=0.02, what="requests in flight on r1")
        killed_at = time.monotonic()
        cluster.kill("r1", signal.SIGKILL)
        down = await until(lambda: h.get(stats), lambda r: _status(r.text, "r1").startswith(
            "DOWN"), timeout=30, interval=0.02, what="r1 marked DOWN")
        marked_down = time.monotonic() - killed_at
        answers = await asyncio.gather(*requests)
    assert down is not None
    failed = [(r.status_code, r.text[:200]) for r in answers if r.status_code != 200]
    assert failed == [], failed
    served_by = {r.headers.get("x-jetrouter-replica") for r in answers}
    print(f"r1 marked DOWN {marked_down:.2f} s after SIGKILL; 12/12 answered 200, "
          f"served by {sorted(served_by)}")


async def _in_flight(h: httpx.AsyncClient, c: LocalCluster) -> set[str]:
    """Replicas with requests in flight right now (their jetrouter_inflight_requests gauge)."""
    busy = set()
    for name, url in zip(("r0", "r1"), c.router_urls, strict=True):
        text = (await h.get(f"{url}/metrics")).text
        if any(line.startswith("jetrouter_inflight_requests") and float(line.split()[-1]) > 0
               for line in text.splitlines()):
            busy.add(name)
    return busy


@dataclass
class HeldStream:
    """One streamed completion through the balancer, read in the background."""

    prompt: list[int]
    max_tokens: int
    text: str = ""
    replica: str | None = None
    done: bool = False          # `data: [DONE]` arrived
    error: str | None = None    # a non-200 answer or the connection cut mid-stream
    ended_at: float = 0.0
    first_token: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None

    async def run(self, h: httpx.AsyncClient, url: str) -> None:
        body = {"model": MODEL, "prompt": self.prompt, "max_tokens": self.max_tokens,
                "stream": True}
        try:
            # The client waits as long as HAProxy's `timeout server`: an end that comes sooner
            # comes from the balancer or the replica, not from this reader giving up.
            async with h.stream("POST", f"{url}/v1/completions", json=body,
                                timeout=httpx.Timeout(600, connect=5)) as r:
                self.replica = r.headers.get("x-jetrouter-replica")
                if r.status_code != 200:
                    self.error = f"HTTP {r.status_code}"
                    return
                async for line in r.aiter_lines():
                    if line == "data: [DONE]":
                        self.done = True
                    elif line.startswith("data: "):
                        for choice in json.loads(line[6:]).get("choices", []):
                            self.text += choice.get("text", "")
                        self.first_token.set()
        except httpx.TransportError as exc:
            self.error = repr(exc)
        finally:
            self.ended_at = time.monotonic()
            self.first_token.set()  # never leave a waiter hanging on a failed stream

    def start(self, h: httpx.AsyncClient, url: str) -> HeldStream:
        self.task = asyncio.create_task(self.run(h, url))
        return self

    @property
    def complete(self) -> bool:
        return self.done and self.error is None and self.text == tokens.decode(
            expected_tokens(self.prompt, self.max_tokens))


async def hold_streams(h: httpx.AsyncClient, url: str, base: int, max_tokens: int
                       ) -> list[HeldStream]:
    """Six streams at once (leastconn puts three on each replica), back once each has a token."""
    held = [HeldStream([base + 100 * k + i for i in range(20)], max_tokens).start(h, url)
            for k in range(6)]
    await asyncio.wait_for(asyncio.gather(*(s.first_token.wait() for s in held)), 60)
    assert [s.error for s in held] == [None] * 6, [s.error for s in held]
    assert {s.replica for s in held} == {"r0", "r1"}, [s.replica for s in held]
    return held


async def test_sigstop_of_a_replica_cuts_its_streams_within_seconds(
        cluster: LocalCluster, balancer: tuple[str, str]) -> None:
    url, stats = balancer
    async with httpx.AsyncClient(timeout=60) as h:
        await both_up(h, stats)
        # ~8 ms a token: seconds of streaming left on every stream when the signal lands.
        held = await hold_streams(h, url, 40_000, 1000)
        paused = [s for s in held if s.replica == "r1"]
        # And answers not streamed, waiting on their whole generation (leastconn: one each).
        whole = [asyncio.create_task(_timed_post(h, url, f"whole {i}")) for i in range(2)]
        await until(lambda: h.get(stats), lambda r: _field(r.text, "r0", "scur") == "4"
                    and _field(r.text, "r1", "scur") == "4", timeout=30, interval=0.02,
                    what="four sessions on each replica")
        stopped_at = time.monotonic()
        cluster.kill("r1", signal.SIGSTOP)
        try:
            await until(lambda: h.get(stats), lambda r: _status(r.text, "r1").startswith(
                "DOWN"), timeout=30, interval=0.02, what="paused r1 marked DOWN")
            marked_down = time.monotonic() - stopped_at
            # Cut by the balancer, not left to wait for SIGCONT or `timeout server` (10 min).
            await asyncio.wait_for(asyncio.gather(*(s.task for s in paused if s.task)), 30)
            cut = max(s.ended_at for s in paused) - stopped_at
            assert all(s.error and not s.done for s in paused), [(s.error, s.done)
                                                                for s in paused]
            # New requests go to the replica that answers; its own streams are untouched.
            fresh = await h.post(f"{url}/v1/completions",
                                 json={"model": MODEL, "prompt": "after the pause",
                                       "max_tokens": 4})
            assert fresh.status_code == 200, fresh.text
            assert fresh.headers.get("x-jetrouter-replica") == "r0"
            await asyncio.wait_for(asyncio.gather(*(s.task for s in held if s.task)), 120)
            kept = [s for s in held if s.replica == "r0"]
            assert all(s.complete for s in kept), [(s.error, len(s.text)) for s in kept]
            # The one cut on r1 before any byte of answer is retried on r0 (HAProxy counts it
            # in r1's retries) or fails; either way it does not wait for the pause to end.
            outcomes = await asyncio.wait_for(asyncio.gather(*whole), 60)
            retried = _field((await h.get(stats)).text, "r1", "wretr")
        finally:
            cluster.kill("r1", signal.SIGCONT)
    print(f"paused r1 marked DOWN {marked_down:.2f} s after SIGSTOP; its {len(paused)} "
          f"streams cut within {cut:.2f} s; r0's {len(kept)} streams complete; "
          f"not streamed: {[(o, round(t - stopped_at, 2)) for o, t in outcomes]}, "
          f"{retried} retried from r1")


async def test_sigterm_drains_a_replica_its_streams_end_and_new_requests_go_elsewhere(
        cluster: LocalCluster, balancer: tuple[str, str]) -> None:
    url, stats = balancer
    async with httpx.AsyncClient(timeout=60) as h:
        await both_up(h, stats)
        held = await hold_streams(h, url, 50_000, 1500)
        exits_before = cluster.children["r0"].exits
        cluster.kill("r0", signal.SIGTERM)
        # Alive, not ready: drained (NOLB), not down, while its streams run on.
        await until(lambda: h.get(stats), lambda r: _status(r.text, "r0") == "NOLB",
                    timeout=30, interval=0.02, what="draining r0 in NOLB")
        assert not all(s.task.done() for s in held if s.replica == "r0" and s.task)
        fresh = await asyncio.gather(*(h.post(f"{url}/v1/completions",
                                              json={"model": MODEL, "prompt": f"drain {i}",
                                                    "max_tokens": 4}) for i in range(6)))
        assert [r.status_code for r in fresh] == [200] * 6, [r.text[:200] for r in fresh]
        assert {r.headers.get("x-jetrouter-replica") for r in fresh} == {"r1"}
        await asyncio.wait_for(asyncio.gather(*(s.task for s in held if s.task)), 120)
        assert all(s.complete for s in held), [(s.replica, s.error, len(s.text)) for s in held]
        # Its last stream done, it exits (and the cluster restarts it for the next test).
        await until(lambda: cluster.children["r0"].exits, lambda n: n > exits_before,
                    timeout=30, what="r0 exited after its drain")
    print(f"draining r0: NOLB, {len(fresh)} new requests all on r1, "
          f"{sum(s.replica == 'r0' for s in held)} streams on r0 complete")


async def _timed_post(h: httpx.AsyncClient, url: str, prompt: str) -> tuple[str, float]:
    """A long answer, not streamed: (what came back, when)."""
    try:
        r = await h.post(f"{url}/v1/completions", timeout=httpx.Timeout(600, connect=5),
                         json={"model": MODEL, "prompt": prompt, "max_tokens": 1000})
        outcome = f"{r.status_code} {r.headers.get('x-jetrouter-replica')}"
    except httpx.TransportError as exc:
        outcome = type(exc).__name__
    return outcome, time.monotonic()
