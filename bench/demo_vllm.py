"""`jetrouter demo --engine vllm` (`make demo-vllm`): KV-aware routing vs a baseline on real vLLM.

On a fresh machine: creates the vLLM environment if missing (`deploy/vllm-venv.sh`), writes a
tiny random-weight Llama and an offline-trained tokenizer (once, under ~/.cache/jetrouter-vllm:
vLLM keys its compile cache by the model's path, so a fixed path starts engines faster on every
later run; the cluster's own data and logs go to a temporary dir), starts NATS, N
vLLM engines (concurrently, with a progress line), one `jetrouter bridge` per engine and the
router replicas (`launch.vllm_cluster`). Then, for each router mode, it empties the engines' prefix
caches, starts fresh replicas in that mode, replays the same workload through them with the bench
client (`bench`), and finally prints both runs side by side: the engine-reported cached-token
rate (``usage.prompt_tokens_details.cached_tokens``), TTFT percentiles, and how far the router's
predicted overlap (decision ledger: ``overlap_blocks`` x block size) was from what the engine
actually reused. Ctrl-C or an error stops every process it started.

The workload is the built-in Mooncake-format generator (multi-turn chats sharing system
prompts), sized for a 2-core machine; every 512-token trace block becomes one 32-token engine
block of token ids (token-id prompts pass through the router and vLLM untouched).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from bench import report
from bench.cli import build_summaries
from bench.client import OK, BenchOptions, RunResult, run_trace_bench
from bench.trace import GeneratorParams, TraceRecord, describe_records, generate, select
from launch.vllm_cluster import EngineStartError, VllmCluster, router_model_args
from workers.vllm import env as vllm_env

BLOCK_SIZE = 32
# The demo's workload: 96 requests, ~73 s per mode at the demo's default --speedup 2 (about 1.3
# requests/s: what two CPU engines sharing a busy 2-core host served without queueing up),
# short outputs, prompts up to ~25 blocks.
DEMO_GENERATOR = GeneratorParams(sessions=24, turns=4, system_prompts=4, system_blocks=6,
                                 turn_blocks_min=1, turn_blocks_max=4, output_min=8,
                                 output_max=32, rate=1.0, think_s=8.0, seed=0)
# Token ids stay below the tiny tokenizer's 2048 ids.
VOCAB = 2000


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags that only the real-engine demo reads (`bench.demo` owns the shared ones)."""
    g = p.add_argument_group("real engines (--engine vllm)")
    g.add_argument("--vllm-engines", type=int, default=2, help="vLLM engines (default 2)")
    g.add_argument("--vllm-layers", type=int, default=2,
                   help="tiny model layers (default 2; 4 with --vllm-hidden 512 makes prefill "
                        "cost more, so cache reuse shows more in TTFT on an idle host)")
    g.add_argument("--vllm-hidden", type=int, default=128,
                   help="tiny model hidden size, a multiple of 64 (default 128)")
    g.add_argument("--vllm-model-dir", type=Path, default=None,
                   help="serve this model folder instead of writing a tiny one")
    g.add_argument("--vllm-gpu-blocks", type=int, default=256,
                   help="KV blocks per engine (--num-gpu-blocks-override; default 256, small "
                        "enough that placement decides what stays cached)")


def _workload(args: argparse.Namespace) -> tuple[list[TraceRecord], dict[str, Any]]:
    d = DEMO_GENERATOR
    params = GeneratorParams(
        sessions=args.gen_sessions if args.gen_sessions != GeneratorParams().sessions
        else d.sessions,
        turns=d.turns, system_prompts=d.system_prompts, system_blocks=d.system_blocks,
        turn_blocks_min=d.turn_blocks_min, turn_blocks_max=d.turn_blocks_max,
        output_min=d.output_min, output_max=d.output_max,
        rate=args.gen_rate if args.gen_rate != GeneratorParams().rate else d.rate,
        think_s=d.think_s, seed=args.gen_seed)
    records = select(generate(params), max_requests=args.max_requests)
    workload = {"source": "generator", "generator": params.describe(),
                "shape": describe_records(records)}
    return records, workload


def predicted_vs_cached(run: RunResult) -> list[tuple[int, int]]:
    """(router-predicted overlap tokens, engine-reported cached tokens) per finished request:
    the router states its prediction in a response header, the engine its reuse in ``usage``."""
    pairs = []
    for rec in run.records:
        predicted = getattr(rec, "predicted_tokens", None)
        if rec.outcome == OK and predicted is not None and rec.cached_tokens is not None:
            pairs.append((int(predicted), int(rec.cached_tokens)))
    return pairs


def prediction_summary(pairs: Sequence[tuple[int, int]]) -> dict[str, Any]:
    """Error = predicted - engine-cached tokens: >0 the router promised reuse the engine did not
    deliver (evicted, or vLLM recomputing the last token of a fully cached prompt), <0 the engine
    reused more than the router knew of."""
    if not pairs:
        return {"requests": 0}
    errors = [p - c for p, c in pairs]
    n = len(errors)
    return {"requests": n,
            "predicted_tokens": sum(p for p, _ in pairs),
            "cached_tokens": sum(c for _, c in pairs),
            "mean_error": sum(errors) / n,
            "mean_abs_error": sum(abs(e) for e in errors) / n,
            "exact_share": sum(1 for e in errors if e == 0) / n,
            "within_one_block_share": sum(1 for e in errors if abs(e) <= BLOCK_SIZE) / n,
            "over_share": sum(1 for e in errors if e > 0) / n,
            "under_share": sum(1 for e in errors if e < 0) / n}


def format_prediction(summaries: Sequence[dict[str, Any]]) -> str:
    rows = [("requests compared", "requests", str),
            ("router predicted tokens", "predicted_tokens", str),
            ("engine cached tokens", "cached_tokens", str),
            ("mean error (tokens)", "mean_error", lambda v: f"{v:+.1f}"),
            ("mean |error| (tokens)", "mean_abs_error", lambda v: f"{v:.1f}"),
            ("exactly right", "exact_share", lambda v: f"{v * 100:.1f}%"),
            ("within one block", "within_one_block_share", lambda v: f"{v * 100:.1f}%"),
            ("over-predicted", "over_share", lambda v: f"{v * 100:.1f}%"),
            ("under-predicted", "under_share", lambda v: f"{v * 100:.1f}%")]
    header = ["prediction error (router - engine)", *(s["label"] for s in summaries)]
    table = [[title, *(fmt(s["prediction_detail"][key]) if key in s["prediction_detail"]
                       else "-" for s in summaries)] for title, key, fmt in rows]
    widths = [max(len(r[i]) for r in [header, *table]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                       for i, (c, w) in enumerate(zip(header, widths, strict=True)))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                        for i, (c, w) in enumerate(zip(r, widths, strict=True))) for r in table]
    return "\n".join(lines)


async def _warm_up(cluster: VllmCluster, model: str) -> None:
    """One request straight to each engine: the first request after start pays one-off costs
    (graph capture for new shapes) that would otherwise land on whichever mode runs first."""
    async with httpx.AsyncClient(timeout=120.0) as client:
        for engine in cluster.engines:
            resp = await client.post(engine.url + "/v1/completions", json={
                "model": model, "prompt": list(range(3, 3 + 4 * BLOCK_SIZE)), "max_tokens": 4})
            resp.raise_for_status()


async def _run_mode(cluster: VllmCluster, mode: str, records: Sequence[TraceRecord],
                    options: BenchOptions) -> tuple[RunResult, list[tuple[int, int]]]:
    await cluster.stop_routers()
    await cluster.reset_prefix_caches(options.model or "")
    await cluster.start_routers(mode)
    # Each replica has caught up with the registrations and with the engines' AllBlocksCleared.
    await cluster.wait_workers(len(cluster.engines),
                               predicate=lambda w: w["cached_blocks"] == 0
                               and w["health"] == "healthy")
    run = await run_trace_bench(cluster.router_urls, records, options)
    run.extra.update({"router_mode": mode, "engines": "vllm", "block_size": BLOCK_SIZE})
    return run, predicted_vs_cached(run)


async def _demo(args: argparse.Namespace, modes: Sequence[str]) -> int:
    records, workload = _workload(args)
    shape = workload["shape"]
    python = vllm_env.ensure_venv()
    tmp = Path(tempfile.mkdtemp(prefix="jetrouter-vllm-demo-"))
    data_dir = args.data_dir or tmp / "cluster"
    model_dir = args.vllm_model_dir
    started = time.monotonic()
    if model_dir is None:
        print(f"a tiny Llama ({args.vllm_layers} layers, hidden {args.vllm_hidden}) and its "
              f"tokenizer, under {vllm_env.CACHE_ROOT / 'models'}", file=sys.stderr, flush=True)
        model_dir = await asyncio.to_thread(vllm_env.cached_model, args.vllm_layers,
                                            args.vllm_hidden, python)
    replay_s = shape["duration_s"] / args.speedup
    print(f"jetrouter demo (vLLM): {shape['requests']} requests (~{replay_s:.0f} s each run), "
          f"modes {' vs '.join(modes)}, {args.replicas} replicas, "
          f"{args.vllm_engines} vLLM engines; logs in {data_dir / 'logs'}",
          file=sys.stderr, flush=True)
    cluster = VllmCluster(python=python, model_dir=model_dir, data_dir=data_dir,
                          engines=args.vllm_engines, replicas=args.replicas,
                          block_size=BLOCK_SIZE, num_gpu_blocks=args.vllm_gpu_blocks,
                          cache_root=vllm_env.CACHE_ROOT,
                          # CPU engines on a shared host can take tens of seconds to a
                          # first token under load; a request should wait, not migrate.
                          router_args=[*router_model_args(model_dir),
                                       "--stream-idle-timeout", "120"])
    options = BenchOptions(concurrency=args.concurrency, speedup=args.speedup,
                           max_output_tokens=args.max_output_tokens or None,
                           trace_block_tokens=BLOCK_SIZE, vocab_size=VOCAB, ignore_eos=True,
                           progress=not args.no_progress)
    if getattr(args, "text_prompts", False):
        # Words instead of ids: the router (--model-path) and vLLM each tokenize them, so the
        # prediction error also measures whether both sides tokenize alike.
        options = dataclasses.replace(options, text_prompts=True)
    ok = False
    try:
        await cluster.start(modes[0])
        model = (await cluster.workers())[0]["model"]
        options.model = model
        await _warm_up(cluster, model)
        runs, predictions = [], []
        for mode in modes:
            options.label = mode
            run, pairs = await _run_mode(cluster, mode, records, options)
            runs.append(run)
            predictions.append(prediction_summary(pairs))
        ok = True
    finally:
        await cluster.stop()
        if ok and args.data_dir is None:
            shutil.rmtree(tmp, ignore_errors=True)
        elif not ok:
            print(f"logs kept in {data_dir / 'logs'}", file=sys.stderr)
    workload["cluster"] = {"engines": args.vllm_engines, "replicas": args.replicas,
                           "block_size": BLOCK_SIZE, "gpu_blocks": args.vllm_gpu_blocks,
                           "model": f"llama {args.vllm_layers}x{args.vllm_hidden} (random)"}
    summaries = build_summaries(runs, records, capacity_blocks=args.vllm_engines *
                                args.vllm_gpu_blocks, workload=workload,
                                num_workers=args.vllm_engines)
    for summary, prediction in zip(summaries, predictions, strict=True):
        summary["prediction_detail"] = prediction
    print(report.format_workload(workload))
    print(report.format_comparison(summaries[0], summaries[1]) if len(summaries) == 2 else
          "\n".join(report.format_table(s) for s in summaries))
    print()
    print(format_prediction(summaries))
    print(f"demo finished in {time.monotonic() - started:.0f} s", file=sys.stderr)
    if args.out is not None:
        report.write_json(args.out, summaries, workload)
        print(f"report written to {args.out}", file=sys.stderr)
    return 0 if all(s["requests"]["ok"] for s in summaries) else 1


def run(args: argparse.Namespace, modes: Sequence[str]) -> int:
    from api.cli import CliError

    if args.vllm_engines < 1 or args.replicas < 1:
        raise CliError("need --vllm-engines >= 1 and --replicas >= 1")
    loop = asyncio.new_event_loop()
    main = loop.create_task(_demo(args, modes))
    # SIGTERM is handled like Ctrl-C: cancel the demo, whose `finally` stops every child.
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, main.cancel)
    try:
        return loop.run_until_complete(main)
    except asyncio.CancelledError:
        print("\ninterrupted; everything it started is stopped", file=sys.stderr)
        return 130
    except (vllm_env.VllmEnvMissing, EngineStartError) as exc:
        print(f"jetrouter demo: error: {exc}", file=sys.stderr)
        return 1
    finally:
        with contextlib.suppress(Exception):
            loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
