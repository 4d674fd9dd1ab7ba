"""`jetrouter bench`: replay a Mooncake-format trace against routers (or `bench core`).

``jetrouter bench [trace] --url URL[,URL...]`` replays against running router replicas. Without
``--url`` the bench starts its own local cluster (`launch.local_cluster.LocalCluster`: embedded
nats-server, replicas, simulated workers) with ``--router-mode`` (default kv), and with ``--compare
MODE`` a second, fresh cluster (new data dir and namespace) in that mode, then prints both runs side
by side. ``jetrouter bench core ...`` is the state-machine benchmark (`bench.core`); ``jetrouter
bench overhead ...`` measures what one replica adds in front of an engine (`bench.overhead`);
``jetrouter bench faults ...`` injects engine and replica faults under steady load and prints what
clients saw (`bench.faults`); ``jetrouter bench scale`` prints routed req/s as replicas are added,
with each replica's CPU and replication share (`bench.scale`).

`run_trace_bench`, `run_managed` and `compare` are the programmatic entry points (the demo uses
them); `build_summaries` and `print_report` turn their results into the printed report.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import shutil
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench import report
from bench.client import BenchOptions, RunResult, run_trace_bench
from bench.ideal import cluster_capacity_blocks, ideal_rates
from bench.trace import (
    DEFAULT_BLOCK_TOKENS,
    DEFAULT_VOCAB_SIZE,
    GeneratorParams,
    TraceRecord,
    default_trace_path,
    describe_records,
    generate,
    load_jsonl,
    select,
)

__all__ = ["BenchOptions", "ClusterSpec", "RunResult", "add_arguments", "build_summaries",
           "compare", "load_workload", "print_report", "run", "run_managed", "run_trace_bench"]

ENGINE_BLOCK_SIZE = 16
# Default cache per worker, in trace blocks: small enough that the fleet cannot hold the whole
# conversation trace, so where a request lands decides whether its prefix is still cached.
TRACE_BLOCKS_PER_WORKER = 1000
COMPARE_MODES = ("round-robin", "random", "least-loaded")


@dataclass(slots=True)
class ClusterSpec:
    """Shape of a bench-managed `LocalCluster`."""

    replicas: int = 2
    workers: int = 8
    num_gpu_blocks: int | None = None          # None: TRACE_BLOCKS_PER_WORKER trace blocks' worth
    kv_cache_block_size: int = ENGINE_BLOCK_SIZE
    worker_speedup_ratio: float | None = None
    router_args: Sequence[str] = ()
    worker_args: Sequence[str] = ()
    data_dir: Path | None = None               # None: a temporary dir, removed after a clean run
    ready_timeout: float = 60.0
    model_path: Path | None = None             # one model folder for replicas and workers
    # Disaggregated serving: this many prefill and decode engines instead of `workers`.
    prefill_workers: int = 0
    decode_workers: int = 0

    @property
    def disaggregated(self) -> bool:
        return bool(self.prefill_workers or self.decode_workers)

    @property
    def engines(self) -> int:
        return self.prefill_workers + self.decode_workers if self.disaggregated \
            else self.workers

    def gpu_blocks(self, trace_block_tokens: int) -> int:
        if self.num_gpu_blocks is not None:
            return self.num_gpu_blocks
        return -(-TRACE_BLOCKS_PER_WORKER * trace_block_tokens // self.kv_cache_block_size)

    def capacity_trace_blocks(self, trace_block_tokens: int) -> int:
        return cluster_capacity_blocks(
            workers=self.engines, gpu_blocks_per_worker=self.gpu_blocks(trace_block_tokens),
            engine_block_size=self.kv_cache_block_size, trace_block_tokens=trace_block_tokens)

    def describe(self, trace_block_tokens: int) -> dict[str, Any]:
        return {"replicas": self.replicas, "workers": self.workers,
                **({"prefill_workers": self.prefill_workers,
                    "decode_workers": self.decode_workers} if self.disaggregated else {}),
                "num_gpu_blocks": self.gpu_blocks(trace_block_tokens),
                "kv_cache_block_size": self.kv_cache_block_size,
                "worker_speedup_ratio": self.worker_speedup_ratio,
                "router_args": list(self.router_args), "worker_args": list(self.worker_args),
                "model_path": str(self.model_path) if self.model_path else None}


async def run_managed(requests: Sequence[TraceRecord], options: BenchOptions, spec: ClusterSpec,
                      mode: str = "kv", *, index: int = 0,
                      data_dir: Path | None = None, label: str | None = None) -> RunResult:
    """Start a fresh LocalCluster with ``--router-mode mode``, replay, stop it."""
    from launch.local_cluster import (
        LocalCluster,  # lazily: `bench --url` needs no cluster machinery
    )

    block = str(spec.kv_cache_block_size)
    router_args = ["--router-mode", mode, "--kv-cache-block-size", block, *spec.router_args]
    worker_args = ["--num-gpu-blocks", str(spec.gpu_blocks(options.trace_block_tokens)),
                   "--kv-cache-block-size", block]
    if spec.worker_speedup_ratio is not None:
        worker_args += ["--speedup-ratio", str(spec.worker_speedup_ratio)]
    worker_args += list(spec.worker_args)
    owned = data_dir is None and spec.data_dir is None
    root = data_dir or spec.data_dir or Path(tempfile.mkdtemp(prefix="jetrouter-bench-"))
    cluster = LocalCluster(replicas=spec.replicas,
                           workers=0 if spec.disaggregated else spec.workers,
                           prefill_workers=spec.prefill_workers,
                           decode_workers=spec.decode_workers, base_port=None,
                           data_dir=root / f"{index}-{mode}", router_args=router_args,
                           worker_args=worker_args, namespace=f"bench{index}",
                           ready_timeout=spec.ready_timeout, model_path=spec.model_path)
    async with cluster:
        result = await run_trace_bench(cluster.router_urls, requests,
                                       replace(options, label=label or mode))
    result.extra.update({"router_mode": mode, "managed_cluster": True,
                         **spec.describe(options.trace_block_tokens)})
    if owned:  # kept on failure (an exception skips this) so the logs can be read
        shutil.rmtree(root, ignore_errors=True)
    return result


async def compare(requests: Sequence[TraceRecord], options: BenchOptions, spec: ClusterSpec,
                  modes: Sequence[str] = ("kv", "round-robin")) -> list[RunResult]:
    """One fresh cluster per router mode, the same requests each time, in order."""
    owned = spec.data_dir is None
    root = spec.data_dir or Path(tempfile.mkdtemp(prefix="jetrouter-bench-"))
    runs = []
    for index, mode in enumerate(modes):
        runs.append(await run_managed(requests, options, spec, mode, index=index, data_dir=root))
    if owned:  # kept on failure (an exception skips this) so the logs can be read
        shutil.rmtree(root, ignore_errors=True)
    return runs


async def compare_disaggregated(requests: Sequence[TraceRecord], options: BenchOptions,
                                spec: ClusterSpec, prefill: int, decode: int,
                                mode: str = "kv") -> list[RunResult]:
    """Aggregated serving on ``prefill + decode`` engines, then the same requests on a fresh
    cluster of ``prefill`` prefill engines and ``decode`` decode engines: the same number of
    engines of the same size, so the same total capacity."""
    owned = spec.data_dir is None
    root = spec.data_dir or Path(tempfile.mkdtemp(prefix="jetrouter-bench-"))
    aggregated = replace(spec, workers=prefill + decode, prefill_workers=0, decode_workers=0)
    split = replace(spec, prefill_workers=prefill, decode_workers=decode)
    runs = [await run_managed(requests, options, aggregated, mode, index=0, data_dir=root,
                              label=f"aggregated {prefill + decode}"),
            await run_managed(requests, options, split, mode, index=1, data_dir=root,
                              label=f"disagg {prefill}P+{decode}D")]
    if owned:  # kept on failure (an exception skips this) so the logs can be read
        shutil.rmtree(root, ignore_errors=True)
    return runs


def build_summaries(runs: Sequence[RunResult], requests: Sequence[TraceRecord], *,
                    capacity_blocks: int | None, workload: dict[str, Any] | None = None,
                    num_workers: int | None = None) -> list[dict[str, Any]]:
    """Summaries of runs over the same requests (the ideal hit rates are computed once)."""
    ideal = ideal_rates(requests, capacity_blocks)
    return [report.summarize(r, ideal=ideal, workload=workload, num_workers=num_workers)
            for r in runs]


def print_report(summaries: Sequence[dict[str, Any]], workload: dict[str, Any] | None = None,
                 out: Any = None) -> None:
    out = out or sys.stdout
    if workload:
        print(report.format_workload(workload), file=out)
    if len(summaries) == 2:
        print(report.format_comparison(summaries[0], summaries[1]), file=out)
    else:
        for summary in summaries:
            print(report.format_table(summary), file=out)


# -- command line ---------------------------------------------------------------------------------


def _add_trace_arguments(p: argparse.ArgumentParser, suppress: bool) -> None:
    """The trace-replay flags; on the `trace` sub-command their defaults are suppressed so they
    never overwrite values given before the sub-command name."""

    def add(*flags: str, **kw: Any) -> None:
        if suppress:
            kw["default"] = argparse.SUPPRESS
        p.add_argument(*flags, **kw)

    add("--url", default=None, help="router base URL(s), comma-separated; omit to run a local "
        "cluster")
    add("--trace", type=Path, default=None,
        help="Mooncake JSONL trace (default: ../shared/traces/mooncake/conversation_trace.jsonl "
             "next to the repo, else the built-in generator)")
    add("--generate", action="store_true", default=False,
        help="use the built-in generator even if the shared trace exists")
    add("--trace-block-tokens", type=int, default=DEFAULT_BLOCK_TOKENS,
        help=f"tokens per 512-token trace block in the replayed prompts "
             f"(default {DEFAULT_BLOCK_TOKENS})")
    add("--trace-vocab", type=int, default=DEFAULT_VOCAB_SIZE,
        help=f"token ids are drawn from 0..N-1 (default {DEFAULT_VOCAB_SIZE})")
    add("--speedup", type=float, default=1.0, help="divide trace timestamps by this")
    add("--start-offset", type=float, default=0.0, help="skip the trace's first S seconds")
    add("--max-requests", type=int, default=None, help="replay at most N requests")
    add("--concurrency", type=int, default=128, help="max requests in flight (default 128)")
    add("--max-output-tokens", type=int, default=128,
        help="cap max_tokens (default 128; 0 = the trace's output_length)")
    add("--model", default=None, help="model name (default: the first of GET /v1/models)")
    add("--request-timeout", type=float, default=300.0, help="seconds per request")
    add("--text-prompts", action="store_true", default=False,
        help="send text prompts (one word per trace token) instead of token ids, so the "
             "router's and the engines' tokenizers decide the ids (see --model-path)")
    add("--ignore-eos", action="store_true", default=False,
        help="send ignore_eos (vLLM) so real engines produce output_length tokens")
    add("--label", default=None, help="name of the run in the report (default: router mode)")
    add("--out", type=Path, default=None, help="write the report as JSON here")
    add("--requests-out", type=Path, default=None,
        help="write every request (arrival, TTFT, worker, cached tokens, ...) here as JSON lines")
    add("--no-progress", action="store_true", default=False, help="no progress line on stderr")
    add("--cache-blocks", type=int, default=None,
        help="fleet cache size in trace blocks for the ideal hit rate with --url "
             "(managed clusters compute it)")
    g = p.add_argument_group("generator (when no trace file is used)")

    def gen(flag: str, typ: type, default: Any, text: str) -> None:
        kw: dict[str, Any] = {"type": typ, "default": default, "help": f"{text} (default "
                                                                       f"{default})"}
        if suppress:
            kw["default"] = argparse.SUPPRESS
        g.add_argument(flag, **kw)

    d = GeneratorParams()
    gen("--gen-sessions", int, d.sessions, "conversations")
    gen("--gen-turns", int, d.turns, "turns per conversation")
    gen("--gen-system-prompts", int, d.system_prompts, "shared system prompts")
    gen("--gen-system-blocks", int, d.system_blocks, "512-token blocks per system prompt")
    gen("--gen-turn-blocks-min", int, d.turn_blocks_min, "min blocks a turn adds")
    gen("--gen-turn-blocks-max", int, d.turn_blocks_max, "max blocks a turn adds")
    gen("--gen-output-min", int, d.output_min, "min output tokens")
    gen("--gen-output-max", int, d.output_max, "max output tokens")
    gen("--gen-rate", float, d.rate, "mean requests per second (Poisson)")
    gen("--gen-think", float, d.think_s, "mean seconds between a conversation's turns")
    gen("--gen-seed", int, d.seed, "random seed")
    c = p.add_argument_group("managed cluster (when --url is not given)")

    def managed(*flags: str, **kw: Any) -> None:
        if suppress:
            kw["default"] = argparse.SUPPRESS
        c.add_argument(*flags, **kw)

    managed("--router-mode", default="kv", help="router mode of the (first) run (default kv)")
    managed("--compare", choices=COMPARE_MODES, default=None,
            help="run again on a fresh cluster with this router mode; print side by side")
    managed("--compare-disaggregated", default=None, metavar="P:D",
            help="run aggregated on P+D workers, then disaggregated on P prefill and D decode "
                 "workers (same engines, same total capacity); print side by side")
    managed("--replicas", type=int, default=2, help="router replicas (default 2)")
    managed("--workers", type=int, default=8, help="simulated workers (default 8)")
    managed("--num-gpu-blocks", type=int, default=None,
            help=f"KV blocks per worker (default: {TRACE_BLOCKS_PER_WORKER} trace blocks' worth)")
    managed("--kv-cache-block-size", type=int, default=ENGINE_BLOCK_SIZE,
            help=f"engine block size, tokens (default {ENGINE_BLOCK_SIZE})")
    managed("--worker-speedup-ratio", type=float, default=None,
            help="workers' --speedup-ratio (simulated time divided by this)")
    managed("--router-arg", action="append", default=[], metavar="ARG",
            help="extra raw argument for every replica (repeatable)")
    managed("--worker-arg", action="append", default=[], metavar="ARG",
            help="extra raw argument for every worker (repeatable)")
    managed("--data-dir", type=Path, default=None,
            help="cluster data/logs here (default: a temporary dir, removed after a clean run)")
    managed("--model-path", type=Path, default=None,
            help="HuggingFace model folder given to every replica and worker (tokenizer.json, "
                 "tokenizer_config.json); default: byte tokens")


# The verbs beside `core` and `trace`, in --help order: each one's help line and the modules whose
# add_arguments declare its flags; the first module's run() runs it.
_VERBS: dict[str, tuple[str, tuple[str, ...]]] = {
    "scale": ("aggregate req/s as replicas are added (1, 2, 4, ...), per-replica CPU and "
              "replication share, digests equal", ("bench.scale",)),
    "overhead": ("router overhead (TTFT vs direct) and routing throughput: one replica, one fast "
                 "simulated worker", ("bench.overhead", "bench.overhead_tracing")),
    "faults": ("engine and replica faults under steady load: client-visible failures and extra "
               "latency per fault", ("bench.faults",)),
    "durability": ("snapshot size, take and restore times, and SIGKILL-to-ready with a 1M-block "
                   "state", ("bench.durability",)),
    "restart": ("SIGKILL a replica: time to ready and to routing right again, cold restart vs "
                "the pre-imported standby", ("bench.restart",)),
    "routesim": ("routing quality on the trace without processes: engine schedulers in virtual "
                 "time, the real cost model", ("bench.routesim",)),
    "tenants": ("tenant limits across 3 replicas (fleet-wide vs per-replica, SIGKILL "
                "mid-flood), victim TTFT and Jain's index with FCFS and fair queueing",
                ("bench.tenants",)),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.description = __doc__
    sub = p.add_subparsers(dest="bench_kind",
                           metavar="{trace,core,overhead,faults,durability,restart,routesim,scale,"
                                   "tenants}")
    sub.required = False
    core_p = sub.add_parser("core", help="benchmark the router state machine (no network)")
    try:  # lazily: written separately, and its imports stay out of the trace replay
        core = importlib.import_module("bench.core")
    except ModuleNotFoundError as exc:
        if exc.name != "bench.core":
            raise
        core_p.add_argument("core_args", nargs=argparse.REMAINDER)
        core_p.set_defaults(_core_missing=True)
    else:
        core.add_arguments(core_p)
    for verb, (help_line, modules) in _VERBS.items():
        verb_p = sub.add_parser(verb, help=help_line)
        for module in modules:
            importlib.import_module(module).add_arguments(verb_p)
    trace_p = sub.add_parser("trace", help="replay a trace against routers (the default)")
    _add_trace_arguments(trace_p, suppress=True)
    _add_trace_arguments(p, suppress=False)


def load_workload(args: argparse.Namespace) -> tuple[list[TraceRecord], dict[str, Any]]:
    """The requests to replay and a description of where they came from (for the report)."""
    workload: dict[str, Any] = {}
    path = None if args.generate else (args.trace or default_trace_path())
    if path is not None:
        try:
            records = load_jsonl(path)
        except OSError as exc:
            raise _cli_error(f"cannot read trace {path}: {exc.strerror or exc}") from None
        except ValueError as exc:
            raise _cli_error(str(exc)) from None
        workload["source"] = str(path)
    else:
        try:
            params = GeneratorParams(
                sessions=args.gen_sessions, turns=args.gen_turns,
                system_prompts=args.gen_system_prompts, system_blocks=args.gen_system_blocks,
                turn_blocks_min=args.gen_turn_blocks_min, turn_blocks_max=args.gen_turn_blocks_max,
                output_min=args.gen_output_min, output_max=args.gen_output_max,
                rate=args.gen_rate, think_s=args.gen_think, seed=args.gen_seed)
            records = generate(params)
        except ValueError as exc:
            raise _cli_error(f"generator: {exc}") from None
        workload["source"] = "generator"
        workload["generator"] = params.describe()
    records = select(records, start_offset_s=args.start_offset, max_requests=args.max_requests)
    workload["selection"] = {"start_offset_s": args.start_offset,
                             "max_requests": args.max_requests, "speedup": args.speedup,
                             "trace_block_tokens": args.trace_block_tokens,
                             "vocab_size": args.trace_vocab}
    workload["shape"] = describe_records(records)
    return records, workload


def _split(text: str) -> tuple[int, int]:
    """``"P:D"`` -> (P, D), both at least 1."""
    try:
        prefill, decode = (int(x) for x in text.split(":"))
    except ValueError:
        raise _cli_error(f"--compare-disaggregated wants P:D (e.g. 2:6), not {text!r}") from None
    if prefill < 1 or decode < 1:
        raise _cli_error("--compare-disaggregated needs at least one prefill and one decode "
                         "worker")
    return prefill, decode


def _cli_error(message: str) -> Exception:
    from api.cli import CliError  # the CLI's one-line error type; imported late (no cycle)

    return CliError(message)


def options_from_args(args: argparse.Namespace, label: str) -> BenchOptions:
    if args.concurrency < 1 or args.speedup <= 0 or args.trace_block_tokens < 1:
        raise _cli_error("need --concurrency >= 1, --speedup > 0, --trace-block-tokens >= 1")
    return BenchOptions(concurrency=args.concurrency, speedup=args.speedup,
                        max_output_tokens=args.max_output_tokens or None,
                        trace_block_tokens=args.trace_block_tokens, vocab_size=args.trace_vocab,
                        model=args.model, request_timeout_s=args.request_timeout,
                        ignore_eos=args.ignore_eos, progress=not args.no_progress, label=label,
                        text_prompts=args.text_prompts)


def spec_from_args(args: argparse.Namespace) -> ClusterSpec:
    return ClusterSpec(replicas=args.replicas, workers=args.workers,
                       num_gpu_blocks=args.num_gpu_blocks,
                       kv_cache_block_size=args.kv_cache_block_size,
                       worker_speedup_ratio=args.worker_speedup_ratio,
                       router_args=list(args.router_arg), worker_args=list(args.worker_arg),
                       data_dir=args.data_dir, model_path=args.model_path)


async def _run_trace(args: argparse.Namespace) -> int:
    records, workload = load_workload(args)
    if not records:
        raise _cli_error("no requests to replay (check --start-offset / --max-requests)")
    shape = workload["shape"]
    print(f"replaying {shape['requests']} requests over ~{shape['duration_s'] / args.speedup:.1f}"
          f" s ({workload['source']})", file=sys.stderr)
    if args.url:
        if args.compare or args.compare_disaggregated:
            raise _cli_error("--compare / --compare-disaggregated start their own clusters: "
                             "omit --url")
        urls = [u for u in args.url.split(",") if u.strip()]
        options = options_from_args(args, args.label or "run")
        runs = [await run_trace_bench(urls, records, options)]
        capacity, num_workers = args.cache_blocks, None
    else:
        spec = spec_from_args(args)
        from launch.local_cluster import check_model_path

        check_model_path(str(spec.model_path) if spec.model_path else None)
        options = options_from_args(args, args.label or args.router_mode)
        modes = [args.router_mode] + ([args.compare] if args.compare else [])
        split = _split(args.compare_disaggregated) if args.compare_disaggregated else None
        if split and args.compare:
            raise _cli_error("--compare and --compare-disaggregated are separate comparisons")
        try:
            if split:
                runs = await compare_disaggregated(records, options, spec, *split,
                                                   mode=args.router_mode)
                spec = replace(spec, workers=sum(split))
            else:
                runs = await compare(records, options, spec, modes)
        except ModuleNotFoundError as exc:
            if exc.name != "launch.local_cluster":
                raise
            raise _cli_error(
                "a managed cluster needs the launch package; pass --url instead") from None
        if args.label and len(runs) == 1:
            runs[0].label = args.label
        capacity, num_workers = spec.capacity_trace_blocks(args.trace_block_tokens), spec.workers
        workload["cluster"] = spec.describe(args.trace_block_tokens)
    summaries = build_summaries(runs, records, capacity_blocks=capacity, workload=workload,
                                num_workers=num_workers)
    print_report(summaries, workload)
    if args.out is not None:
        report.write_json(args.out, summaries, workload)
        print(f"report written to {args.out}", file=sys.stderr)
    if args.requests_out is not None:
        count = report.write_requests(args.requests_out, runs)
        print(f"{count} requests written to {args.requests_out}", file=sys.stderr)
    return 0 if any(s["requests"]["ok"] for s in summaries) else 1


def run(args: argparse.Namespace) -> int:
    kind = getattr(args, "bench_kind", None)
    if kind == "core":
        if getattr(args, "_core_missing", False):
            raise _cli_error("`bench core` is not available (bench/core.py is missing)")
        return int(importlib.import_module("bench.core").run(args) or 0)
    if kind == "overhead" and args.otlp_traces_endpoint:  # twice: tracing off, then on
        return int(importlib.import_module("bench.overhead_tracing").run(args) or 0)
    if kind in _VERBS:
        return int(importlib.import_module(_VERBS[kind][1][0]).run(args) or 0)
    return asyncio.run(_run_trace(args))
