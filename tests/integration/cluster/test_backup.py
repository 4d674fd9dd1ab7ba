"""`jetrouter admin export` / `import` end to end: a real cluster (nats-server, 2 replicas, 2
simulated engines as processes) routes requests and takes a snapshot; the CLI exports it; a
fresh, empty nats-server gets the import; replicas started on it reach the same positions and
the same state digests the first cluster had."""

from __future__ import annotations

import asyncio
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import nats
import pytest

from eventlog.names import STREAM_KINDS, Names
from eventlog.streams import stream_bounds
from launch.local_cluster import LocalCluster
from natsops.server import NatsServer
from tests.waiting import until

pytestmark = pytest.mark.timeout(240)
NS = "bk"
MODEL = "jetrouter-sim"
REPO = Path(__file__).resolve().parents[3]
# Replicas of the restored cluster must append nothing of their own before the digests are
# compared: no canaries, and engines (gone with the first cluster) are not retired meanwhile.
QUIET = ["--canary-interval", "0", "--worker-timeout", "600"]


async def _cli(*argv: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "api.cli", "admin", *argv, cwd=str(REPO),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": str(REPO)})
    out, _ = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode is not None
    return proc.returncode, out.decode()


async def _lasts(url: str) -> dict[str, int]:
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        return {k: (await stream_bounds(js, Names(NS).stream(k)))[1] for k in STREAM_KINDS}
    finally:
        await nc.close()


@dataclass(frozen=True)
class Settled:
    """What the replicas showed: their one state digest at the streams' ends ``lasts`` (None
    when they were not all there, with ``why``)."""

    digests: dict[str, Any] | None
    lasts: dict[str, int]
    why: str = ""


async def _settled(h: httpx.AsyncClient, c: LocalCluster, lasts: dict[str, int] | None = None
                   ) -> Settled:
    """Every replica ready at ``lasts`` (default: the streams' ends read now) with one state
    digest."""
    if lasts is None:
        lasts = await _lasts(c.nats_url)
    auth = {"authorization": f"Bearer {c.admin_token}"}
    states = [(await h.get(f"{u}/admin/state", headers=auth)).json() for u in c.router_urls]
    seen = [(s["ready"], s["positions"], s["digests"]["state"]) for s in states]
    if all(s["ready"] and s["positions"] == lasts for s in states) and \
            len({s["digests"]["state"] for s in states}) == 1:
        return Settled(states[0]["digests"], lasts)
    return Settled(None, lasts, f"replicas (ready, positions, digest): {seen}")


def _found(s: Settled) -> bool:
    return s.digests is not None


async def _route(h: httpx.AsyncClient, c: LocalCluster, n: int, offset: int) -> None:
    for i in range(n):
        url = c.router_urls[i % len(c.router_urls)]
        prompt = list(range(100, 100 + 48)) + [offset + i] * 20  # shared prefix, own tail
        r = await h.post(f"{url}/v1/completions",
                         json={"model": MODEL, "prompt": prompt, "max_tokens": 4})
        assert r.status_code == 200, r.text


async def test_export_then_import_into_an_empty_nats_gives_equal_digests(tmp_path: Path) -> None:
    backup = tmp_path / "cluster.jrb"
    async with httpx.AsyncClient(timeout=30) as h:
        async with LocalCluster(replicas=2, workers=2, data_dir=tmp_path / "a", namespace=NS,
                                router_args=QUIET,
                                worker_args=["--num-gpu-blocks", "2048"]) as c:
            auth = {"authorization": f"Bearer {c.admin_token}"}
            await _route(h, c, 12, 0)
            r = await h.post(f"{c.router_urls[0]}/admin/snapshot", headers=auth)
            assert r.status_code == 200, r.text
            await _route(h, c, 12, 1000)  # messages after the snapshot too
            # A request's end is appended after its answer went out, and the export must hold
            # what the digests were taken at: settle, export, and again if the streams grew
            # meanwhile.
            for _ in range(5):
                settled = await until(lambda: _settled(h, c), ok=_found, timeout=60,
                                      what="replicas settled on one digest at the streams' ends")
                code, out = await _cli("export", str(backup), "--nats-url", c.nats_url,
                                       "--namespace", NS)
                assert code == 0, out
                assert "snapshot snap-" in out, out
                if await _lasts(c.nats_url) == settled.lasts:
                    break
            else:
                raise AssertionError("the streams kept growing after the requests were served")
            before, lasts = settled.digests, settled.lasts

        fresh = NatsServer(store_dir=tmp_path / "empty-nats").start(timeout=60)
        try:
            code, out = await _cli("import", str(backup), "--nats-url", fresh.url)
            assert code == 0, out
            assert await _lasts(fresh.url) == lasts
            code, out = await _cli("import", str(backup), "--nats-url", fresh.url)
            assert code == 1 and "import needs an empty NATS" in out, out
            async with LocalCluster(replicas=2, workers=0, data_dir=tmp_path / "b",
                                    namespace=NS, nats_url=fresh.url,
                                    router_args=QUIET) as restored:
                after = await until(lambda: _settled(h, restored, lasts), ok=_found,
                                    timeout=60, what="restored replicas at the exported positions")
                assert after.digests == before
                auth = {"authorization": f"Bearer {restored.admin_token}"}
                state = (await h.get(f"{restored.router_urls[0]}/admin/state",
                                     headers=auth)).json()
                assert state["restores"] >= 1  # it started from the imported snapshot
        finally:
            fresh.cleanup()


async def test_a_file_that_is_not_a_backup_is_one_clear_line(tmp_path: Path,
                                                             nats_url: str) -> None:
    bogus = tmp_path / "not-a-backup"
    bogus.write_bytes(b"hello")
    code, out = await _cli("import", str(bogus), "--nats-url", nats_url, "--namespace", NS)
    assert code != 0 and out.count("\n") == 1 and "error:" in out, out
