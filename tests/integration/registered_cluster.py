"""A local cluster that has applied its engines' registrations on every replica before a test
uses it, the replicas' admin view of the engines, and an engine run beside the cluster outside
its supervision, for the end-to-end tests."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx

from launch.local_cluster import LocalCluster
from tests.waiting import until


def admin(c: LocalCluster) -> dict[str, str]:
    """The headers of an admin API call."""
    return {"authorization": f"Bearer {c.admin_token}"}


async def workers(h: httpx.AsyncClient, c: LocalCluster, url: str) -> dict[str, dict[str, Any]]:
    """The engines the replica at ``url`` lists, by worker id."""
    r = await h.get(f"{url}/admin/workers", headers=admin(c))
    return {w["worker_id"]: w for w in r.json()["workers"]}


@asynccontextmanager
async def registered_cluster(data: Path, **options: Any) -> AsyncIterator[LocalCluster]:
    """``LocalCluster(data_dir=data, **options)`` started, once every replica lists every engine
    (those of every role)."""
    async with LocalCluster(data_dir=data, **options) as c:
        async with httpx.AsyncClient(timeout=30) as h:
            for url in c.router_urls:
                await until(lambda url=url: workers(h, c, url), lambda ws: len(ws) == c.workers,
                            what="every engine registered")
        yield c


@asynccontextmanager
async def unsupervised_engine(c: LocalCluster, worker_id: str, log_dir: Path,
                              *args: str) -> AsyncIterator[asyncio.subprocess.Process]:
    """A simulated engine ``worker_id`` on ``c``'s NATS and namespace, ``args`` added to its
    command line, run outside the cluster's supervision (so it stays gone once stopped): its
    process, SIGKILLed on the way out if it still runs. Its output goes to
    ``log_dir/<worker_id>.log``."""
    with open(log_dir / f"{worker_id}.log", "wb") as out:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "api.cli", "worker", "--worker-id", worker_id, "--port", "0",
            "--nats-url", c.nats_url, "--namespace", c.namespace, *args,
            stdout=out, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGKILL)
        await proc.wait()
