"""`jetrouter bench overhead --otlp-traces-endpoint URL|local`: the router's added latency and CPU
per request with tracing off and on, in one invocation.

Two runs of :func:`bench.overhead.run_overhead` with the same options, one after the other, each
on a fresh one-replica, one-worker cluster: the first without tracing, the second with the
replica exporting every request's spans (``serve --otlp-traces-endpoint``). ``local`` starts an
OTLP/HTTP receiver in this process (bench/otlp_receiver.py) that counts what it receives without
decoding it, so the load generator pays next to nothing for it; any other value is a collector
URL the replica exports to. The report puts the two side by side with the ratio on / off of the
router's added TTFT (router p50 - direct p50, each run against its own direct baseline) and of
the replica's CPU per request. The runs are sequential, not interleaved: on a shared machine,
repeat the command and compare the spread before reading much into a few percent.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.overhead import (
    OverheadOptions,
    _run_loop,
    format_report,
    options_from_args,
    run_overhead,
)

LOCAL = "local"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--otlp-traces-endpoint", metavar="URL|local", default=None,
                   help="measure twice, tracing off then on: the replica exports its spans to "
                        "this OTLP collector, or with `local` to a receiver in this process "
                        "(needs the `tracing` extra)")


@contextlib.contextmanager
def _endpoint(value: str) -> Iterator[tuple[str, Any]]:
    if value != LOCAL:
        yield value, None
        return
    from bench.otlp_receiver import HttpReceiver

    with HttpReceiver(keep=False) as receiver:
        yield receiver.endpoint, receiver


def _ratio(on: float | None, off: float | None) -> float | None:
    if on is None or off is None or off <= 0:
        return None
    return round(on / off, 3)


def compare(off: dict[str, Any], on: dict[str, Any]) -> list[dict[str, Any]]:
    """Per TTFT concurrency level: added p50/p99 and replica CPU ms per request, off vs on."""
    rows = []
    for a, b in zip(off["ttft"], on["ttft"], strict=True):
        row: dict[str, Any] = {"concurrency": a["concurrency"]}
        for key in ("overhead_p50_ms", "overhead_p99_ms"):
            row[key] = {"off": a[key], "on": b[key], "ratio": _ratio(b[key], a[key])}
        cpu_off = a["router"]["cpu_ms_per_request"].get("replica")
        cpu_on = b["router"]["cpu_ms_per_request"].get("replica")
        row["replica_cpu_ms_per_request"] = {"off": cpu_off, "on": cpu_on,
                                             "ratio": _ratio(cpu_on, cpu_off)}
        rows.append(row)
    t_off, t_on = off["throughput"]["router"], on["throughput"]["router"]
    rows.append({"throughput_req_per_s": {
        "off": t_off["req_per_s"], "on": t_on["req_per_s"],
        "ratio": _ratio(t_on["req_per_s"], t_off["req_per_s"])},
        "replica_cpu_ms_per_request": {
            "off": t_off["cpu_ms_per_request"].get("replica"),
            "on": t_on["cpu_ms_per_request"].get("replica"),
            "ratio": _ratio(t_on["cpu_ms_per_request"].get("replica"),
                            t_off["cpu_ms_per_request"].get("replica"))}})
    return rows


async def run_both(opts: OverheadOptions, endpoint: str, data_dir: Path | None,
                   log: Callable[[str], None]) -> dict[str, Any]:
    log("tracing off")
    off = await run_overhead(opts, data_dir / "off" if data_dir else None, log)
    with _endpoint(endpoint) as (url, receiver):
        log(f"tracing on, exporting to {url}")
        traced = replace(opts, router_args=(*opts.router_args, f"--otlp-traces-endpoint={url}"))
        on = await run_overhead(traced, data_dir / "on" if data_dir else None, log)
    # The replica flushes its last spans when it stops, which run_overhead waited for.
    received = None if receiver is None else {"exports": receiver.exports,
                                              "bytes": receiver.bytes}
    return {"tracing_off": off, "tracing_on": on, "endpoint": endpoint,
            "otlp_received": received, "comparison": compare(off, on)}


def _cell(d: dict[str, Any]) -> str:
    ratio = "-" if d["ratio"] is None else f"x{d['ratio']:.2f}"
    return f"{d['off']!s:>9} {d['on']!s:>9} {ratio:>7}"


def format_comparison(r: dict[str, Any]) -> str:
    lines = ["== tracing off ==", format_report(r["tracing_off"]), "",
             "== tracing on ==", format_report(r["tracing_on"]), "",
             f"tracing off vs on (spans exported to {r['endpoint']}"
             + (f"; received {r['otlp_received']['exports']} exports, "
                f"{r['otlp_received']['bytes']} bytes" if r["otlp_received"] else "") + ")",
             f"{'':<30} {'off':>9} {'on':>9} {'on/off':>7}"]
    for row in r["comparison"]:
        if "concurrency" in row:
            c = row["concurrency"]
            lines.append(f"{f'c={c} added TTFT p50 ms':<30} {_cell(row['overhead_p50_ms'])}")
            lines.append(f"{f'c={c} added TTFT p99 ms':<30} {_cell(row['overhead_p99_ms'])}")
            lines.append(f"{f'c={c} replica CPU ms/request':<30} "
                         f"{_cell(row['replica_cpu_ms_per_request'])}")
        else:
            lines.append(f"{'throughput req/s':<30} {_cell(row['throughput_req_per_s'])}")
            lines.append(f"{'throughput replica CPU ms/req':<30} "
                         f"{_cell(row['replica_cpu_ms_per_request'])}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        opts = options_from_args(args)
    except ValueError as exc:
        print(f"jetrouter bench overhead: error: {exc}", file=sys.stderr)
        return 2
    if args.otlp_traces_endpoint == LOCAL:
        try:
            import opentelemetry.proto  # noqa: F401  (the receiver's and the replica's extra)
        except ImportError:
            print("jetrouter bench overhead: error: --otlp-traces-endpoint needs the `tracing` "
                  "extra: pip install 'jetrouter[tracing]'", file=sys.stderr)
            return 2
    quiet = bool(args.json)
    result = _run_loop(run_both(opts, args.otlp_traces_endpoint, args.data_dir,
                                log=(lambda s: None) if quiet else
                                (lambda s: print(f"  {s}", file=sys.stderr, flush=True))))
    text = json.dumps(result, indent=2)
    if args.out is not None:
        args.out.write_text(text + "\n")
    print(text if quiet else format_comparison(result))
    return 0
