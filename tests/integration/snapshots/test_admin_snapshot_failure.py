"""POST /admin/snapshot when JetStream cannot take the snapshot: the admin gets a 503 that names
what failed (never a bare 500) and the replica keeps serving. A real local cluster (nats-server,
one replica, one simulated worker)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import nats
import pytest
import pytest_asyncio

from eventlog.names import Names
from launch.local_cluster import LocalCluster
from tests.waiting import until

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]
TOKEN = "snapfail-admin-token"


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def cluster(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[LocalCluster]:
    data: Path = tmp_path_factory.mktemp("snapshot-failure")
    async with LocalCluster(replicas=1, workers=1, data_dir=data, namespace="snf",
                            admin_token=TOKEN) as c:
        yield c


async def test_a_failed_snapshot_is_a_503_naming_the_cause(cluster: LocalCluster) -> None:
    auth = {"authorization": f"Bearer {TOKEN}"}
    url = cluster.router_urls[0]
    async with httpx.AsyncClient(timeout=60) as h:
        first = await until(lambda: h.post(url + "/admin/snapshot", headers=auth),
                            lambda r: r.status_code == 200, what="a first snapshot")
        assert first.json()["snapshot_id"]

        # An operator removes the snapshot bucket out from under the leader.
        nc = await nats.connect(cluster.nats_url)
        try:
            await nc.jetstream().delete_object_store(Names("snf").snapshot_bucket)
        finally:
            await nc.close()

        failed = await h.post(url + "/admin/snapshot", headers=auth)
        assert failed.status_code == 503, failed.text
        body = failed.json()
        text = str(body)
        assert "snapshot failed on the leader" in text
        # The replica still serves inference.
        r = await h.post(url + "/v1/completions",
                         json={"model": "jetrouter-sim", "prompt": "hello", "max_tokens": 2})
        assert r.status_code == 200, r.text
