"""What the fair-queue end-to-end tests share: a cluster whose one simulated engine computes
prompts slowly enough that every other request waits in its replica's queue (and the fixture of
a module that uses one), and readers of the queue depth and of the router stream."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import nats
import pytest
import pytest_asyncio

from eventlog.events import Event, RequestRouted, decode_batch
from eventlog.names import Names
from launch.local_cluster import LocalCluster
from tests.integration.registered_cluster import registered_cluster


@asynccontextmanager
async def queued_tenant_cluster(data: Path, namespace: str, keys: dict[str, str], *,
                                replicas: int, prefill_ms_per_token: float, workers: int = 1
                                ) -> AsyncIterator[LocalCluster]:
    """``replicas`` replicas and ``workers`` engines at ``prefill_ms_per_token`` (a linear perf
    model); ``keys``: API key -> tenant. A queue threshold of 1e-4 of an engine's batch: while
    a prompt is being computed on every engine, other requests wait in their replica's
    queue."""
    keys_file = data / "keys.yaml"
    keys_file.write_text("".join(f"{key}: {tenant}\n" for key, tenant in keys.items()))
    async with registered_cluster(data, replicas=replicas, workers=workers, namespace=namespace,
                                  router_args=["--api-keys-file", str(keys_file),
                                               "--router-queue-threshold", "0.0001"],
                                  worker_args=["--perf-model", "linear",
                                               "--prefill-ms-per-token",
                                               f"{prefill_ms_per_token:g}"]) as c:
        yield c


def queued_tenant_cluster_fixture(namespace: str, keys: dict[str, str], *, replicas: int,
                                  prefill_ms_per_token: float, workers: int = 1) -> Any:
    """A test module's ``cluster`` fixture: one ``queued_tenant_cluster`` for the module, under
    a temporary folder named after ``namespace``."""

    @pytest_asyncio.fixture(loop_scope="module", scope="module", name="cluster")
    async def cluster(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[LocalCluster]:
        async with queued_tenant_cluster(Path(tmp_path_factory.mktemp(namespace)), namespace,
                                         keys, replicas=replicas, workers=workers,
                                         prefill_ms_per_token=prefill_ms_per_token) as c:
            yield c

    return cluster


async def queue_depth(h: httpx.AsyncClient, url: str) -> float:
    """The replica's ``jetrouter_queue_depth`` (-1 if it is missing)."""
    for line in (await h.get(f"{url}/metrics")).text.splitlines():
        if line.startswith("jetrouter_queue_depth "):
            return float(line.split()[1])
    return -1.0


async def router_events(c: LocalCluster, namespace: str) -> list[Event]:
    """Every event on the router stream, in stream order."""
    nc = await nats.connect(c.nats_url)
    try:
        js = nc.jetstream()
        stream = Names(namespace).stream("router")
        info = await js.stream_info(stream)
        out: list[Event] = []
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            out.extend(decode_batch((await js.get_msg(stream, seq)).data))
        return out
    finally:
        await nc.close()


async def decisions(c: LocalCluster, namespace: str) -> list[RequestRouted]:
    """The router stream's decisions, in stream order."""
    return [e for e in await router_events(c, namespace) if isinstance(e, RequestRouted)]
