"""Format versions on a real cluster: a message in a newer format stops its stream on the
replica, loudly (log line, /ready, /admin/state, metric), while the other streams go on; and
`jetrouter admin replicas` shows each replica's release and formats."""

from __future__ import annotations

import asyncio
import importlib.metadata
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import nats
import pytest
import pytest_asyncio

from eventlog import events as ev
from eventlog import wire
from eventlog.names import CONTROL, Names
from launch.local_cluster import LocalCluster
from natsops.server import NatsServer
from replicas.core.state import RouterState
from replicas.core.state_codec import SNAPSHOT_FORMAT
from snapshots.store import SnapshotStore
from tests.waiting import until

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]
NS = "fmt"
REPO = Path(__file__).resolve().parents[3]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def cluster(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[LocalCluster]:
    data = tmp_path_factory.mktemp("fmt")
    async with LocalCluster(replicas=2, workers=1, data_dir=Path(data), namespace=NS,
                            router_args=["--canary-interval", "0"]) as c:
        yield c


def _auth(c: LocalCluster) -> dict[str, str]:
    return {"authorization": f"Bearer {c.admin_token}"}


async def test_admin_replicas_shows_each_replicas_version_and_formats(
        cluster: LocalCluster) -> None:
    version = importlib.metadata.version("jetrouter")
    async with httpx.AsyncClient(timeout=10) as h:
        async def rows() -> list[dict[str, object]]:
            r = await h.get(f"{cluster.router_urls[0]}/admin/replicas", headers=_auth(cluster))
            return list(r.json()["replicas"])

        got = await until(rows, lambda rs: len(rs) == 2, what="both replicas listed")
    formats = {"events": wire.EVENT_FORMAT, "snapshots": SNAPSHOT_FORMAT}
    assert all(r["version"] == version and r["formats"] == formats for r in got), got
    # The CLI asks the replica already seen listing both (a peer's first heartbeat reaches
    # each replica at its own time).
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "api.cli", "admin", "--url", cluster.router_urls[0], "--token",
        cluster.admin_token, "replicas", cwd=str(REPO), stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(REPO)})
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    text = out.decode()
    assert proc.returncode == 0 and "version" in text.splitlines()[0], text
    assert text.count(version) == 2, text


async def test_a_newer_format_blocks_the_stream_and_says_so(cluster: LocalCluster) -> None:
    victim = cluster.router_urls[1]
    nc = await nats.connect(cluster.nats_url)
    try:
        js = nc.jetstream()
        subject = Names(NS).control_subject("snapshot-threshold")
        newer = str(wire.EVENT_FORMAT + 1)
        blocked_at = (await js.publish(subject, ev.encode_batch(
            [ev.SnapshotThresholdSet(777, 1.0)]), headers={wire.FORMAT_HEADER: newer})).seq
        await js.publish(subject, ev.encode_batch([ev.SnapshotThresholdSet(888, 2.0)]))
    finally:
        await nc.close()
    async with httpx.AsyncClient(timeout=10) as h:
        ready = await until(lambda: h.get(f"{victim}/ready"), lambda r: r.status_code == 503,
                            what="replica not ready")
        assert CONTROL in ready.json()["blocked_streams"], ready.text
        state = (await h.get(f"{victim}/admin/state", headers=_auth(cluster))).json()
        assert f"format {newer}" in state["blocked_streams"][CONTROL]
        assert state["positions"][CONTROL] == blocked_at - 1  # neither applied nor skipped
        assert state["malformed_messages"][CONTROL] == 0
        metrics = (await h.get(f"{victim}/metrics")).text
        assert f'jetrouter_stream_blocked{{stream="{CONTROL}"}} 1.0' in metrics
        # A load balancer's check drains it too.
        assert (await h.get(f"{victim}/ready/balancer")).status_code == 404
    log = cluster.children["r1"].log_path.read_text()
    assert f"STREAM {NS.upper()}_CONTROL BLOCKED on replica r1" in log, log[-2000:]


async def test_a_snapshot_in_a_newer_format_is_passed_over_for_the_one_before(
        nats_server: NatsServer) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        store = SnapshotStore(nc.jetstream(), Names("snapfmt"))
        state = RouterState()
        older = await store.put(state.encode(), positions=dict(state.positions), epoch=0,
                                created_by="old", trigger="test")
        newer = await store.put(b"a newer release's state", positions=dict(state.positions),
                                epoch=0, created_by="new", trigger="test",
                                format=SNAPSHOT_FORMAT + 1)
        assert (await store.list())[0].snapshot_id == newer.snapshot_id
        loaded = await store.load_newest_valid()
        assert loaded is not None and loaded.meta.snapshot_id == older.snapshot_id
        assert loaded.skipped == [(newer.snapshot_id, f"newer format {SNAPSHOT_FORMAT + 1}")]
    finally:
        await nc.close()
