"""`jetrouter demo`: KV-aware routing vs round-robin on a slice of a trace, end to end.

The workload is the built-in Mooncake-format generator by default (multi-turn chats sharing a few
system prompts): its prefix reuse shows within a one-minute replay, whereas a few minutes of the
Mooncake conversation trace reuse little (use ``--trace PATH`` for a real trace, and make the slice
long). For each router mode a fresh local cluster is started (`launch.local_cluster.LocalCluster`:
embedded nats-server, router replicas, simulated workers), the same slice of the trace is replayed
through the routers (`bench`), and the cluster is stopped; then both runs are printed side by side.
Defaults are sized to finish in about two minutes on a 2-core machine; the flags make it bigger.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

from bench import report
from bench.cli import COMPARE_MODES, ClusterSpec, build_summaries, compare, print_report
from bench.client import BenchOptions
from bench.trace import (
    GeneratorParams,
    TraceRecord,
    describe_records,
    generate,
    load_jsonl,
    select,
)

# The generator's default workload (~256 requests over ~65 s) replayed at 2x, with workers that
# simulate 4x faster than their default timing: two runs plus cluster start-ups fit in ~2 min.
# A trace file is cut to its first DEFAULT_TRACE_REQUESTS requests unless --max-requests says.
DEFAULT_TRACE_REQUESTS = 300
DEFAULT_SPEEDUP = 2.0
DEFAULT_WORKER_SPEEDUP = 4.0
DEFAULT_MAX_OUTPUT_TOKENS = 64


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.description = __doc__
    p.epilog = ("A bigger run: jetrouter demo --workers 8 --gen-sessions 512 --gen-rate 16\n"
                "The shared Mooncake trace: jetrouter demo --trace "
                "../shared/traces/mooncake/conversation_trace.jsonl --max-requests 2000 "
                "--speedup 8\n"
                "The full benchmark with every knob is `jetrouter bench --compare round-robin`.")
    p.add_argument("--trace", type=Path, default=None,
                   help="Mooncake JSONL trace to replay instead of the built-in generator")
    d = GeneratorParams()
    p.add_argument("--gen-sessions", type=int, default=d.sessions,
                   help=f"generator: conversations (default {d.sessions})")
    p.add_argument("--gen-turns", type=int, default=d.turns,
                   help=f"generator: turns per conversation (default {d.turns})")
    p.add_argument("--gen-rate", type=float, default=d.rate,
                   help=f"generator: mean requests per second (default {d.rate:g})")
    p.add_argument("--gen-seed", type=int, default=d.seed,
                   help=f"generator: random seed (default {d.seed})")
    p.add_argument("--start-offset", type=float, default=0.0,
                   help="skip the trace's first S seconds")
    p.add_argument("--max-requests", type=int, default=None,
                   help="requests replayed per run (default: the whole generated workload, or "
                        f"the first {DEFAULT_TRACE_REQUESTS} of a trace file)")
    p.add_argument("--speedup", type=float, default=DEFAULT_SPEEDUP,
                   help=f"divide trace timestamps by this (default {DEFAULT_SPEEDUP:g})")
    p.add_argument("--concurrency", type=int, default=64,
                   help="max requests in flight (default 64)")
    p.add_argument("--max-output-tokens", type=int, default=DEFAULT_MAX_OUTPUT_TOKENS,
                   help=f"cap each request's max_tokens (default {DEFAULT_MAX_OUTPUT_TOKENS})")
    p.add_argument("--compare", choices=COMPARE_MODES, default="round-robin",
                   help="the baseline router mode run after kv (default round-robin)")
    p.add_argument("--replicas", type=int, default=2, help="router replicas (default 2)")
    p.add_argument("--workers", type=int, default=4, help="simulated workers (default 4)")
    p.add_argument("--num-gpu-blocks", type=int, default=None,
                   help="KV blocks per worker (default: the bench's, ~1000 trace blocks' worth)")
    p.add_argument("--worker-speedup-ratio", type=float, default=DEFAULT_WORKER_SPEEDUP,
                   help="workers simulate this many times faster than their default timing "
                        f"(default {DEFAULT_WORKER_SPEEDUP:g})")
    p.add_argument("--data-dir", type=Path, default=None,
                   help="keep cluster data and logs here (default: a temporary dir, removed "
                        "after a clean run)")
    p.add_argument("--out", type=Path, default=None, help="also write the report as JSON here")
    p.add_argument("--model-path", type=Path, default=None,
                   help="HuggingFace model folder for routers and workers alike (default: "
                        "byte tokens)")
    p.add_argument("--text-prompts", action="store_true",
                   help="send text prompts (words) instead of token ids; with --model-path the "
                        "model's tokenizer turns them into ids on both sides")
    p.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    p.add_argument("--engine", choices=("sim", "vllm"), default="sim",
                   help="sim: simulated workers (default); vllm: real vLLM engines behind "
                        "`jetrouter bridge` (bench/demo_vllm.py; `make demo-vllm`)")
    from bench import demo_vllm

    demo_vllm.add_arguments(p)


def load_slice(args: argparse.Namespace) -> tuple[list[TraceRecord], dict[str, Any]]:
    """The requests of the demo and a description of where they came from."""
    workload: dict[str, Any] = {}
    max_requests = args.max_requests
    if args.trace is not None:
        records = load_jsonl(args.trace)
        workload["source"] = str(args.trace)
        if max_requests is None:
            max_requests = DEFAULT_TRACE_REQUESTS
    else:
        params = GeneratorParams(sessions=args.gen_sessions, turns=args.gen_turns,
                                 rate=args.gen_rate, seed=args.gen_seed)
        records = generate(params)
        workload["source"] = "generator"
        workload["generator"] = params.describe()
    records = select(records, start_offset_s=args.start_offset, max_requests=max_requests)
    workload["selection"] = {"start_offset_s": args.start_offset,
                             "max_requests": max_requests, "speedup": args.speedup}
    workload["shape"] = describe_records(records)
    return records, workload


async def _demo(args: argparse.Namespace) -> int:
    from api.cli import CliError

    if (args.max_requests or 1) < 1 or args.speedup <= 0 or args.concurrency < 1:
        raise CliError("need --max-requests >= 1, --speedup > 0 and --concurrency >= 1")
    try:
        records, workload = load_slice(args)
    except (OSError, ValueError) as exc:
        raise CliError(f"cannot load the trace: {exc}") from None
    if not records:
        raise CliError("no requests in the selected slice (check --start-offset)")
    from launch.local_cluster import check_model_path

    check_model_path(str(args.model_path) if args.model_path else None)
    spec = ClusterSpec(replicas=args.replicas, workers=args.workers,
                       num_gpu_blocks=args.num_gpu_blocks,
                       worker_speedup_ratio=args.worker_speedup_ratio, data_dir=args.data_dir,
                       model_path=args.model_path)
    options = BenchOptions(concurrency=args.concurrency, speedup=args.speedup,
                           max_output_tokens=args.max_output_tokens or None,
                           progress=not args.no_progress, text_prompts=args.text_prompts)
    modes = ("kv", args.compare)
    shape = workload["shape"]
    print(f"jetrouter demo: {shape['requests']} requests (~{shape['duration_s'] / args.speedup:.0f}"
          f" s each run) from {workload['source']}, modes {' vs '.join(modes)}, "
          f"{args.replicas} replicas, {args.workers} workers", file=sys.stderr, flush=True)
    started = time.monotonic()
    runs = await compare(records, options, spec, modes)
    workload["cluster"] = spec.describe(options.trace_block_tokens)
    summaries = build_summaries(runs, records,
                                capacity_blocks=spec.capacity_trace_blocks(
                                    options.trace_block_tokens),
                                workload=workload, num_workers=spec.workers)
    print_report(summaries, workload)
    print(f"demo finished in {time.monotonic() - started:.0f} s", file=sys.stderr)
    if args.out is not None:
        report.write_json(args.out, summaries, workload)
        print(f"report written to {args.out}", file=sys.stderr)
    return 0 if all(s["requests"]["ok"] for s in summaries) else 1


def run(args: argparse.Namespace) -> int:
    from api.cli import CliError
    from launch.local_cluster import ClusterStartError
    from natsops.server import NatsServerNotFound

    try:
        if args.engine == "vllm":
            from bench import demo_vllm

            return demo_vllm.run(args, ("kv", args.compare))
        return asyncio.run(_demo(args))
    except NatsServerNotFound as exc:
        raise CliError(str(exc)) from None
    except ClusterStartError as exc:
        print(f"jetrouter demo: error: {exc}", file=sys.stderr)
        return 1
