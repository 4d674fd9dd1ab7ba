"""`jetrouter bench scale` at its smallest size: one replica, two engines sharing one process,
three seconds of load. Checks the report's shape (never its timings)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(180)


def test_bench_scale_smallest_size_reports_every_figure(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "api.cli", "bench", "scale", "--json", "--replicas", "1",
         "--engines", "2", "--engines-per-process", "2", "--nats-cluster", "1",
         "--load-processes", "1", "--concurrency", "2",
         # Three seconds, not one: beside a soak and the rest of the suite on two cores, the
         # replica once answered nothing for a whole 1 s window (it lost its lease to a stall).
         "--duration", "3", "--warmup", "1", "--data-dir", str(tmp_path / "kept")],
        capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    (run,) = result["runs"]
    assert run["replicas"] == 1 and run["digests_equal"] is True
    assert run["req_per_s"] > 0 and run["errors"] == 0 and run["router_messages_per_request"] > 0
    assert len(run["load_cpu_cores"]) == run["load_processes"] == 1
    assert (run["engines"], run["engine_processes"], run["engines_per_process"]) == (2, 1, 2)
    assert 1 <= run["engines_holding_blocks"] <= 2
    (replica,) = run["per_replica"]
    assert set(replica) == {"replica", "cpu_cores", "children_cpu_cores", "replication_share",
                            "replication_us_per_event", "requests", "cpu_ms_per_request"}
    assert replica["cpu_cores"] > 0 and replica["cpu_ms_per_request"] > 0
    # The only replica: every request of the 3 s window (req/s is rounded to 0.1).
    assert replica["requests"] == pytest.approx(run["req_per_s"] * 3, abs=0.16)
    assert run["router_cpu_ms_per_request"] == pytest.approx(replica["cpu_ms_per_request"],
                                                             rel=0.01)
    assert replica["replication_share"] == 0.0  # no peers: nothing to replicate
    assert result["config"]["nats_cluster"] == 1 and result["machine"]["cpu_count"] >= 1
    assert run["replica_exits"] == {}  # no replica died and was restarted
    # --data-dir keeps the cluster's logs, where a replica exit would be explained
    assert Path(run["logs"]) == tmp_path / "kept" / "r1" / "logs"
    assert (Path(run["logs"]) / "r0.log").stat().st_size > 0


def test_bench_scale_rejects_a_bad_replica_list() -> None:
    proc = subprocess.run([sys.executable, "-m", "api.cli", "bench", "scale", "--replicas", "0"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()  # one line, no traceback
    assert "error:" in line and "--replicas" in line
