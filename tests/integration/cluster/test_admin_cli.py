"""`jetrouter admin` against a real local cluster (nats-server, one replica, one simulated worker
as processes), run in-process through `api.cli.main` and once as a real subprocess.

Endpoints the lead is still adding (snapshot, snapshots, reset, threshold, replicas, requests)
are skipped with a reason while the replica has no route for them (404) or reports the feature
disabled (503, e.g. the decision ledger before the projections are wired in).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio

from api import cli
from launch.children import children_of
from launch.local_cluster import LocalCluster
from natsops.server import free_ports
from tests.waiting import until

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(90)]
REPO = Path(__file__).resolve().parents[3]
ENV_VARS = ("JETROUTER_URL", "JETROUTER_TOKEN", "JETROUTER_ADMIN_TOKEN", "JETROUTER_CLUSTER_FILE",
            "JETROUTER_JSON", "JETROUTER_TIMEOUT", "JETROUTER_YES", "JETROUTER_REASON")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def cluster(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[LocalCluster]:
    # data_dir is named .jetrouter so that cwd = its parent exercises the default cluster file.
    data = tmp_path_factory.mktemp("admin-cli") / ".jetrouter"
    # A token that cannot start with "-": up.py passes it as `--admin-token TOKEN`, which argparse
    # reads as a missing value when token_urlsafe happens to begin with "-" (1 run in 64).
    token = "adm" + secrets.token_urlsafe(18)
    async with LocalCluster(replicas=1, workers=1, data_dir=data, namespace="adm",
                            admin_token=token) as c:
        async with httpx.AsyncClient() as h:
            await until(lambda: _get(h, c, "/admin/workers"), lambda d: len(d["workers"]) == 1)
        yield c


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI frame reads JETROUTER_* variables; the caller's environment must not leak in."""
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)


async def _get(h: httpx.AsyncClient, c: LocalCluster, path: str) -> Any:
    r = await h.get(c.router_urls[0] + path, headers={"authorization": f"Bearer {c.admin_token}"})
    return r.json()




async def admin(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Run `jetrouter admin ARGV` in a thread (the cluster's supervisors keep running)."""
    capsys.readouterr()
    code = await asyncio.to_thread(cli.main, ["admin", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def with_file(c: LocalCluster, *argv: str) -> list[str]:
    return ["--cluster-file", str(c.cluster_json_path), *argv]


def skip_if_missing(code: int, err: str, what: str) -> None:
    """Skip while the lead is still wiring `what` in: no route yet, or the feature is off."""
    if code == 1 and ("404: Not Found" in err or "404: Unknown request URL" in err):
        pytest.skip(f"{what} is not served by the replica yet (404 Not Found)")
    if code == 1 and "503: " in err and "disabled on this replica" in err:
        pytest.skip(f"{what}: {err.split('503: ', 1)[1].split(' (', 1)[0]}")


def dead_url() -> str:
    return f"http://127.0.0.1:{free_ports(1)[0]}"


# -- reading ---------------------------------------------------------------------------------


async def test_state_from_the_default_cluster_file(cluster: LocalCluster,
                                                   capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(cluster.data_dir.parent)
    code, out, err = await admin(capsys, "state")
    assert (code, err) == (0, "")
    lines = dict(p for p in (line.split(None, 1) for line in out.splitlines()) if len(p) == 2)
    assert lines["replica_id"] == "r0"
    assert lines["ready"] == "yes"
    assert lines["epoch"].isdigit()
    assert "kv=" in lines["positions"] and "router=" in lines["positions"]


async def test_json_state_parses_before_or_after_the_verb(
        cluster: LocalCluster, capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (with_file(cluster, "--json", "state"), with_file(cluster, "state", "--json")):
        code, out, _ = await admin(capsys, *argv)
        assert code == 0
        state = json.loads(out)
        assert state["replica_id"] == "r0"
        assert set(state["positions"]) >= {"kv", "router", "control"}


async def test_workers_table_lists_the_worker(cluster: LocalCluster,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = await admin(capsys, *with_file(cluster, "workers"))
    assert code == 0
    header, *rows = out.splitlines()
    assert header.split()[:2] == ["worker_id", "url"]
    assert len(rows) == 1
    assert rows[0].split()[:2] == ["w0", cluster.worker_urls[0]]


async def test_url_and_env_token_override_the_cluster_file(
        cluster: LocalCluster, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)  # no .jetrouter here
    monkeypatch.setenv("JETROUTER_ADMIN_TOKEN", cluster.admin_token)
    code, out, _ = await admin(capsys, "--url", cluster.router_urls[0].removeprefix("http://"),
                               "workers")
    assert code == 0 and "w0" in out


# -- failures --------------------------------------------------------------------------------


async def test_wrong_token_exits_1_with_the_403_message(
        cluster: LocalCluster, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = await admin(capsys, *with_file(cluster, "--token", "wrong", "state"))
    assert code == 1 and out == ""
    assert "403: invalid admin token" in err
    assert len(err.strip().splitlines()) == 1


async def test_missing_cluster_file_without_url_exits_2(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    code, out, err = await admin(capsys, "state")
    assert (code, out) == (2, "")
    assert "no cluster file at .jetrouter/cluster.json and no --url" in err
    code, _, err = await admin(capsys, "--cluster-file", str(tmp_path / "nope.json"), "state")
    assert code == 2 and "not found" in err
    code, _, err = await admin(capsys, "--url", "http://127.0.0.1:9", "state")
    assert code == 2 and "no admin token" in err


async def test_falls_back_to_the_next_replica_then_reports_all_unreachable(
        cluster: LocalCluster, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    described = json.loads(cluster.cluster_json_path.read_text())
    real = described["replicas"][0]
    described["replicas"] = [{"id": "gone", "url": dead_url(), "pid": 1}, real]
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(described))
    code, out, err = await admin(capsys, "--cluster-file", str(path), "--json", "state")
    assert (code, err) == (0, "")
    assert json.loads(out)["replica_id"] == "r0"

    described["replicas"] = [{"id": "gone", "url": dead_url(), "pid": None}]
    described["state"] = "stopped"
    path.write_text(json.dumps(described))
    code, out, err = await admin(capsys, "--cluster-file", str(path), "state")
    assert (code, out) == (1, "")
    assert "cannot reach any replica" in err and "says the cluster is stopped" in err


async def test_reset_without_yes_refuses_when_stdin_is_not_a_tty(
        cluster: LocalCluster, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = await admin(capsys, *with_file(cluster, "reset"))  # pytest's stdin: no tty
    assert (code, out) == (2, "")
    assert "refusing to reset without --yes" in err
    # The same through the real entry point with stdin from /dev/null.
    proc = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "api.cli", "admin", *with_file(cluster, "reset")],
        cwd=REPO, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2, proc.stderr
    assert "refusing to reset without --yes" in proc.stderr


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


async def test_reset_on_a_tty_answered_no_sends_nothing(
        cluster: LocalCluster, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    async with httpx.AsyncClient() as h:
        epoch = (await _get(h, cluster, "/admin/state"))["epoch"]
        monkeypatch.setattr(sys, "stdin", _Tty("no\n"))
        code, out, err = await admin(capsys, *with_file(cluster, "reset"))
        assert (code, out) == (1, "")
        assert "Type 'yes' to continue" in err and "reset cancelled" in err
        assert (await _get(h, cluster, "/admin/state"))["epoch"] == epoch


async def test_unknown_request_exits_1_with_404(cluster: LocalCluster,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = await admin(capsys, *with_file(cluster, "request", "no/such id"))
    assert (code, out) == (1, "")
    assert err.startswith("jetrouter admin: error: 404: ")


async def test_subprocess_json_workers(cluster: LocalCluster) -> None:
    proc = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "api.cli", "admin", *with_file(cluster, "--json", "workers")],
        cwd=REPO, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert [w["worker_id"] for w in json.loads(proc.stdout)["workers"]] == ["w0"]


# -- endpoints being added by the lead (skipped while they answer 404 Not Found) ---------------


async def test_threshold_set_then_get(cluster: LocalCluster,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = await admin(capsys, *with_file(cluster, "threshold", "500"))
    skip_if_missing(code, err, "PUT /admin/snapshot-threshold")
    assert (code, err) == (0, "")
    assert out.strip() == "snapshot threshold set to 500"

    async def shown() -> str:
        return (await admin(capsys, *with_file(cluster, "threshold")))[1].strip()

    # The PUT goes through the control stream; the replica applies it asynchronously.
    await until(shown, lambda text: text == "snapshot threshold: 500")
    code, out, _ = await admin(capsys, *with_file(cluster, "--json", "state"))
    assert json.loads(out)["snapshot_threshold"] == 500


async def test_replicas_lists_the_replica(cluster: LocalCluster,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = await admin(capsys, *with_file(cluster, "replicas"))
    skip_if_missing(code, err, "GET /admin/replicas")
    assert code == 0
    header, *rows = out.splitlines()
    assert header.split()[0] == "replica_id"
    assert [r.split()[0] for r in rows] == ["r0"]


async def test_request_shows_the_decision_with_candidates(
        cluster: LocalCluster, capsys: pytest.CaptureFixture[str]) -> None:
    async with httpx.AsyncClient(timeout=20) as h:
        r = await h.post(cluster.router_urls[0] + "/v1/completions",
                         json={"model": "jetrouter-sim", "prompt": "hello admin", "max_tokens": 4})
        assert r.status_code == 200, r.text
    request_id = r.json()["id"].removeprefix("cmpl-")  # the worker echoes the router's id
    code, _, err = await admin(capsys, *with_file(cluster, "request", request_id))
    skip_if_missing(code, err, "GET /admin/requests/{id}")

    async def decision() -> tuple[int, str]:
        code, out, _ = await admin(capsys, *with_file(cluster, "request", request_id))
        return code, out

    code, out = await until(decision, lambda v: v[0] == 0)  # the ledger catches up
    assert "request_id" in out and request_id in out
    assert "candidates (1, * = chosen)" in out
    assert any(line.lstrip().startswith("* ") and "w0" in line for line in out.splitlines())


def projector_pid(c: LocalCluster) -> int:
    """The replica's one child process: its SQL projector, which writes the snapshot catalogue."""
    (child,) = children_of(c.processes["r0"])
    return child


@contextlib.contextmanager
def projector_lagging(c: LocalCluster) -> Iterator[Callable[[], object]]:
    """The projector stopped (SIGSTOP) while the block writes; the block calls the yielded
    function right before its read, which resumes the projector 0.3 s into that read."""
    projector = projector_pid(c)
    os.kill(projector, signal.SIGSTOP)
    try:
        yield lambda: asyncio.get_running_loop().call_later(0.3, os.kill, projector,
                                                           signal.SIGCONT)
    finally:
        os.kill(projector, signal.SIGCONT)


async def test_request_found_at_once_while_the_projector_lags(
        cluster: LocalCluster, capsys: pytest.CaptureFixture[str]) -> None:
    """`admin request ID` right after the request was answered finds its decision: the lookup
    waits for the projector child to write what its replica has seen."""
    with projector_lagging(cluster) as resume_during_read:
        async with httpx.AsyncClient(timeout=20) as h:
            r = await h.post(cluster.router_urls[0] + "/v1/completions",
                             json={"model": "jetrouter-sim", "prompt": "at once", "max_tokens": 2})
            assert r.status_code == 200, r.text
        request_id = r.json()["id"].removeprefix("cmpl-")
        resume_during_read()
        code, out, err = await admin(capsys, *with_file(cluster, "--json", "request", request_id))
    assert code == 0, err
    assert json.loads(out)["request_id"] == request_id


async def test_snapshot_listed_at_once_while_the_projector_lags(
        cluster: LocalCluster, capsys: pytest.CaptureFixture[str]) -> None:
    """`snapshots` right after `snapshot` lists it: the listing waits for the projector child
    to catalogue what its replica has written, rather than showing an older catalogue."""
    with projector_lagging(cluster) as resume_during_read:
        code, out, err = await admin(capsys, *with_file(cluster, "--json", "snapshot"))
        skip_if_missing(code, err, "POST /admin/snapshot")
        assert code == 0, err
        snapshot_id = json.loads(out)["snapshot_id"]
        resume_during_read()
        code, out, err = await admin(capsys, *with_file(cluster, "--json", "snapshots"))
    assert code == 0, err
    assert json.loads(out)["snapshots"][0]["snapshot_id"] == snapshot_id


async def test_snapshot_then_listed_then_reset_with_yes(
        cluster: LocalCluster, capsys: pytest.CaptureFixture[str]) -> None:
    # Last in the module: the reset clears the cluster's state.
    code, out, err = await admin(capsys, *with_file(cluster, "--json", "snapshot"))
    skip_if_missing(code, err, "POST /admin/snapshot")
    assert code == 0, err
    snapshot_id = json.loads(out)["snapshot_id"]
    code, out, _ = await admin(capsys, *with_file(cluster, "snapshots"))
    assert code == 0
    assert out.splitlines()[1].split()[0] == snapshot_id  # newest first

    code, out, err = await admin(capsys, *with_file(cluster, "--json", "state"))
    epoch = json.loads(out)["epoch"]
    code, out, err = await admin(capsys, *with_file(cluster, "reset", "--yes"))
    skip_if_missing(code, err, "POST /admin/reset")
    assert code == 0, err
    assert out.splitlines()[0] == f"reset done: epoch is now {epoch + 1}"
