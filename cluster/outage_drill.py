"""A whole-NATS outage, measured: `python -m cluster.outage_drill`.

Starts the cluster `jetrouter up --nats-cluster 3 --replicas 2 --workers 2` starts (as local
processes), sends a steady open-loop rate of completions (20 req/s by default, round-robin over
the replicas, each request independent of the others' answers), SIGKILLs every nats-server at
once, keeps them down for ``--down`` seconds while reading each replica's `/ready` every 0.5 s,
then starts them again on the same ports with their data (``--restart data``), with their store
directories wiped (``--restart empty``), or not at all (``--restart none``). Prints, per phase
(before, during, after the outage), requests ok and failed and what `/ready` said, and after the
restart how long until every replica left degraded mode and their digests agreed.

It gives the figure an operator asks for ("N of M requests failed while NATS was down") in a
repeatable way; the pass/fail checks live in `jetrouter chaos` and the tests.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from launch.local_cluster import LocalCluster

MODEL = "jetrouter-sim"


@dataclass(slots=True)
class Shot:
    sent: float
    phase: str
    status: str = "pending"


@dataclass
class Pacer:
    """Open-loop load: one request every ``1 / rate`` seconds, whatever the answers."""

    urls: list[str]
    rate: float
    shots: list[Shot] = field(default_factory=list)
    phase: str = "before"
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    async def run(self, client: httpx.AsyncClient, stop: asyncio.Event) -> None:
        period = 1.0 / self.rate
        start = time.monotonic()
        k = 0
        while not stop.is_set():
            due = start + k * period
            delay = due - time.monotonic()
            if delay > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), delay)  # pacing, not synchronisation
                continue
            shot = Shot(time.monotonic(), self.phase)
            self.shots.append(shot)
            task = asyncio.create_task(self._one(client, self.urls[k % len(self.urls)], k, shot))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            k += 1
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=60)

    async def _one(self, client: httpx.AsyncClient, url: str, k: int, shot: Shot) -> None:
        prefix = list(range(1000 * (k % 5), 1000 * (k % 5) + 96))  # shared 16-token blocks
        body = {"model": MODEL, "prompt": [*prefix, k % 997, k % 13, 7], "max_tokens": 12}
        try:
            r = await client.post(url + "/v1/completions", json=body, timeout=30)
            shot.status = "ok" if r.status_code == 200 else f"HTTP {r.status_code}"
        except httpx.HTTPError as exc:
            shot.status = type(exc).__name__


async def _ready_view(client: httpx.AsyncClient, url: str) -> str:
    try:
        r = await client.get(url + "/ready", timeout=1.0)
    except httpx.HTTPError as exc:
        return type(exc).__name__
    body = r.json()
    return f"{r.status_code} degraded={bool(body.get('degraded'))}"


async def _states(client: httpx.AsyncClient, cluster: LocalCluster) -> list[dict[str, Any]]:
    auth = {"authorization": f"Bearer {cluster.admin_token}"}
    out = []
    for url in cluster.router_urls:
        r = await client.get(url + "/admin/state", headers=auth, timeout=2.0)
        out.append(r.json())
    return out


async def drill(args: argparse.Namespace, data_dir: Path) -> int:
    cluster = LocalCluster(replicas=2, workers=2, nats_cluster=3,
                           data_dir=data_dir, ready_timeout=120.0)
    async with cluster, httpx.AsyncClient() as client:
        nats = cluster._nats  # the embedded NatsCluster (no public accessor)
        pacer = Pacer(cluster.router_urls, args.rate)
        stop = asyncio.Event()
        load = asyncio.create_task(pacer.run(client, stop))
        readies: Counter[str] = Counter()
        await asyncio.sleep(args.warmup)  # the drill's own timeline: steady load before the kill
        pacer.phase = "during"
        t_kill = time.monotonic()
        for server in nats.servers:
            server.kill()  # SIGKILL, every node
        print(f"outage_drill: every nats-server SIGKILLed at +{args.warmup:.0f}s",
              file=sys.stderr)
        while time.monotonic() - t_kill < args.down:
            for url in cluster.router_urls:
                readies[f"{url} {await _ready_view(client, url)}"] += 1
            await asyncio.sleep(0.5)  # sampling /ready while the outage lasts
        recovered: float | None = None
        if args.restart != "none":
            pacer.phase = "after"
            if args.restart == "empty":
                for server in nats.servers:
                    shutil.rmtree(server.store_dir, ignore_errors=True)
                    server.store_dir.mkdir(parents=True)
            t_back = time.monotonic()
            for server in nats.servers:
                server.launch()
            await asyncio.to_thread(nats.wait_ready, 60.0)
            deadline = t_back + args.recovery_timeout
            while time.monotonic() < deadline:
                with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                    states = await _states(client, cluster)
                    digests = {s["digests"]["state"] for s in states}
                    positions = {tuple(sorted(s["positions"].items())) for s in states}
                    if (len(digests) == 1 and len(positions) == 1
                            and not any(s["event_log"]["degraded"] for s in states)):
                        recovered = time.monotonic() - t_back
                        break
                await asyncio.sleep(0.25)
            await asyncio.sleep(args.settle)  # steady load after recovery, counted as "after"
        stop.set()
        await load
    by_phase: dict[str, Counter[str]] = {}
    for shot in pacer.shots:
        by_phase.setdefault(shot.phase, Counter())[shot.status] += 1
    for phase in ("before", "during", "after"):
        if phase in by_phase:
            counts = by_phase[phase]
            ok = counts.get("ok", 0)
            print(f"{phase:7s} ok={ok} failed={sum(counts.values()) - ok} {dict(counts)}")
    print("/ready while NATS was down (samples):")
    for line, n in sorted(readies.items()):
        print(f"  {n:4d}  {line}")
    if args.restart != "none":
        print("recovered (every replica out of degraded mode, equal positions and digests): "
              + ("NO" if recovered is None else f"{recovered:.1f}s after the restart"))
    return 0 if args.restart == "none" or recovered is not None else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cluster.outage_drill", description=__doc__)
    p.add_argument("--rate", type=float, default=20.0, help="requests per second (default 20)")
    p.add_argument("--warmup", type=float, default=10.0, help="seconds of load before the kill")
    p.add_argument("--down", type=float, default=30.0, help="seconds every nats-server is down")
    p.add_argument("--restart", choices=("data", "empty", "none"), default="data")
    p.add_argument("--settle", type=float, default=5.0, help="seconds of load after recovery")
    p.add_argument("--recovery-timeout", type=float, default=120.0)
    p.add_argument("--data-dir", type=Path, default=None)
    args = p.parse_args(argv)
    if args.data_dir is not None:
        args.data_dir.mkdir(parents=True, exist_ok=True)
        return asyncio.run(drill(args, args.data_dir))
    with tempfile.TemporaryDirectory(prefix="jetrouter-outage-") as tmp:
        return asyncio.run(drill(args, Path(tmp)))


if __name__ == "__main__":
    sys.exit(main())
