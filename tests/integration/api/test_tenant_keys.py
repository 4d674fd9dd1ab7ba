"""API keys set through the admin API: replicated as SHA-256 digests, enforced by every replica
once one exists, revoked fleet-wide, kept by snapshots; 2 router replicas + 1 simulated engine as
real processes on a real nats-server, no keys file, driven with the official openai client and
the `jetrouter admin keys` command."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import nats
import openai
import pytest
import pytest_asyncio

from eventlog.names import STREAM_KINDS, Names
from launch.local_cluster import LocalCluster
from tests.waiting import until

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(180)]
MODEL = "jetrouter-sim"
NAMESPACE = "keys"


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def cluster(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[LocalCluster]:
    data = Path(tmp_path_factory.mktemp("tenant-keys"))
    async with LocalCluster(replicas=2, workers=1, data_dir=data, namespace=NAMESPACE) as c:
        yield c


def admin(c: LocalCluster) -> dict[str, str]:
    return {"authorization": f"Bearer {c.admin_token}"}


async def complete(c: LocalCluster, i: int, key: str) -> str:
    """The outcome of one completion at replica ``i`` with ``key``: "ok" or the error code."""
    client = openai.AsyncOpenAI(base_url=c.router_urls[i] + "/v1", api_key=key, max_retries=0)
    try:
        await client.completions.create(model=MODEL, prompt="hello", max_tokens=2)
    except openai.AuthenticationError as exc:
        return str(exc.code)
    finally:
        await client.close()
    return "ok"


async def test_keys_from_the_admin_api_are_enforced_everywhere_and_never_stored(
        cluster: LocalCluster) -> None:
    # No key exists: nobody is asked for one (the behaviour without tenants).
    assert await complete(cluster, 0, "anything") == "ok"
    async with httpx.AsyncClient(timeout=30) as h:
        r = await h.post(f"{cluster.router_urls[0]}/admin/tenants/acme/keys",
                         headers=admin(cluster))
        assert r.status_code == 201, r.text
        made = r.json()
        key, key_id = made["key"], made["key_id"]
        assert made["tenant"] == "acme" and key.startswith("sk-jr-")
        # Replicated: the other replica knows the key too, and now refuses the keyless.
        for i in (1, 0):
            assert await until(lambda i=i: complete(cluster, i, "anything"),
                               lambda out: out == "invalid_api_key") == "invalid_api_key"
            assert await complete(cluster, i, key) == "ok"
        listed = (await h.get(f"{cluster.router_urls[1]}/admin/tenants/acme/keys",
                              headers=admin(cluster))).json()
        assert listed == {"tenant": "acme", "keys": [{"key_id": key_id}]}
        doc = (await h.get(f"{cluster.router_urls[1]}/admin/tenants/acme",
                           headers=admin(cluster))).json()
        assert doc["api_keys"] == 1
        # The key is in no stream message, only its digest is.
        assert not await streams_contain(cluster, key.encode())
        # The same key cannot name a second tenant; a bad body is one clear 400.
        taken = await h.post(f"{cluster.router_urls[0]}/admin/tenants/other/keys",
                             json={"key": key}, headers=admin(cluster))
        assert taken.status_code == 409, taken.text
        short = await h.post(f"{cluster.router_urls[0]}/admin/tenants/other/keys",
                             json={"key": "short"}, headers=admin(cluster))
        assert short.status_code == 400 and short.json()["error"]["param"] == "key"
        # Revoked on one replica: refused on both.
        r = await h.delete(f"{cluster.router_urls[1]}/admin/api-keys/{key_id}",
                           headers=admin(cluster))
        assert r.status_code == 200 and r.json()["revoked"], r.text
        for i in (0, 1):
            await until(lambda i=i: complete(cluster, i, key), lambda out: out == "ok",
                        what="no key left: open again")
        assert (await h.delete(f"{cluster.router_urls[0]}/admin/api-keys/{key_id}",
                               headers=admin(cluster))).status_code == 404


async def streams_contain(c: LocalCluster, needle: bytes) -> bool:
    nc = await nats.connect(c.nats_url)
    try:
        js = nc.jetstream()
        for kind in STREAM_KINDS:
            stream = Names(NAMESPACE).stream(kind)
            info = await js.stream_info(stream)
            for seq in range(info.state.first_seq, info.state.last_seq + 1):
                try:
                    msg = await js.get_msg(stream, seq)
                except nats.js.errors.NotFoundError:
                    continue
                if needle in (msg.data or b""):
                    return True
    finally:
        await nc.close()
    return False


async def test_cli_adds_lists_and_revokes_and_a_snapshot_keeps_the_keys(
        cluster: LocalCluster) -> None:
    def admin_cli(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "api.cli", "admin", "--cluster-file",
             str(cluster.cluster_json_path), *argv],
            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)

    brought = "sk-existing-key-of-beta-0123456789"
    added = await asyncio.to_thread(admin_cli, "keys", "add", "beta", "--key", brought)
    assert added.returncode == 0, added.stderr
    assert brought in added.stdout and "shown only this once" in added.stdout
    listed = await asyncio.to_thread(admin_cli, "keys", "beta")
    assert listed.returncode == 0 and "key_id" in listed.stdout, listed.stderr
    key_id = listed.stdout.split()[-1]
    async with httpx.AsyncClient(timeout=60) as h:
        # Snapshot, then SIGKILL r1: restored from it (plus the tail), it still knows the key.
        r = await h.post(f"{cluster.router_urls[0]}/admin/snapshot", headers=admin(cluster))
        assert r.status_code == 200, r.text
        cluster.kill("r1")
        await cluster.wait_ready(["r1"], timeout=60)
        assert await complete(cluster, 1, "anything") == "invalid_api_key"
        assert await complete(cluster, 1, brought) == "ok"
    revoked = await asyncio.to_thread(admin_cli, "keys", "revoke", key_id)
    assert revoked.returncode == 0 and "revoked" in revoked.stdout, revoked.stderr
    again = await asyncio.to_thread(admin_cli, "keys", "revoke", key_id)
    assert again.returncode == 1 and "no API key" in again.stderr
    for i in (0, 1):
        await until(lambda i=i: complete(cluster, i, "anything"), lambda out: out == "ok")
