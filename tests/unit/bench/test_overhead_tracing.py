"""`bench overhead --otlp-traces-endpoint`: the off/on comparison and the counting receiver it
exports to (a real OTLP/HTTP export from the SDK, over a loopback socket)."""

from __future__ import annotations

from typing import Any

from bench.otlp_receiver import HttpReceiver
from bench.overhead_tracing import compare, format_comparison, median_comparison


def _report(added_p50: float, cpu: float, rate: float) -> dict[str, Any]:
    side = {"p50_ms": 1.0, "p99_ms": 2.0, "req_per_s": rate, "ok": 10, "errors": 0,
            "cpu_cores": {"replica": 0.5}, "cpu_ms_per_request": {"replica": cpu}}
    return {
        "machine": {"cpus": 2, "cpu_model": "x", "python": "3.11"},
        "options": {"worker_speedup_ratio": 1000, "prompt_chars": 512},
        "ttft": [{"concurrency": 1, "router": side, "direct": side,
                  "overhead_p50_ms": added_p50, "overhead_p99_ms": added_p50 * 2}],
        "throughput": {"concurrency": 64, "duration_s": 5,
                       "router": {**side, "latency_p50_ms": 1.0, "latency_p99_ms": 2.0},
                       "direct": {**side, "latency_p50_ms": 1.0, "latency_p99_ms": 2.0}}}


def test_the_comparison_puts_off_and_on_side_by_side_with_their_ratio() -> None:
    rows = compare(_report(2.0, 0.5, 400.0), _report(3.0, 0.75, 300.0))
    assert rows[0]["overhead_p50_ms"] == {"off": 2.0, "on": 3.0, "ratio": 1.5}
    assert rows[0]["replica_cpu_ms_per_request"]["ratio"] == 1.5
    assert rows[1]["throughput_req_per_s"]["ratio"] == 0.75
    text = format_comparison({"tracing_off": [_report(2.0, 0.5, 400.0)],
                              "tracing_on": [_report(3.0, 0.75, 300.0)], "endpoint": "local",
                              "pairs": 1, "otlp_received": {"exports": 3, "bytes": 100},
                              "comparison": rows})
    assert "c=1 added TTFT p50 ms" in text and "x1.50" in text and "received 3 exports" in text


def test_pairs_are_compared_by_their_medians() -> None:
    pairs = [compare(_report(2.0, 0.5, 400.0), _report(3.0, 0.6, 300.0)),
             compare(_report(4.0, 0.7, 200.0), _report(9.0, 0.8, 100.0)),
             compare(_report(3.0, 0.6, 300.0), _report(4.0, 1.2, 250.0))]
    rows = median_comparison(pairs)
    assert rows[0]["concurrency"] == 1
    assert rows[0]["overhead_p50_ms"] == {"off": 3.0, "on": 4.0, "ratio": 1.333}
    assert rows[0]["replica_cpu_ms_per_request"] == {"off": 0.6, "on": 0.8, "ratio": 1.333}
    assert rows[1]["throughput_req_per_s"] == {"off": 300.0, "on": 250.0, "ratio": 0.833}


def test_the_counting_receiver_takes_a_real_sdk_export() -> None:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    with HttpReceiver(keep=False) as receiver:
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(
            endpoint=receiver.endpoint)))
        provider.get_tracer("t").start_span("one").end()
        provider.shutdown()
        assert receiver.exports == 1 and receiver.bytes > 0 and receiver.spans == []
