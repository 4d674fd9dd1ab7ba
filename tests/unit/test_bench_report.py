"""Aggregation, percentiles and the printed/saved report of a trace run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.client import FAILED, OK, REJECTED, BenchOptions, RequestRecord, RunResult
from bench.ideal import ideal_rates
from bench.report import (
    format_comparison,
    format_table,
    percentile,
    summarize,
    write_json,
)
from bench.trace import TraceRecord


def test_percentile_linear_interpolation() -> None:
    values = [float(v) for v in range(10, 0, -1)]  # unsorted on purpose
    assert percentile(values, 50) == pytest.approx(5.5)
    assert percentile(values, 90) == pytest.approx(9.1)
    assert percentile(values, 99) == pytest.approx(9.91)
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 10.0
    assert percentile([3.0], 99) == 3.0
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile(values, 101)


def _run(label: str, scale: float = 1.0) -> RunResult:
    records = []
    for i in range(10):
        records.append(RequestRecord(
            index=i, outcome=OK, status=200, ttft_s=(i + 1) * 0.01 * scale,
            itl_s=[0.002 * scale, 0.004 * scale], e2e_s=(i + 1) * 0.1 * scale, output_tokens=3,
            prompt_tokens=100, cached_tokens=40 if i % 2 else 0,
            worker="w1" if i < 7 else "w2"))
    records.append(RequestRecord(index=10, outcome=REJECTED, status=503, error="HTTP 503: busy"))
    records.append(RequestRecord(index=11, outcome=FAILED, error="boom"))
    return RunResult(label=label, urls=["http://x"], records=records, started_at=0.0,
                     duration_s=2.0, options=BenchOptions(label=label))


def test_summarize_known_data() -> None:
    trace = [TraceRecord(0, 1024, 1, (1, 2)), TraceRecord(0, 1024, 1, (1, 3))]
    s = summarize(_run("kv"), ideal=ideal_rates(trace, 10), num_workers=4)
    assert s["requests"] == {"total": 12, "ok": 10, "failed": 1, "rejected": 1, "failovers": 0}
    assert s["ttft_s"]["p50"] == pytest.approx(0.055)
    assert s["ttft_s"]["p90"] == pytest.approx(0.091)
    assert s["itl_s"]["p50"] == pytest.approx(0.003)
    assert s["e2e_s"]["p99"] == pytest.approx(0.991)
    assert s["throughput"]["req_per_s"] == pytest.approx(5.0)
    assert s["throughput"]["output_tok_per_s"] == pytest.approx(15.0)
    assert s["prefix_hit"]["engine_rate"] == pytest.approx(200 / 1000)
    assert s["ideal"]["infinite"]["block_rate"] == pytest.approx(0.25)
    assert s["workers"]["requests"] == {"w1": 7, "w2": 3}
    # 4 workers in the fleet: mean 2.5 requests, busiest 7
    assert s["workers"]["max_over_mean"] == pytest.approx(7 / 2.5)
    assert s["errors"] == {"HTTP 503: busy": 1, "boom": 1}
    json.dumps(s)  # plain data


def test_tables_and_json(tmp_path: Path) -> None:
    a = summarize(_run("kv"))
    b = summarize(_run("round-robin", scale=2.0))
    table = format_table(a)
    assert "TTFT p50" in table and "55.0 ms" in table and "requests on w1" in table
    side = format_comparison(a, b)
    ttft_row = next(line for line in side.splitlines() if line.startswith("TTFT p50"))
    assert "55.0 ms" in ttft_row and "110.0 ms" in ttft_row and "2.00x" in ttft_row
    assert "round-robin/kv" in side.splitlines()[0]
    out = tmp_path / "r.json"
    write_json(out, [a, b], {"source": "generator"})
    saved = json.loads(out.read_text())
    assert saved["workload"] == {"source": "generator"}
    assert [r["label"] for r in saved["runs"]] == ["kv", "round-robin"]
    assert saved["ratios"]["ttft_s.p50"] == pytest.approx(2.0)


def test_prediction_error_figures() -> None:
    """Per request: the router's predicted reuse (header) against the engine's cached_tokens."""
    def rec(i: int, predicted: int | None, cached: int | None) -> RequestRecord:
        return RequestRecord(index=i, outcome=OK, prompt_tokens=100, cached_tokens=cached,
                             predicted_tokens=predicted, ttft_s=0.01, e2e_s=0.02)

    run = RunResult("kv", ["http://x"], [rec(0, 64, 64), rec(1, 32, 48), rec(2, 0, 0),
                                         rec(3, None, 16), rec(4, 16, None)],
                    started_at=0.0, duration_s=1.0, options=BenchOptions())
    p = summarize(run)["prediction"]
    assert p["requests"] == 3
    assert p["mean_abs_error_tokens"] == pytest.approx(16 / 3)
    assert p["exact_share"] == pytest.approx(2 / 3)
    assert p["predicted_rate"] == pytest.approx(96 / 300)
    assert p["mean_error_tokens"] == pytest.approx(-16 / 3)
    table = format_table(summarize(run))
    assert "predicted exactly" in table and "66.7%" in table
