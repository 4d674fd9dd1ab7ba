"""NATS locked down (design.md §12): a real nats-server with TLS, users and per-role permissions.

The cluster is `jetrouter up --secure` (LocalCluster(secure=True)): a private CA and server
certificate made with openssl, one password per identity, the server configuration rendered by
natsops/natsconf.py — the same code that renders deploy/nats/. Real replica, projector and
engine processes, each connected as its own identity.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import nkeys
import pytest
import pytest_asyncio

from eventlog.appender import Appender, AppendFailed
from eventlog.connect import NatsConnectFatal, NatsOptions, connect
from eventlog.events import BlocksStored
from eventlog.names import Names
from eventlog.streams import ensure_streams
from launch.local_cluster import LocalCluster
from natsops.natsconf import Identity, ServerTls, render
from natsops.pki import Pki
from natsops.server import NatsServer
from tests.waiting import until

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(180),
              pytest.mark.skipif(shutil.which("openssl") is None,
                                 reason="the certificates are made with the openssl CLI")]
REPO = Path(__file__).resolve().parents[3]
MODEL = "jetrouter-sim"
NAMES = Names("jr")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def secured(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[LocalCluster]:
    data = tmp_path_factory.mktemp("secured")
    # No canaries: a canary prompt stores blocks on an engine whenever its round comes, which
    # would move the index digest the forgery test compares before and after.
    async with LocalCluster(replicas=1, workers=2, data_dir=Path(data), secure=True,
                            worker_args=["--num-gpu-blocks", "1024"],
                            router_args=["--canary-interval", "0"]) as c:
        async with httpx.AsyncClient() as h:
            await until(lambda: _state(h, c), lambda s: s["workers"] == 2, timeout=60,
                        what="both engines registered on the replica")
        yield c


def _admin(c: LocalCluster) -> dict[str, str]:
    return {"authorization": f"Bearer {c.admin_token}"}


async def _state(h: httpx.AsyncClient, c: LocalCluster) -> dict:
    r = await h.get(f"{c.router_urls[0]}/admin/state", headers=_admin(c))
    return r.json()


def _violations(c: LocalCluster, user: str) -> list[str]:
    log = (c.data_dir / "nats" / "nats-server.log").read_text(errors="replace")
    return [ln for ln in log.splitlines() if "Violation" in ln and f"user:{user}\"" in ln]


async def test_secured_cluster_routes_a_completion_and_snapshots(secured: LocalCluster) -> None:
    c = secured
    assert c.nats_url.startswith("tls://")
    cfg = (c.data_dir / "secure" / "nats.conf").read_text()
    assert "permissions" in cfg and "tls {" in cfg
    async with httpx.AsyncClient(timeout=30) as h:
        r = await h.post(f"{c.router_urls[0]}/v1/completions",
                         json={"model": MODEL, "prompt": "secured hello", "max_tokens": 4})
        assert r.status_code == 200, r.text
        assert r.headers["x-jetrouter-worker"] in {"w0", "w1"}
        # The leader's duties under the replica identity: blob into the object store,
        # SnapshotTaken on the control stream, catalog row written by the projector child.
        snap = await h.post(f"{c.router_urls[0]}/admin/snapshot", headers=_admin(c))
        assert snap.status_code == 200, snap.text
        sid = snap.json()["snapshot_id"]
        await until(lambda: h.get(f"{c.router_urls[0]}/admin/snapshots", headers=_admin(c)),
                    lambda resp: sid in resp.text, what="the projector catalogued the snapshot")
    # Every process worked within its permissions (engines may have tried once to create the
    # KV stream before the replica did: refused, and they waited for it).
    assert _violations(c, "r0") == []
    for w in ("w0", "w1"):
        assert all("STREAM.CREATE.JR_KV" in ln for ln in _violations(c, w))


async def test_engine_cannot_speak_for_another_worker(secured: LocalCluster) -> None:
    c = secured
    async with httpx.AsyncClient(timeout=30) as h:
        before = await _state(h, c)
    refused: list[str] = []

    async def on_error(exc: Exception) -> None:
        refused.append(str(exc))

    nc = await connect(c.child_nats_options("w1"), name="forger", error_cb=on_error)
    try:
        js = nc.jetstream()
        forged = BlocksStored("w0", 10_000, 0, None, [(1, 2), (3, 4)], 1.0)
        # 1) On w0's own subject: the server refuses the publish (no ack ever comes).
        with pytest.raises(AppendFailed):
            await Appender(js, timeout=1.0, attempts=1).append(
                NAMES.kv_subject("w0"), [forged], "forged-1")
        await until(lambda: refused, what="a permissions violation reported by the server")
        assert "permissions violation" in refused[0].lower() and "jr.kv.w0" in refused[0]
        # 2) On its own subject, claiming to be w0: stored (w1 may publish there), but every
        # reader refuses a message that speaks for another worker than its subject names.
        seq = await Appender(js).append(NAMES.kv_subject("w1"), [forged], "forged-2")
    finally:
        await nc.close()
    async with httpx.AsyncClient(timeout=30) as h:
        after = await until(lambda: _state(h, c), lambda s: s["positions"]["kv"] >= seq,
                            what="the replica read past the forged message")
    assert after["digests"]["index"] == before["digests"]["index"]
    assert after["workers"] == before["workers"] == 2


async def test_replica_with_a_wrong_password_fails_fast_with_one_line(
        secured: LocalCluster, tmp_path: Path) -> None:
    c = secured
    wrong = tmp_path / "wrong.password"
    wrong.write_text("not-the-password\n")
    ca = c.secure_setup.ca_file
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("JETROUTER_NATS_PASSWORD", None)
    cmd = [sys.executable, "-m", "api.cli", "serve", "--port", "0", "--replica-id", "r0",
           "--nats-url", c.nats_url, "--nats-user", "r0", "--nats-password-file", str(wrong),
           "--nats-tls-ca", str(ca), "--data-dir", str(tmp_path / "r")]
    started = time.monotonic()
    proc = await asyncio.to_thread(subprocess.run, cmd, capture_output=True, text=True,
                                   timeout=120, env=env, cwd=REPO)
    took = time.monotonic() - started
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1, proc.stderr
    assert "authorization violation" in lines[0].lower()
    assert "--nats-user" in lines[0] and c.nats_url in lines[0]
    print(f"wrong password: exit 2 after {took:.2f}s: {lines[0]}")


async def test_nkey_engine_with_client_certificate(tmp_path: Path) -> None:
    """The other credential kinds on a server that also verifies client certificates."""
    pki = Pki(tmp_path / "tls")
    pki.create_ca()
    server_cert = pki.issue("server")
    client = pki.issue("client", dns=(), ips=(), client=True)
    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    public = nkeys.from_seed(bytearray(seed)).public_key.decode()
    seed_file = tmp_path / "w9.nk"
    seed_file.write_bytes(seed)
    conf = tmp_path / "nats.conf"
    conf.write_text(render([Identity("admin", "admin", password="admin-pw"),
                            Identity("w9", "engine", "w9", nkey=public)],
                           tls=ServerTls(str(server_cert.cert), str(server_cert.key),
                                         str(pki.ca.cert), verify_clients=True)))
    server = NatsServer(store_dir=tmp_path / "nats", config_file=conf, scheme="tls").start()
    try:
        tls = NatsOptions(servers=(server.url,), tls_ca=str(pki.ca.cert),
                          tls_cert=str(client.cert), tls_key=str(client.key))
        admin = await connect(NatsOptions(**{**_fields(tls), "user": "admin",
                                             "password": "admin-pw"}), name="admin")
        await ensure_streams(admin.jetstream(), NAMES)
        engine = await connect(NatsOptions(**{**_fields(tls), "nkey_seed_file": str(seed_file)}),
                               name="w9")
        event = BlocksStored("w9", 1, 0, None, [(5, 6)], 1.0)
        assert await Appender(engine.jetstream()).append(NAMES.kv_subject("w9"), [event], "a1")
        with pytest.raises(AppendFailed):
            await Appender(engine.jetstream(), timeout=1.0, attempts=1).append(
                NAMES.router_subject("r1"), [event], "a2")
        await engine.close()
        await admin.close()
        # No client certificate: the server ends the handshake; one clear error, no retry loop.
        with pytest.raises(NatsConnectFatal, match="TLS"):
            await asyncio.wait_for(connect(
                NatsOptions(servers=(server.url,), tls_ca=str(pki.ca.cert),
                            nkey_seed_file=str(seed_file)),
                name="no-cert", max_reconnect_attempts=-1), 30)
    finally:
        server.cleanup()


def _fields(options: NatsOptions) -> dict:
    return {f: getattr(options, f) for f in options.__slots__}  # type: ignore[attr-defined]


async def test_bridge_as_an_engine_identity_registers_and_resumes(tmp_path: Path) -> None:
    """`jetrouter bridge` with an engine identity: it registers, appends, and a restarted bridge
    resumes from the last message on its subject, all within the engine permissions."""
    from tests.integration.workers.test_bridge import BridgeProc, prefixes
    from tests.kvengine import EngineSim
    from workers.bridge.resume import H_SEQ

    pki = Pki(tmp_path / "tls")
    pki.create_ca()
    cert = pki.issue("server")
    conf = tmp_path / "nats.conf"
    conf.write_text(render([Identity("admin", "admin", password="admin-pw"),
                            Identity("e1", "engine", "e1", password="e1-pw")],
                           tls=ServerTls(str(cert.cert), str(cert.key), str(pki.ca.cert))))
    (tmp_path / "e1.password").write_text("e1-pw\n")
    server = NatsServer(store_dir=tmp_path / "nats", config_file=conf, scheme="tls").start()
    engine = await EngineSim().start()
    bridge = BridgeProc(engine, server.url, "e1", tmp_path, "--nats-user", "e1",
                        "--nats-password-file", str(tmp_path / "e1.password"),
                        "--nats-tls-ca", str(pki.ca.cert))
    admin = await connect(NatsOptions(servers=(server.url,), user="admin", password="admin-pw",
                                      tls_ca=str(pki.ca.cert)), name="admin")
    try:
        js = admin.jetstream()
        await ensure_streams(js, NAMES)  # the admin sets the streams up; engines cannot

        async def last_seq() -> int:
            try:
                msg = await js.get_last_msg(NAMES.stream("kv"), NAMES.kv_subject("e1"))
            except Exception:
                return -1
            return int((msg.headers or {}).get(H_SEQ, -1))

        shared = prefixes(engine, 3)
        bridge.start()
        for run in range(2):
            at = await last_seq()
            for _ in range(40):
                engine.random_step(shared)
            await until(last_seq, lambda s, at=at: s > at, timeout=60,
                        what=f"bridge run {run + 1} appending")
            bridge.kill()
            if run == 0:
                bridge.start()
        assert "resuming e1" in bridge.log(), bridge.log()[-2000:]
        log = server.log_path.read_text(errors="replace")
        assert "Violation" not in log, [ln for ln in log.splitlines() if "Violation" in ln]
    finally:
        bridge.kill()
        await admin.close()
        await engine.stop()
        server.cleanup()
