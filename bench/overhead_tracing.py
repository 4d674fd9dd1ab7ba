"""`jetrouter bench overhead --otlp-traces-endpoint URL|local`: the router's added latency and CPU
per request with tracing off and on, in one invocation.

Runs of :func:`bench.overhead.run_overhead` with the same options, each on a fresh one-replica,
one-worker cluster, without tracing and with the replica exporting every request's spans
(``serve --otlp-traces-endpoint``): ``--tracing-pairs N`` pairs in the order off, on, on, off,
..., so a load that drifts during the sitting weighs on both sides alike. ``local`` starts an
OTLP/HTTP receiver in this process (bench/otlp_receiver.py) that counts what it receives without
decoding it, so the load generator pays next to nothing for it; any other value is a collector
URL the replica exports to. The report puts off and on side by side (medians over the pairs)
with the ratio on / off of the router's added TTFT (router p50 - direct p50, each run against its
own direct baseline), of the replica's CPU per request and of routing throughput. On a shared
machine, look at the spread of the pairs before reading much into a few percent.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.overhead import (
    OverheadOptions,
    format_report,
    options_from_args,
    run_overhead,
)
from leanhttp.loop import run as run_loop

LOCAL = "local"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--otlp-traces-endpoint", metavar="URL|local", default=None,
                   help="measure with tracing off and on: the replica exports its spans to "
                        "this OTLP collector, or with `local` to a receiver in this process "
                        "(needs the `tracing` extra)")
    p.add_argument("--tracing-pairs", type=int, default=1,
                   help="with --otlp-traces-endpoint: runs off and on, in the order off, on, "
                        "on, off, ...; medians compared (default %(default)s)")


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


def median_comparison(pairs: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """:func:`compare`'s rows with each off and on figure the median over the pairs of runs."""
    out: list[dict[str, Any]] = []
    for rows in zip(*pairs, strict=True):
        merged: dict[str, Any] = {}
        for key, cell in rows[0].items():
            if not isinstance(cell, dict):
                merged[key] = cell
                continue
            off = [r[key]["off"] for r in rows if r[key]["off"] is not None]
            on = [r[key]["on"] for r in rows if r[key]["on"] is not None]
            m_off = round(statistics.median(off), 3) if off else None
            m_on = round(statistics.median(on), 3) if on else None
            merged[key] = {"off": m_off, "on": m_on, "ratio": _ratio(m_on, m_off)}
        out.append(merged)
    return out


async def run_both(opts: OverheadOptions, endpoint: str, data_dir: Path | None,
                   log: Callable[[str], None], pairs: int = 1) -> dict[str, Any]:
    """``pairs`` runs with tracing off and as many on, in the order off, on, on, off, off, on,
    ...: a load that drifts during the sitting (other processes on the machine) then weighs on
    both sides alike, and the medians are compared."""
    runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    with _endpoint(endpoint) as (url, receiver):
        traced = replace(opts, router_args=(*opts.router_args, f"--otlp-traces-endpoint={url}"))
        for k in range(pairs):
            for side in (("off", "on") if k % 2 == 0 else ("on", "off")):
                log(f"pair {k + 1}/{pairs}: tracing {side}"
                    + (f", exporting to {url}" if side == "on" else ""))
                where = data_dir / f"{side}{k}" if data_dir else None
                runs[side].append(await run_overhead(traced if side == "on" else opts, where,
                                                     log))
    # Each replica flushes its last spans when it stops, which run_overhead waited for.
    received = None if receiver is None else {"exports": receiver.exports,
                                              "bytes": receiver.bytes}
    per_pair = [compare(off, on) for off, on in zip(runs["off"], runs["on"], strict=True)]
    return {"tracing_off": runs["off"], "tracing_on": runs["on"], "endpoint": endpoint,
            "pairs": pairs, "otlp_received": received, "per_pair": per_pair,
            "comparison": median_comparison(per_pair)}


def _cell(d: dict[str, Any]) -> str:
    ratio = "-" if d["ratio"] is None else f"x{d['ratio']:.2f}"
    return f"{d['off']!s:>9} {d['on']!s:>9} {ratio:>7}"


def format_comparison(r: dict[str, Any]) -> str:
    lines = []
    for k, (off, on) in enumerate(zip(r["tracing_off"], r["tracing_on"], strict=True)):
        lines += [f"== pair {k + 1}: tracing off ==", format_report(off), "",
                  f"== pair {k + 1}: tracing on ==", format_report(on), ""]
    pairs = r["pairs"]
    lines += [(f"median of {pairs} pairs, " if pairs > 1 else "")
              + f"tracing off vs on (spans exported to {r['endpoint']}"
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
        if args.tracing_pairs < 1:
            raise ValueError("--tracing-pairs must be positive")
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
    result = run_loop(run_both(opts, args.otlp_traces_endpoint, args.data_dir,
                               log=(lambda s: None) if quiet else
                               (lambda s: print(f"  {s}", file=sys.stderr, flush=True)),
                               pairs=args.tracing_pairs))
    text = json.dumps(result, indent=2)
    if args.out is not None:
        args.out.write_text(text + "\n")
    print(text if quiet else format_comparison(result))
    return 0
