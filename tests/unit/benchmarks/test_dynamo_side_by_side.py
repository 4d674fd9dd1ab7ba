"""The Dynamo side-by-side script's pure parts, and its skip without a Dynamo virtualenv."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import dynamo_side_by_side as sbs


def test_without_a_dynamo_venv_it_skips_in_one_line(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("JETROUTER_DYNAMO_VENV", raising=False)
    assert sbs.main([]) == 0
    assert sbs.main(["--dynamo-venv", str(tmp_path / "absent")]) == 0
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").symlink_to("/bin/false")
    assert sbs.main(["--dynamo-venv", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3
    assert all(line.startswith("dynamo_side_by_side: skipped: ") for line in lines)
    assert "absent" in lines[1] and "cannot import dynamo.frontend" in lines[2]


def test_bad_options_are_refused() -> None:
    assert sbs.main(["--prefix-tokens", "600", "--prompt-tokens", "512"]) == 2


def test_token_bodies_share_a_prefix_and_differ_after_it() -> None:
    body = sbs.token_body("m", prompt_tokens=64, prefix_tokens=32, prefixes=2, max_tokens=3,
                          stream=False)
    a, b, c = (json.loads(body(n)) for n in (0, 2, 1))
    assert a["model"] == "m" and a["max_tokens"] == 3 and a["stream"] is False
    assert all(len(d["prompt"]) == 64 for d in (a, b, c))
    assert all(2 <= t < sbs.VOCAB for t in a["prompt"] + c["prompt"])
    assert a["prompt"][:32] == b["prompt"][:32] != c["prompt"][:32]
    assert a["prompt"][32:] != b["prompt"][32:]
    no_prefix = sbs.token_body("m", 16, 0, 1, 1, stream=True)
    assert len(json.loads(no_prefix(5))["prompt"]) == 16


def test_summary_is_medians_and_ratios_per_level() -> None:
    def run(pair: int, stack: str, rate: float, cpu: float) -> dict[str, object]:
        return {"pair": pair, "concurrency": 1, "stack": stack, "req_per_s": rate,
                "router_cpu_ms_per_request": cpu, "router_process_cpu_ms_per_request": cpu,
                "stack_cpu_ms_per_request": 4 * cpu,
                "errors": 0, "cpu_ms_per_request": {"router": cpu, "engines": 2 * cpu}}

    runs = [run(0, "dynamo", 100, 1.0), run(0, "jetrouter", 150, 0.5),
            run(1, "dynamo", 200, 2.0), run(1, "jetrouter", 200, 1.0),
            run(2, "dynamo", 300, 3.0), run(2, "jetrouter", 330, 3.0)]
    [row] = sbs.summarise(runs, [1])
    assert row["dynamo"]["req_per_s"] == 200 and row["jetrouter"]["req_per_s"] == 200
    assert row["req_per_s_ratio"] == 1.0 and row["router_cpu_ratio"] == 0.5
    assert row["pair_req_per_s_ratios"] == [1.5, 1.0, 1.1]
    assert row["pair_router_cpu_ratios"] == [0.5, 0.5, 1.0]
    assert row["router_process_cpu_ratio"] == 0.5
    assert row["dynamo"]["other_cpu_ms_per_request"] == {"engines": 4.0}
    assert row["jetrouter"]["stack_cpu_ms_per_request"] == 4.0 and row["stack_cpu_ratio"] == 0.5
    assert row["pair_stack_cpu_ratios"] == [0.5, 0.5, 1.0]
    text = sbs.format_report({"machine": {"cpus": 2, "cpu_model": "x", "python": "3.11"},
                              "options": sbs._describe(sbs.Options()), "summary": [row]})
    assert "stack" in text and "0.5x" in text
