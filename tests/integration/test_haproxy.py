"""deploy/haproxy.cfg in front of real replicas: a SIGKILLed replica costs no request.

The balancer config compose.yaml mounts, with only the addresses changed for loopback (backend
servers, the bind port; Docker's resolver section dropped), run by a real `haproxy` in front of
a LocalCluster. Requests in flight on the replica that is killed were sent to it, got no byte
back, and are retried on the other one (`retry-on empty-response`, `option redispatch`); the
health checks take the dead replica out of rotation. Skipped where no haproxy binary exists.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from cluster.up import LocalCluster
from eventlog.server import free_port
from tests.waiting import until

HAPROXY = shutil.which("haproxy")
pytestmark = [pytest.mark.skipif(HAPROXY is None, reason="no haproxy binary"),
              pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(240)]
ROOT = Path(__file__).resolve().parents[2]
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
    assert "inter 250ms" in text and "empty-response" in text  # the real rules are kept
    return text + (f"\nfrontend stats\n    bind 127.0.0.1:{stats_port}\n    stats enable\n"
                   "    stats uri /stats\n")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def cluster(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[LocalCluster]:
    data = tmp_path_factory.mktemp("lb")
    async with LocalCluster(replicas=2, workers=2, data_dir=Path(data), namespace="lb",
                            restart=False) as c:
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


def _status(csv: str, server: str) -> str:
    header = csv.lstrip("# ").splitlines()[0].split(",")
    for line in csv.splitlines()[1:]:
        row = dict(zip(header, line.split(","), strict=False))
        if row.get("pxname") == "routers" and row.get("svname") == server:
            return row.get("status", "")
    return ""


async def test_sigkill_of_a_replica_fails_no_request(cluster: LocalCluster,
                                                     balancer: tuple[str, str]) -> None:
    url, stats = balancer
    async with httpx.AsyncClient(timeout=120) as h:
        await until(lambda: h.get(stats), lambda r: _status(r.text, "r0") == "UP"
                    and _status(r.text, "r1") == "UP", timeout=60, what="both replicas UP",
                    tolerate=(httpx.HTTPError,))  # haproxy still binding

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
