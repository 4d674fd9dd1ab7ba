"""`jetrouter bench durability` at a small scale: a real nats-server and a real `jetrouter serve`
killed with SIGKILL; the figures exist and the restarted replica agrees with the in-process state.
(Speed is never asserted: the figures are printed by the full-size run.)"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import durability

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(("form", "via"), [("reference", "fresh"), ("compact", "fresh"),
                                           ("compact", "standby")])
async def test_small_run_restores_and_restarts_with_equal_digests(tmp_path: Path, form: str,
                                                                  via: str) -> None:
    """The compact form restores its arrays (index v6, stored uncompressed) and replays the tail
    in batches; the reference form its columns (v2) — either way the restarted replica agrees,
    restarted as a new process or through a pre-imported standby (as `jetrouter up` does)."""
    parser = argparse.ArgumentParser()
    durability.add_arguments(parser)
    args = parser.parse_args(["--blocks", "20000", "--workers", "6", "--tail-events", "1500",
                              "--tail-batch", "3", "--repeats", "1", "--index-form", form,
                              "--keep-dir", str(tmp_path), "--restart-via", via])
    result = await durability.measure(args)
    assert result["state"]["blocks"] == 20000 and result["state"]["workers"] == 6
    assert 0 < result["snapshot"]["stored_bytes"] and 0 < result["snapshot"]["raw_bytes"]
    assert result["restore"]["digests_equal"] is True
    restart = result["restart"]
    assert restart["tail"] == {**restart["tail"], "events": 1500, "messages": 500}
    assert restart["digests_equal_before_kill"] is True
    assert restart["digests_equal"] is True
    assert restart["in_process"]["digests_equal"] is True
    assert restart["sigkill_restart_ready_s"] > 0
    assert restart["sigkill_restart_cpu_to_ready_s"] > 0  # read from /proc (Linux)
    assert "loaded snapshot" in (tmp_path / "replica.log").read_text()
    assert result["params"]["index_form"] == form
    assert result["params"]["restart_via"] == via
    if form == "compact":
        assert result["snapshot"]["stored_bytes"] == result["snapshot"]["raw_bytes"]


def test_cli_skip_restart_prints_json() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "api.cli", "bench", "durability", "--json", "--skip-restart",
         "--blocks", "3000", "--workers", "3", "--repeats", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=True)
    result = json.loads(out.stdout)
    assert "restart" not in result
    assert result["restore"]["digests_equal"] is True
    assert result["params"]["blocks"] == 3000
