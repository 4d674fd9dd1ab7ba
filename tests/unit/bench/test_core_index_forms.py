"""`bench core --index both`: both index forms measured in one run, memory per held block reported,
and the ratios computed from the two (figures printed, never asserted)."""

from __future__ import annotations

import gc
import json

import pytest

from bench import core


def test_both_forms_report_memory_and_ratios(capsys: pytest.CaptureFixture[str]) -> None:
    assert core.main(["--json", "--index", "both", "--workers", "4", "--blocks", "3000",
                      "--prompt-tokens", "512", "--samples", "20", "--replay-batches", "0",
                      "--replication-requests", "50"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["index_form"] == "compact"
    assert result["index_blocks"] == result["reference"]["index_blocks"] >= 3000
    for figures in (result, result["reference"]):
        assert "rss_bytes_per_held_block" in figures
        assert figures["decision_picked_cached_worker"] >= 0
    assert result["ratios"]["index_blocks"] == 1.0
    assert "index_array_bytes_per_held_block" in result


def test_both_decision_paths_in_one_run(capsys: pytest.CaptureFixture[str]) -> None:
    assert core.main(["--json", "--index", "both", "--decision-path", "both", "--workers", "4",
                      "--blocks", "3000", "--prompt-tokens", "512", "--samples", "20",
                      "--replay-batches", "0", "--replication-requests", "0"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for figures in (result, result["reference"]):
        assert figures["decision_path"] == "fast"
        assert figures["pure_path"]["decision_path"] == "pure"
        # the same workload and tie breaks: both paths pick the cached worker alike
        assert figures["decision_picked_cached_worker"] == \
            figures["pure_path"]["decision_picked_cached_worker"]
        assert "decision_p50_us" in figures["path_ratios"]
        assert figures["paths_differed_samples"] == 0


@pytest.mark.parametrize("form", ["compact", "reference"])
def test_the_replicas_decision_uses_the_index_form_named(
        form: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`--router-state` builds its state with the form `--index` names, and `--serve-gc` leaves
    the garbage collector as it found it."""
    thresholds = gc.get_threshold()
    assert core.main(["--json", "--index", form, "--workers", "4", "--blocks", "3000",
                      "--prompt-tokens", "512", "--samples", "120", "--replay-batches", "0",
                      "--replication-requests", "0", "--router-state", "--router-inflight", "1",
                      "--serve-gc"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["router_state"]["index_form"] == form
    assert result["router_state"]["paths_differed_samples"] == 0
    assert gc.get_threshold() == thresholds and gc.get_freeze_count() == 0
