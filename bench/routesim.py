"""Routing quality without processes: the trace replayed on simulated engines in virtual time.

The trace bench (`bench.cli`) runs the real thing — replicas, NATS, engine processes — so its
TTFT figures bend when the machine is short of CPU (every simulated step is a real sleep). This
bench keeps exactly the parts that decide routing quality and drops the rest:

- each worker is the engine's own pure scheduler (`workers.scheduler.EngineCore`: paged cache,
  prefix caching, chunked prefill, the step-time model), stepped on a virtual clock;
- the router is the real cost model (`replicas.core.selection.Selector`) fed by the real in-flight
  accounting (`replicas.core.load.ActiveLoad`), with each worker's overlap read from its cache at
  decision time (a router whose KV events arrive instantly);
- prompts come from the same `PromptBuilder` and output caps as the trace bench.

With ``--disaggregated P`` the first P workers are prefill engines and the rest decode engines:
each request gets the prefill decision (KV-aware, no active blocks), its prompt is computed on the
prefill engine, and when that finishes the decode decision sends it, with its blocks transferred,
to a decode engine (``replicas/core/disagg.py``; ``--no-assume-kv-reuse`` as the router flag).
The hit rate is then the prefill engines' (where the prompt is computed); TTFT runs from arrival
to the decode engine's first token; ITL is measured on every run.

So a gap between kv and round-robin here is the cost model's doing, not the machine's; a run of
1,000 requests takes seconds and is deterministic. Run (``jetrouter bench routesim`` is the same):
``python -m bench.routesim --max-requests 1000 --max-output-tokens 32 --weights 1,8
--queue-weight 1 --speedup 4``; ``--perf-model linear --prefill-ms-per-token 0.8`` replays the
engine model that docs/decisions/0039 to 0046 were measured with.
"""

from __future__ import annotations

import argparse
import heapq
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.ideal import cluster_capacity_blocks, ideal_rates
from bench.report import percentile
from bench.trace import (
    DEFAULT_BLOCK_TOKENS,
    PromptBuilder,
    TraceRecord,
    default_trace_path,
    load_jsonl,
    select,
)
from eventlog.hashing import prompt_hashes, tokens_hashes
from eventlog.names import prefill_request_id
from replicas.core import disagg
from replicas.core.load import ActiveLoad, OutputTracking, output_blocks
from replicas.core.prefill_model import PREFILL_LOAD_MODELS, PrefillLoadModel
from replicas.core.selection import Candidate, Decision, RoutingConfig, Selector
from workers.perf_model import LINEAR, PERF_MODELS
from workers.scheduler import EngineConfig, EngineCore, SimRequest

PREFILL_SUFFIX = prefill_request_id("")  # what a prefill hop's id ends with


@dataclass(slots=True)
class SimOptions:
    mode: str = "kv"
    workers: int = 8
    overlap_weight: float = 1.0
    speedup: float = 1.0                 # trace timestamps are divided by this
    trace_block_tokens: int = DEFAULT_BLOCK_TOKENS
    max_output_tokens: int | None = 128
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(num_gpu_blocks=2000))
    seed: int = 0
    prefill_queue_weight: float | None = None  # RoutingConfig.prefill_queue_weight
    prefill_workers: int = 0             # disaggregated: workers 0..P-1 prefill, the rest decode
    assume_kv_reuse: bool = True
    prefill_load_model: str = "none"     # --router-prefill-load-model
    track_output_blocks: bool = False    # --router-track-output-blocks (osl: the output cap)
    # Requests sharing a trace timestamp arrive this far apart, in trace order (0: all at once,
    # before any engine plans a step; real clients and routers hand a burst over one by one).
    burst_spacing_s: float = 0.0


@dataclass(slots=True)
class SimResult:
    mode: str
    ttft_s: list[float]
    worker_of: list[int]
    prompt_tokens: int
    cached_tokens: int
    routed_overlap_tokens: int           # what the router believed would hit
    best_overlap_tokens: int             # the best overlap any worker offered at decision time
    preemptions: int
    itl_s: list[float] = field(default_factory=list)

    def summary(self, num_workers: int) -> dict[str, Any]:
        counts = Counter(self.worker_of)
        mean = len(self.worker_of) / num_workers if num_workers else 0.0
        return {
            "mode": self.mode,
            "requests": len(self.worker_of),
            "engine_hit": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            "router_predicted_hit": (self.routed_overlap_tokens / self.prompt_tokens
                                     if self.prompt_tokens else 0.0),
            "best_available_hit": (self.best_overlap_tokens / self.prompt_tokens
                                   if self.prompt_tokens else 0.0),
            "ttft_p50_ms": 1000 * (percentile(self.ttft_s, 50) or 0.0),
            "ttft_p90_ms": 1000 * (percentile(self.ttft_s, 90) or 0.0),
            "ttft_p99_ms": 1000 * (percentile(self.ttft_s, 99) or 0.0),
            "itl_p50_ms": 1000 * (percentile(self.itl_s, 50) or 0.0),
            "itl_p90_ms": 1000 * (percentile(self.itl_s, 90) or 0.0),
            "itl_p99_ms": 1000 * (percentile(self.itl_s, 99) or 0.0),
            "busiest_over_mean": max(counts.values()) / mean if mean else 0.0,
            "preemptions": self.preemptions,
        }


class _Fleet:
    """Engines on one virtual clock; events are (time, order, kind, payload)."""

    def __init__(self, opts: SimOptions) -> None:
        self.opts = opts
        self.cores = [EngineCore(opts.engine, salt=i) for i in range(opts.workers)]
        self.stepping = [False] * opts.workers
        self.events: list[tuple[float, int, str, Any]] = []
        self._order = 0

    def push(self, t: float, kind: str, payload: Any) -> None:
        self._order += 1
        heapq.heappush(self.events, (t, self._order, kind, payload))

    def kick(self, w: int, t: float) -> None:
        if not self.stepping[w] and self.cores[w].has_work():
            self.stepping[w] = True
            self.push(t, "step", w)


def simulate(records: Sequence[TraceRecord], opts: SimOptions) -> SimResult:
    rng = random.Random(opts.seed)
    bs = opts.engine.block_size
    mode = opts.mode if opts.mode != "sticky" else "kv"
    selector = Selector(RoutingConfig(mode=mode, kv_overlap_score_weight=opts.overlap_weight,
                                      block_size=bs,
                                      prefill_queue_weight=opts.prefill_queue_weight))
    load = ActiveLoad()
    fleet = _Fleet(opts)
    builder = PromptBuilder(block_tokens=opts.trace_block_tokens)
    keys = [(f"w{i}", 0) for i in range(opts.workers)]
    arrival: dict[str, float] = {}
    last_token: dict[str, float] = {}
    split = opts.prefill_workers
    if split and not 0 < split < opts.workers:
        raise ValueError("disaggregated needs 1..workers-1 prefill workers")
    # Disaggregated: the decode phase of request i waits here while its prefill hop runs.
    handoff: dict[str, tuple[list[int], list[int], int]] = {}

    modeled = opts.prefill_load_model == PrefillLoadModel.LINEAR

    def tracked(prompt: list[int], max_tokens: int) -> OutputTracking | None:
        return OutputTracking(len(prompt), bs, max_tokens) if opts.track_output_blocks else None

    def candidates(workers: range, local: list[int], seq: list[int],
                   now: float) -> list[Candidate]:
        out = []
        for w in workers:
            key, core = keys[w], fleet.cores[w]
            out.append(Candidate(
                worker=key, overlap_blocks=len(core.cache.match_prefix(local)),
                tree_size=core.cache.stats().cached,
                active_prefill_tokens=load.active_prefill_tokens(key, now),
                active_decode_blocks=load.active_decode_blocks(key),
                new_request_blocks=len(seq) - load.active_prefix_len(key, seq),
                kv_total_blocks=opts.engine.num_gpu_blocks,
                max_num_batched_tokens=opts.engine.max_num_batched_tokens))
        return out

    def decode(rid: str, t: float) -> None:
        prompt, seq, max_tokens = handoff.pop(rid)
        cands = [disagg.decode_candidate(c, len(seq), opts.assume_kv_reuse)
                 for c in candidates(range(split, opts.workers), tokens_hashes(prompt, bs), seq,
                                     t)]
        decision = selector.select(cands, len(prompt), rng,
                                   overlap_weight=disagg.DECODE_TRANSFER_WEIGHT)
        assert isinstance(decision, Decision)
        w = keys.index(decision.worker)
        blocks = seq if opts.assume_kv_reuse else disagg.unique_block_hashes(rid, len(seq))
        load.add(rid, "sim", decision.worker, 0, blocks, t,
                 output=tracked(prompt, max_tokens))
        fleet.cores[w].add(rid, prompt, max_tokens, transferred_tokens=len(prompt))
        res.worker_of.append(w)
        fleet.kick(w, t)

    res = SimResult(opts.mode, [], [], 0, 0, 0, 0, 0)
    previous, nth = None, 0
    for i, rec in enumerate(records):
        nth = nth + 1 if rec.timestamp_ms == previous else 0
        previous = rec.timestamp_ms
        fleet.push(rec.timestamp_ms / 1000.0 / opts.speedup + nth * opts.burst_spacing_s,
                   "arrive", i)

    while fleet.events:
        t, _, kind, payload = heapq.heappop(fleet.events)
        if kind == "arrive":
            rec = records[payload]
            rid = f"r{payload}"
            prompt = builder.prompt(rec, filler_key=payload)
            local = tokens_hashes(prompt, bs)
            seq = prompt_hashes(prompt, bs)
            cands = candidates(range(split or opts.workers), local, seq, t)
            if split:
                cands = [disagg.prefill_candidate(c) for c in cands]
            if opts.mode == "sticky":  # reference only: longest prefix, ties to the least loaded
                best = max(cands, key=lambda c: (c.overlap_blocks, -c.active_prefill_tokens,
                                                 -c.active_decode_blocks))
                decision = Decision(best.worker, best.overlap_blocks, ())  # type: ignore[arg-type]
            else:
                decision = selector.select(cands, len(prompt), rng)
            assert isinstance(decision, Decision)
            w = keys.index(decision.worker)
            prefill = max(len(prompt) - decision.overlap_blocks * bs, 0)
            res.routed_overlap_tokens += min(decision.overlap_blocks * bs, len(prompt))
            res.best_overlap_tokens += min(max(c.overlap_blocks for c in cands) * bs, len(prompt))
            max_tokens = max(1, rec.output_length)
            if opts.max_output_tokens:
                max_tokens = min(max_tokens, opts.max_output_tokens)
            arrival[rid] = t
            if split:  # the prefill hop: one token, no active blocks; decode follows
                load.add(rid + PREFILL_SUFFIX, "sim", decision.worker, prefill, (), t,
                         modeled=modeled)
                fleet.cores[w].add(rid + PREFILL_SUFFIX, prompt, 1)
                handoff[rid] = (prompt, seq, max_tokens)
            else:
                load.add(rid, "sim", decision.worker, prefill, seq, t,
                         output=tracked(prompt, max_tokens), modeled=modeled)
                fleet.cores[w].add(rid, prompt, max_tokens)
                res.worker_of.append(w)
            fleet.kick(w, t)
        elif kind == "step":
            w = payload
            out = fleet.cores[w].step()
            fleet.push(t + out.tokens_at, "tokens", (w, out))
            fleet.push(t + out.duration, "done", w)
        elif kind == "done":  # the step's tail is over: the engine plans its next step
            fleet.stepping[payload] = False
            fleet.kick(payload, t)
        else:  # "tokens": the step's tokens reach the router (prefill done, finished)
            w, out = payload
            for req, _token in out.emitted:
                rid = req.request_id
                if rid.endswith(PREFILL_SUFFIX):
                    _hit(req, res)  # disaggregated: the prompt is computed here
                    load.prefill_completed(rid, t)  # (the prefill engine learns its speed)
                    continue
                if len(req.output) == 1:
                    _first_token(req, t, arrival, load, res, count_hit=not split)
                elif rid in last_token:
                    res.itl_s.append(t - last_token[rid])
                last_token[rid] = t
                n, isl = len(req.output), req.prompt_len
                if opts.track_output_blocks and \
                        output_blocks(isl, n, bs) > output_blocks(isl, n - 1, bs):
                    load.output_progress(rid, n)
            for req in out.finished:
                load.finish(req.request_id)
                last_token.pop(req.request_id, None)
                if req.request_id.endswith(PREFILL_SUFFIX):
                    decode(req.request_id.removesuffix(PREFILL_SUFFIX), t)
                else:
                    arrival.pop(req.request_id, None)
    return res


def _first_token(req: SimRequest, t: float, arrival: dict[str, float], load: ActiveLoad,
                 res: SimResult, *, count_hit: bool = True) -> None:
    start = arrival.get(req.request_id)
    if start is None or not load.prefill_completed(req.request_id, t):
        return
    res.ttft_s.append(t - start)
    if count_hit:
        _hit(req, res)


def _hit(req: SimRequest, res: SimResult) -> None:
    res.prompt_tokens += req.prompt_len
    res.cached_tokens += req.cached_tokens or 0
    res.preemptions += req.preemptions


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.description = __doc__
    p.add_argument("--trace", type=Path, default=None,
                   help="Mooncake JSONL trace (default: the shared conversation trace)")
    p.add_argument("--modes", default="kv,round-robin",
                   help="comma-separated: kv, round-robin, random, least-loaded, and sticky "
                        "(reference only: longest prefix, ties to the least loaded)")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--max-requests", type=int, default=1000)
    p.add_argument("--start-offset", type=float, default=0.0, help="skip the first S seconds")
    p.add_argument("--speedup", type=float, default=1.0, help="divide trace timestamps by this")
    p.add_argument("--weights", default="1.0",
                   help="kv overlap score weights to try, comma-separated (default 1.0)")
    p.add_argument("--queue-weight", type=float, default=None,
                   help="RoutingConfig.prefill_queue_weight (default: Dynamo's formula)")
    p.add_argument("--max-output-tokens", type=int, default=128, help="0 = the trace's")
    p.add_argument("--trace-block-tokens", type=int, default=DEFAULT_BLOCK_TOKENS)
    p.add_argument("--cache-trace-blocks", type=int, default=1000,
                   help="KV cache per worker, in trace blocks (default 1000)")
    p.add_argument("--kv-cache-block-size", type=int, default=16)
    defaults = EngineConfig()
    p.add_argument("--perf-model", choices=PERF_MODELS, default=defaults.perf_model,
                   help="the engines' step-time model (workers/perf_model.py; default "
                        "%(default)s: Dynamo's mocker)")
    p.add_argument("--prefill-ms-per-token", type=float, default=None,
                   help=f"--perf-model linear: prefill cost (default "
                        f"{defaults.prefill_ms_per_token}); the trace bench shrinks a 512-token "
                        f"block to 32 tokens, so 16x the default (0.8) keeps real prefill times")
    p.add_argument("--decode-ms-base", type=float, default=None,
                   help=f"--perf-model linear: cost of every step (default "
                        f"{defaults.decode_ms_base})")
    p.add_argument("--disaggregated", type=int, default=0, metavar="P",
                   help="also run kv with the first P workers as prefill engines and the rest "
                        "as decode engines (same workers, same total capacity)")
    p.add_argument("--no-assume-kv-reuse", dest="assume_kv_reuse", action="store_false",
                   help="disaggregated runs: decode decisions count no overlap "
                        "(--no-router-assume-kv-reuse)")
    p.add_argument("--prefill-load-models", default="none",
                   help="comma-separated --router-prefill-load-model values to compare "
                        "(none, linear)")
    p.add_argument("--burst-spacing-ms", type=float, default=0.0,
                   help="requests sharing a trace timestamp arrive this many ms apart (default "
                        "0: all before the engines plan their next step)")
    p.add_argument("--track-output-blocks", action="store_true",
                   help="--router-track-output-blocks, each request's osl its output cap")


def run(args: argparse.Namespace) -> int:
    path = args.trace or default_trace_path()
    if path is None:
        raise SystemExit("no trace: pass --trace (the shared conversation trace is not found)")
    records = select(load_jsonl(path), start_offset_s=args.start_offset,
                     max_requests=args.max_requests)
    block = args.kv_cache_block_size
    gpu_blocks = -(-args.cache_trace_blocks * args.trace_block_tokens // block)
    linear = {name: getattr(args, name) for name in ("prefill_ms_per_token", "decode_ms_base")
              if getattr(args, name) is not None}
    if linear and args.perf_model != LINEAR:
        raise SystemExit("--prefill-ms-per-token / --decode-ms-base set the linear step-time "
                         "model: add --perf-model linear")
    engine = EngineConfig(num_gpu_blocks=gpu_blocks, block_size=block,
                          perf_model=args.perf_model, **linear)
    capacity = cluster_capacity_blocks(workers=args.workers, gpu_blocks_per_worker=gpu_blocks,
                                       engine_block_size=block,
                                       trace_block_tokens=args.trace_block_tokens)
    ideal = ideal_rates(records, capacity)["finite"].block_rate
    print(f"{len(records)} requests, speedup {args.speedup:g}, {args.workers} workers x "
          f"{gpu_blocks} blocks; ideal hit (fleet LRU) {ideal:.1%}")
    runs = [(mode, 0) for mode in args.modes.split(",")]
    if args.disaggregated:
        runs.append(("kv", args.disaggregated))
    for mode, split in runs:
        weights = [float(x) for x in args.weights.split(",")] if mode == "kv" else [1.0]
        models = args.prefill_load_models.split(",") if mode == "kv" else ["none"]
        for wgt, model in ((w, m) for w in weights for m in models):
            if model not in PREFILL_LOAD_MODELS:
                raise SystemExit(f"unknown prefill load model {model!r}")
            opts = SimOptions(mode=mode, workers=args.workers, overlap_weight=wgt,
                              speedup=args.speedup, trace_block_tokens=args.trace_block_tokens,
                              max_output_tokens=args.max_output_tokens or None, engine=engine,
                              prefill_queue_weight=args.queue_weight, prefill_workers=split,
                              assume_kv_reuse=args.assume_kv_reuse, prefill_load_model=model,
                              track_output_blocks=args.track_output_blocks,
                              burst_spacing_s=args.burst_spacing_ms / 1000.0)
            s = simulate(records, opts).summary(args.workers - split if split else args.workers)
            label = f"{mode} w={wgt:g}" if mode == "kv" else mode
            if split:
                label = f"disagg {split}P+{args.workers - split}D w={wgt:g}"
            if len(models) > 1:
                label += f" {model}"
            print(f"{label:21} hit {s['engine_hit']:6.1%} ({s['engine_hit'] / ideal:6.1%} of "
                  f"ideal; best offered {s['best_available_hit']:6.1%})  TTFT p50 "
                  f"{s['ttft_p50_ms']:7.1f} ms p90 {s['ttft_p90_ms']:7.1f} p99 "
                  f"{s['ttft_p99_ms']:7.1f} ms  ITL p50 "
                  f"{s['itl_p50_ms']:5.1f} p90 {s['itl_p90_ms']:5.1f} p99 {s['itl_p99_ms']:5.1f} ms"
                  f"  busiest/mean "
                  f"{s['busiest_over_mean']:.2f}  preemptions {s['preemptions']}", flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
