"""The pre-imported standby (api/standby.py, launch/standby_pool.py): a SIGKILLed replica of
`LocalCluster(standby=True)` comes back as the standby process, routes, and a new standby waits."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from api.standby import READY_LINE, activation_line
from launch.local_cluster import LocalCluster
from tests.waiting import until

REPO = Path(__file__).resolve().parents[3]


def _start_standby() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "api.standby"], cwd=REPO,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)


def test_standby_runs_the_command_it_is_given_into_the_log(tmp_path: Path) -> None:
    proc = _start_standby()
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().decode() == READY_LINE
        log = tmp_path / "r9.log"
        proc.stdin.write(activation_line(["check-config", "--no-such-flag"],
                                         {"JETROUTER_TEST_MARK": "1"}, str(log)))
        proc.stdin.close()
        assert proc.wait(timeout=60) == 2  # the CLI's one-line error for a bad flag
        assert "jetrouter check-config: error: unrecognized arguments: --no-such-flag" in (
            log.read_text())
        assert proc.stdout.read() == b""  # after activation nothing more reaches the supervisor
    finally:
        proc.kill()
        proc.wait()


def test_standby_whose_supervisor_goes_away_ends_quietly() -> None:
    proc = _start_standby()
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().decode() == READY_LINE
        proc.stdin.close()
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
        proc.wait()


async def _served_by(client: httpx.AsyncClient, url: str, prompt: str) -> str | None:
    resp = await client.post(url + "/v1/completions", json={
        "model": "jetrouter-sim", "prompt": prompt, "max_tokens": 1})
    return resp.headers.get("x-jetrouter-worker") if resp.status_code == 200 else None


@pytest.mark.timeout(180)
async def test_killed_replica_comes_back_as_the_standby_and_a_new_one_waits(
        tmp_path: Path) -> None:
    prompt = "a prefix the restarted replica must still know about " * 20
    async with LocalCluster(replicas=1, workers=2, base_port=None, data_dir=tmp_path,
                            namespace="standby", standby=True) as cluster, \
            httpx.AsyncClient(timeout=30.0) as client:
        assert cluster.standby is not None
        url = cluster.router_urls[0]
        owner = await _served_by(client, url, prompt + "first")
        assert owner is not None
        assert await cluster.standby.wait_ready(60.0)
        standby_pid = cluster.standby.pid
        killed_pid = cluster.kill("r0")
        await until(lambda: cluster.children["r0"].pid, lambda p: p not in (None, killed_pid),
                    timeout=30, what="r0 restarted")
        assert cluster.children["r0"].pid == standby_pid
        await cluster.wait_ready(["r0"], timeout=60)
        # The restarted replica rebuilt the index from the streams: same prefix, same engine.
        assert await _served_by(client, url, prompt + "second") == owner
        await until(lambda: cluster.standby.pid if cluster.standby.ready else None,
                    lambda p: p not in (None, standby_pid), timeout=60, what="a new standby")


@pytest.mark.timeout(180)
async def test_a_dead_standby_means_the_usual_restart(tmp_path: Path) -> None:
    async with LocalCluster(replicas=1, workers=1, base_port=None, data_dir=tmp_path,
                            namespace="standby", standby=True) as cluster:
        assert cluster.standby is not None and await cluster.standby.wait_ready(60.0)
        standby_pid = cluster.standby.pid
        assert standby_pid is not None
        os.killpg(standby_pid, signal.SIGKILL)
        await until(lambda: cluster.standby.ready, lambda r: not r, timeout=30,
                    what="the standby seen dead")
        killed_pid = cluster.kill("r0")
        await until(lambda: cluster.children["r0"].pid, lambda p: p not in (None, killed_pid),
                    timeout=30, what="r0 restarted")
        assert cluster.children["r0"].pid != standby_pid
        await cluster.wait_ready(["r0"], timeout=60)
        assert cluster.children["r0"].restarts == 1
