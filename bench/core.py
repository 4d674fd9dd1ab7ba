"""`jetrouter bench core`: how fast the router's state machine is, with no network in the way.

Figures, each printed (never asserted):

* ``index_apply_blocks_per_s`` - BlocksStored batches of 64 blocks (hashes precomputed) applied to
  a fresh ``PrefixIndex`` until it holds ``--blocks`` blocks over ``--workers`` workers, per
  second of this process's CPU time (so a machine shared with other work reads the same).
* ``rss_bytes_per_held_block`` - this process's resident memory after that apply minus before it
  (both after a full garbage collection), divided by the (block, worker) pairs the index holds.
  ``index_array_bytes_per_held_block`` is the part the compact index's arrays account for.
* ``decision_p50_us`` / ``decision_p99_us`` - one routing decision on that index, timed per call
  with ``perf_counter_ns``: hash a ``--prompt-tokens`` prompt, ``find_matches``, build the
  candidates, select with ``jetrouter serve``'s routing defaults. ``--decision-path fast`` (the
  default): the compiled hashing (``eventlog/_fasthash.c``) and candidate columns
  (``candidate_columns.select_columns``); ``pure``: the Python hashing, one ``Candidate`` object
  per worker and ``Selector.select``; ``both``: the two interleaved sample by sample, the pure
  figures under ``pure_path`` and fast/pure ratios under ``path_ratios``.
  Each query is a new turn of a conversation one worker has cached most of (``--hit-fraction``);
  every other worker holds the shared system prompt the conversation starts with, so several
  workers match at different depths.
* ``router_state`` (``--router-state``) - the decision as the replica's dispatcher makes it, on a
  ``RouterState`` built from the same workload (``bench/core_state.py``; its index in the form
  ``--index`` names, reference with ``both``), both paths.
* ``replication_us_per_request`` / ``replication_router_events_per_s`` - what applying another
  replica's routed requests costs (`bench.replication`).
* ``replay_block_events_per_s`` - a real ``nats-server``: ``--replay-batches`` BlocksStored
  batches are published (not timed), then a ``StreamReader`` from sequence 1 decodes them and
  applies each into a fresh index; the clock runs from creating the reader to the last batch.
  The replays run on the replica's event loop (uvloop where installed, as uvicorn picks).
  ``replay_block_events_per_cpu_s``: the same per second of this process's CPU (the reader and
  the index, not nats-server), which a shared machine's scheduler moves less.
* ``index_apply_runs_blocks_per_s`` / ``replay_runs_block_events_per_s`` - the same two, applied
  in runs as a replica catching up applies them (``bench/core_runs.py``).

``--index both`` (before/after in one sitting) runs every figure but replication for the compact
index (``replicas/core/index.py``, what the router runs) and the reference form it replaced
(``index_reference.py``): the apply figures one after the other (compact first, so memory the
reference form leaves behind cannot flatter the compact one), the decisions interleaved sample by
sample, the replays one after the other from the same stream. The top-level figures are the
compact index's; ``reference`` holds the same keys for the reference form and ``ratios`` the
compact/reference ratio of each.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import xxhash

from bench.core_runs import bench_apply_runs, replay_runs
from bench.replication import add_arguments as add_replication_arguments
from bench.replication import bench_replication
from eventlog import compiled
from eventlog.hashing import prompt_hashes, tokens_hashes
from leanhttp.loop import run as run_loop
from replicas.core import index_reference
from replicas.core.index import PrefixIndex, WorkerKey
from replicas.core.state import RouterState, StateConfig

BATCH_BLOCKS = 64
VOCAB = 50_000
AnyIndex = PrefixIndex | index_reference.PrefixIndex
INDEX_FORMS: dict[str, type[PrefixIndex] | type[index_reference.PrefixIndex]] = {
    "compact": PrefixIndex, "reference": index_reference.PrefixIndex}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print only the JSON object")
    p.add_argument("--workers", type=int, default=64, help="workers (dp rank 0 each)")
    p.add_argument("--blocks", type=int, default=1_000_000, help="blocks held by the index")
    p.add_argument("--prompt-tokens", type=int, default=8192, help="tokens per routed prompt")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--samples", type=int, default=2000, help="routing decisions to time")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--system-prompt-blocks", type=int, default=64,
                   help="blocks of the system prompt every worker holds")
    p.add_argument("--hit-fraction", type=float, default=0.9,
                   help="share of a query prompt its conversation's worker has cached")
    p.add_argument("--replay-batches", type=int, default=4000,
                   help="BlocksStored batches of 64 blocks for the replay figure (0 = skip)")
    p.add_argument("--index", choices=["compact", "reference", "both"], default="reference",
                   help="which prefix index form to measure (default: the router's default, "
                        "reference; both: side by side, one sitting)")
    p.add_argument("--decision-path", choices=["fast", "pure", "both"], default="fast",
                   help="fast: compiled hashing and candidate columns (the default); pure: the "
                        "Python hashing and one Candidate object per worker; both: side by side, "
                        "one sitting (the pure figures under pure_path)")
    p.add_argument("--serve-gc", action="store_true",
                   help="time decisions and the replays under the replica's garbage-collector "
                        "settings "
                        "(api/serve.py tune_gc: start-up objects frozen, young threshold 10,000)")
    p.add_argument("--router-state", action="store_true",
                   help="also time decisions as the replica makes them, on a RouterState built "
                        "from the same workload, fast and pure paths side by side "
                        "(bench/core_state.py; the figures under router_state)")
    p.add_argument("--router-inflight", type=int, default=0,
                   help="with --router-state: requests in flight on every worker")
    add_replication_arguments(p)


@dataclass(slots=True)
class Workload:
    batches: list[tuple[WorkerKey, int | None, list[tuple[int, int]]]]
    prompts: list[list[int]]
    owners: list[WorkerKey]
    stored_blocks: int


def build_workload(args: argparse.Namespace) -> Workload:
    """Deterministic KV events and query prompts (everything hashed before any clock starts)."""
    rng = random.Random(args.seed)
    workers: list[WorkerKey] = [(f"worker-{i:03d}", 0) for i in range(args.workers)]
    bs = args.block_size
    system = [rng.randrange(VOCAB) for _ in range(args.system_prompt_blocks * bs)]
    prompt_blocks = args.prompt_tokens // bs
    batches: list[tuple[WorkerKey, int | None, list[tuple[int, int]]]] = []

    def chain(worker: WorkerKey, local: Sequence[int]) -> int:
        parent: int | None = None
        for start in range(0, len(local), BATCH_BLOCKS):
            blocks = [(rng.getrandbits(64), t) for t in local[start:start + BATCH_BLOCKS]]
            batches.append((worker, parent, blocks))
            parent = blocks[-1][0]
        return len(local)

    stored = 0
    prompts: list[list[int]] = []
    owners: list[WorkerKey] = []
    system_local = tokens_hashes(system, bs)
    for worker in workers:
        # one cached conversation per worker: the system prompt plus its own turns
        tail = [rng.randrange(VOCAB) for _ in range(args.prompt_tokens - len(system))]
        prompt = system + tail
        prompts.append(prompt)
        owners.append(worker)
        cached = max(len(system_local), int(prompt_blocks * args.hit_fraction))
        stored += chain(worker, tokens_hashes(prompt, bs)[:cached])
    # fill the rest with unrelated conversations (random block contents), round-robin workers
    i = 0
    while stored < args.blocks:
        worker = workers[i % len(workers)]
        i += 1
        n = min(prompt_blocks, args.blocks - stored)
        local = [rng.getrandbits(64) for _ in range(n)]
        if n > len(system_local):
            local[: len(system_local)] = system_local  # most conversations share the system prompt
        stored += chain(worker, local)
    return Workload(batches, prompts, owners, stored)


def rss_bytes() -> int:
    """Resident set size of this process (Linux; 0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def bench_apply(work: Workload, form: str = "compact") -> tuple[AnyIndex, float, dict[str, Any]]:
    gc.collect()
    rss0 = rss_bytes()
    index = INDEX_FORMS[form]()
    t0 = time.process_time()  # CPU time: other processes on a busy machine do not count
    for worker, parent, blocks in work.batches:
        index.store(worker, parent, blocks)
    elapsed = time.process_time() - t0
    gc.collect()
    held = max(index.total_blocks, 1)
    memory: dict[str, Any] = {"rss_bytes_per_held_block": round((rss_bytes() - rss0) / held, 1)}
    if isinstance(index, PrefixIndex):
        memory["index_array_bytes_per_held_block"] = round(index.nbytes() / held, 1)
    return index, elapsed, memory


@contextmanager
def replica_gc(enabled: bool) -> Iterator[None]:
    """With ``enabled``, the replica's garbage-collector settings (api/serve.py ``tune_gc``):
    what exists now (the workload's millions of tuples among it) is frozen, young collections
    every 10,000 net allocations; the defaults again afterwards."""
    if not enabled:
        yield
        return
    from api.serve import tune_gc

    was = gc.get_threshold()
    tune_gc()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*was)


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def bench_decisions(indexes: dict[str, AnyIndex], work: Workload, args: argparse.Namespace,
                    paths: Sequence[str] = ("fast",)) -> dict[str, dict[str, Any]]:
    """Decision figures per index form, and per decision path within each form (``pure`` figures
    under the form's ``pure_path`` key). With several forms or paths the samples alternate between
    them (which goes first alternates too), so load on a shared machine falls on all alike."""
    from api.config import routing_config, serve_defaults
    from replicas.core.selection import Selector

    rng = random.Random(args.seed + 1)
    keys = sorted({w for w, _, _ in work.batches})
    load = {k: (rng.randrange(0, 4096), rng.randrange(0, 2000)) for k in keys}
    # `serve`'s routing defaults (no environment: a benchmark's figures must not depend on it),
    # so this times the formula the router runs.
    routing = replace(routing_config(serve_defaults(environ={})), block_size=args.block_size)
    selector = Selector(routing)
    bs = args.block_size
    variants = [(form, path) for form in indexes for path in paths]
    rngs = {v: random.Random(args.seed + 2) for v in variants}  # equal tie breaks for every one
    stages = {v: {"hashing": [], "matching": [], "candidates": [], "selection": []}
              for v in variants}
    totals: dict[tuple[str, str], list[int]] = {v: [] for v in variants}
    core: dict[tuple[str, str], list[int]] = {v: [] for v in variants}  # less the candidates
    right = dict.fromkeys(variants, 0)
    differ = dict.fromkeys(indexes, 0)
    steps = {"fast": _fast_decision(keys, load), "pure": _pure_decision(keys, load)}
    compiled_was = compiled.active() is not None
    with replica_gc(args.serve_gc):
        try:
            for i in range(args.samples + 50):  # the first 50 warm caches and are not recorded
                q = i % len(work.prompts)
                tokens = work.prompts[q]
                picked: dict[tuple[str, str], Any] = {}
                for variant in (variants if i % 2 else variants[::-1]):
                    form, path = variant
                    compiled.use_compiled(path == "fast")
                    times, decision = steps[path](indexes[form], tokens, bs, selector,
                                                  rngs[variant])
                    picked[variant] = (getattr(decision, "worker", None),
                                       getattr(decision, "overlap_blocks", None))
                    if i >= 50:
                        right[variant] += getattr(decision, "worker", None) == work.owners[q]
                        for name, dt in zip(stages[variant], times, strict=True):
                            stages[variant][name].append(dt)
                        totals[variant].append(sum(times))
                        core[variant].append(sum(times) - times[2])
                for form in indexes:  # the paths must decide alike: count any sample where not
                    differ[form] += len({picked[(form, path)] for path in paths}) > 1
        finally:
            compiled.use_compiled(compiled_was)
    us = 1e-3

    def figures(v: tuple[str, str]) -> dict[str, Any]:
        return {
            "decision_p50_us": round(statistics.median(totals[v]) * us, 1),
            "decision_p99_us": round(percentile(totals[v], 0.99) * us, 1),
            "decision_excluding_candidates_p50_us": round(statistics.median(core[v]) * us, 1),
            "decision_stage_p50_us": {k: round(statistics.median(x) * us, 1)
                                      for k, x in stages[v].items()},
            "decision_with_selection": True,
            "decision_path": v[1],
            "decision_routing_weights": [routing.kv_overlap_score_weight,
                                         routing.prefill_queue_weight],
            "decision_picked_cached_worker": round(right[v] / max(len(totals[v]), 1), 3),
            "query_blocks": len(prompt_hashes(work.prompts[0], bs)),
        }

    out: dict[str, dict[str, Any]] = {}
    for form in indexes:
        out[form] = figures((form, paths[0]))
        if len(paths) > 1:
            out[form]["pure_path"] = pure = figures((form, paths[1]))
            out[form]["path_ratios"] = ratios(out[form], pure)
            out[form]["paths_differed_samples"] = differ[form]
    return out


Step = Callable[[AnyIndex, list[int], int, Any, random.Random],
                tuple[tuple[int, int, int, int], Any]]


def _pure_decision(keys: list[WorkerKey], load: dict[WorkerKey, tuple[int, int]]) -> Step:
    """The decision as the Python code makes it: one ``Candidate`` object per worker."""
    from replicas.core.selection import Candidate

    clock = time.perf_counter_ns

    def step(index: AnyIndex, tokens: list[int], bs: int, selector: Any, rng: random.Random
             ) -> tuple[tuple[int, int, int, int], Any]:
        t0 = clock()
        seq = prompt_hashes(tokens, bs)
        t1 = clock()
        scores = index.find_matches(seq)
        t2 = clock()
        n = len(seq)
        overlap, sizes = scores.scores, scores.tree_sizes
        cands = [
            Candidate(k, overlap.get(k, 0), sizes.get(k, 0), load[k][0], load[k][1],
                      n, 100_000, 8192)
            for k in keys
        ]
        t3 = clock()
        decision = selector.select(cands, len(tokens), rng)
        t4 = clock()
        return (t1 - t0, t2 - t1, t3 - t2, t4 - t3), decision

    return step


def _fast_decision(keys: list[WorkerKey], load: dict[WorkerKey, tuple[int, int]]) -> Step:
    """The same decision over columns: ``match_columns`` (no dict per worker) and candidate
    columns (``replicas/core/candidate_columns.py``). The load columns stand for the load state
    as the objects' ``load`` dict does; they follow the index's rows, rebuilt when those change
    (never here: the index is not written while decisions are timed)."""
    from replicas.core.candidate_columns import CandidateColumns, select_columns

    clock = time.perf_counter_ns
    aligned: dict[int, tuple[list[WorkerKey], tuple[np.ndarray, ...]]] = {}

    def load_columns(index: AnyIndex, workers: list[WorkerKey]) -> tuple[np.ndarray, ...]:
        cached = aligned.get(id(index))
        if cached is None or cached[0] is not workers:
            if sorted(workers) != keys:  # every worker holds blocks in this workload
                raise RuntimeError("the index's rows are not the workload's workers")
            count = len(workers)
            cached = aligned[id(index)] = (workers, (
                np.array([load[k][0] for k in workers], dtype=np.float64),
                np.array([load[k][1] for k in workers], dtype=np.float64),
                np.full(count, 100_000, dtype=np.int64), np.full(count, 8192, dtype=np.int64),
                np.ones(count, dtype=np.float64)))
        return cached[1]

    def step(index: AnyIndex, tokens: list[int], bs: int, selector: Any, rng: random.Random
             ) -> tuple[tuple[int, int, int, int], Any]:
        t0 = clock()
        seq = prompt_hashes(tokens, bs)
        t1 = clock()
        match = index.match_columns(seq)
        t2 = clock()
        prefill, decode, kv_total, batched, weights = load_columns(index, match.workers)
        columns = CandidateColumns(
            match.workers, match.overlap_blocks, match.tree_sizes, prefill, decode,
            np.full(len(match.workers), len(seq), dtype=np.int64), kv_total, batched, weights)
        t3 = clock()
        decision = select_columns(selector, columns, len(tokens), rng)
        t4 = clock()
        return (t1 - t0, t2 - t1, t3 - t2, t4 - t3), decision

    return step


async def bench_replay(work: Workload, batches: int, forms: Sequence[str] = ("compact",)
                       ) -> dict[str, dict[str, Any]]:
    try:
        import nats

        from eventlog.appender import Appender
        from eventlog.events import BlocksStored
        from eventlog.names import KV, Names
        from eventlog.streams import ensure_streams
        from natsops.server import NatsServer
    except ImportError as exc:  # pragma: no cover - the event log pieces are written in parallel
        return {f: {"replay_block_events_per_s": None, "replay_skipped": f"missing {exc.name}"}
                for f in forms}
    server = NatsServer()
    await asyncio.to_thread(server.start)
    nc = None
    try:
        nc = await nats.connect(server.url)
        js = nc.jetstream()
        names = Names(namespace="jrbench")
        await ensure_streams(js, names)
        appender = Appender(js)
        published = work.batches[:batches]
        event_ids: dict[str, int] = {}
        pending: list[asyncio.Future[int]] = []
        for n, (worker, parent, blocks) in enumerate(published):
            event_ids[worker[0]] = event_ids.get(worker[0], 0) + 1
            event = BlocksStored(worker[0], event_ids[worker[0]], worker[1], parent, blocks,
                                 1.7e9 + n)
            pending.append(asyncio.ensure_future(appender.append(
                names.kv_subject(worker[0]), [event], f"bench-{n}")))
            if len(pending) >= 256:  # publishing is not timed; keep a window of acks in flight
                await asyncio.gather(*pending)
                pending.clear()
        await asyncio.gather(*pending)
        last = (await js.stream_info(names.stream(KV))).state.last_seq
        out: dict[str, dict[str, Any]] = {}
        for form in forms:
            out[form] = await _replay_once(js, names.stream(KV), last, INDEX_FORMS[form](),
                                           len(published))
            out[form].update(await replay_runs(js, names.stream(KV), last, INDEX_FORMS[form]()))
        return out
    finally:
        if nc is not None:
            await nc.close()
        await asyncio.to_thread(server.cleanup)


async def _replay_once(js: Any, stream: str, last: int, index: AnyIndex, batches: int
                       ) -> dict[str, Any]:
    from eventlog.events import BlocksStored
    from eventlog.reader import StreamReader
    from replicas.core.state_run import kv_decoder

    applied = 0
    gc.collect()
    t0, cpu0 = time.perf_counter(), time.process_time()
    # as the replica's KV follower reads (replicas/runtime/follower.py): no decode timing, and
    # blocks left packed where the index's kernel takes them so
    reader = StreamReader(js, stream, start_seq=1, time_decode=False, decode=kv_decoder(index))
    try:
        async for seq, events in reader:
            for e in events:
                if isinstance(e, BlocksStored):
                    index.store((e.worker_id, e.dp_rank), e.parent_hash, e.blocks)
                    applied += len(e.blocks)
            if seq >= last:
                break
    finally:
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        await reader.close()
    return {
        "replay_block_events_per_s": round(applied / elapsed),
        # this process's CPU only (the reader and the index; nats-server is another process):
        # steadier than the wall clock on a shared machine
        "replay_block_events_per_cpu_s": round(applied / cpu) if cpu > 0 else None,
        "replay_batches_per_s": round(batches / elapsed),
        "replay_blocks": applied,
        "replay_seconds": round(elapsed, 3),
    }


def machine_facts() -> dict[str, Any]:
    facts: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "machine": platform.machine(),
        "numpy": np.__version__,
        "xxhash": xxhash.VERSION,
    }
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    facts["cpu_model"] = line.split(":", 1)[1].strip()
                    break
        facts["loadavg_1m"] = os.getloadavg()[0]
    except OSError:
        pass
    return facts


def run(args: argparse.Namespace) -> int:
    t_build = time.perf_counter()
    work = build_workload(args)
    build_s = time.perf_counter() - t_build
    forms = ["compact", "reference"] if args.index == "both" else [args.index]
    per_form: dict[str, dict[str, Any]] = {}
    indexes: dict[str, AnyIndex] = {}
    for form in forms:  # compact first: see the module docstring
        index, apply_s, memory = bench_apply(work, form)
        indexes[form] = index
        per_form[form] = {
            "index_apply_blocks_per_s": round(work.stored_blocks / apply_s),
            "index_blocks": index.total_blocks,
            "index_nodes": index.node_count,
            **memory,
        }
    paths = ["fast", "pure"] if args.decision_path == "both" else [args.decision_path]
    for form, figures in bench_decisions(indexes, work, args, paths).items():
        per_form[form].update(figures)
    for form in forms:  # in runs, as a replica catching up applies (bench/core_runs.py)
        per_form[form].update(bench_apply_runs(work.batches, INDEX_FORMS[form](), indexes[form]))
    indexes.clear()
    gc.collect()
    router_state = None
    if args.router_state:
        from api.config import routing_config, serve_defaults
        from bench.core_state import bench_state_decisions
        from replicas.core.selection import Selector

        routing = replace(routing_config(serve_defaults(environ={})), block_size=args.block_size)
        router_state = bench_state_decisions(work, args, Selector(routing))
        gc.collect()
    if args.replay_batches > 0:
        with replica_gc(args.serve_gc):
            # on the replica's loop (uvicorn runs it on uvloop where installed)
            replays = run_loop(bench_replay(work, args.replay_batches, forms))
        for form, figures in replays.items():
            per_form[form].update(figures)
    else:
        for form in forms:
            per_form[form]["replay_block_events_per_s"] = None
    result: dict[str, Any] = {"index_form": forms[0], **per_form[forms[0]]}
    if router_state is not None:
        result["router_state"] = router_state
    if len(forms) > 1:
        result["reference"] = per_form["reference"]
        result["ratios"] = ratios(per_form["compact"], per_form["reference"])
    result.update(bench_replication(
        args, lambda: RouterState(StateConfig(block_size=args.block_size))))
    result["config"] = {
        "workers": args.workers, "blocks": args.blocks, "prompt_tokens": args.prompt_tokens,
        "block_size": args.block_size, "samples": args.samples, "seed": args.seed,
        "system_prompt_blocks": args.system_prompt_blocks, "hit_fraction": args.hit_fraction,
        "replay_batches": args.replay_batches, "batch_blocks": BATCH_BLOCKS,
        "workload_build_s": round(build_s, 2),
        "replication_requests": args.replication_requests,
        "replication_prompt_tokens": args.replication_prompt_tokens,
        "replication_workers": args.replication_workers,
        "replication_inflight": args.replication_inflight,
        "replication_group": args.replication_group,
        "index": args.index,
        "router_state": args.router_state,
        "serve_gc": args.serve_gc,
        "router_inflight": args.router_inflight,
        "decision_path": args.decision_path,
        "compiled_hashing": compiled.available(),
        "compiled_hashing_calls_xxhash_c": compiled.DIRECT_XXH3,
    }
    result["machine"] = machine_facts()
    if not args.json:
        print_table(result)
    print(json.dumps(result, sort_keys=True))
    return 0


def ratios(after: dict[str, Any], before: dict[str, Any]) -> dict[str, float | None]:
    """after / before for every numeric top-level figure both have."""
    out: dict[str, float | None] = {}
    for key, value in after.items():
        other = before.get(key)
        if isinstance(value, int | float) and isinstance(other, int | float) \
                and not isinstance(value, bool):
            out[key] = round(value / other, 3) if other else None
    return out


def print_table(result: dict[str, Any]) -> None:
    stages = result.get("decision_stage_p50_us", {})
    rows = [
        ("index form", result["index_form"]),
        ("index RSS (bytes per held block)", result["rss_bytes_per_held_block"]),
        ("index apply (blocks/s)", result["index_apply_blocks_per_s"]),
        ("  in runs of 2048 events (blocks/s)", result.get("index_apply_runs_blocks_per_s")),
        ("decision p50 (us)", result["decision_p50_us"]),
        ("decision p99 (us)", result["decision_p99_us"]),
        *((f"  {k} p50 (us)", v) for k, v in stages.items()),
        ("replication (us per peer request)", result.get("replication_us_per_request")),
        ("  with the load's block holders kept (us)",
         result.get("replication_load_holders_us_per_request")),
        ("replication (router events/s)", result.get("replication_router_events_per_s")),
        ("  one event per message (us/request)",
         result.get("replication_single_event_us_per_request")),
        ("replay (block events/s)", result.get("replay_block_events_per_s")),
        ("replay (block events per CPU second)", result.get("replay_block_events_per_cpu_s")),
        ("  a pull's messages as one run (block events/s)",
         result.get("replay_runs_block_events_per_s")),
    ]
    pure = result.get("pure_path")
    if pure is not None:
        rows += [
            ("pure path: decision p50 (us)", pure["decision_p50_us"]),
            ("pure path: decision p99 (us)", pure["decision_p99_us"]),
            *((f"  pure path: {k} p50 (us)", v) for k, v in pure["decision_stage_p50_us"].items()),
            ("samples where the paths decided differently", result.get("paths_differed_samples")),
        ]
    state = result.get("router_state")
    if state is not None:
        for path in ("fast", "pure"):
            rows += [(f"router state, {path}: decision p50 (us)", state[path]["decision_p50_us"]),
                     (f"router state, {path}: decision p99 (us)", state[path]["decision_p99_us"]),
                     *((f"  router state, {path}: {k} p50 (us)", v)
                       for k, v in state[path]["decision_stage_p50_us"].items()),
                     (f"router state, {path}: shedding check p50 (us)",
                      state[path].get("shed_check_p50_us"))]
        rows.append(("router state: samples where the paths differed",
                     state["paths_differed_samples"]))
    reference = result.get("reference")
    if reference is not None:
        rows += [
            ("reference: RSS (bytes per held block)", reference["rss_bytes_per_held_block"]),
            ("reference: apply (blocks/s)", reference["index_apply_blocks_per_s"]),
            ("reference: decision p50 (us)", reference["decision_p50_us"]),
            ("reference: decision p99 (us)", reference["decision_p99_us"]),
            ("reference: replay (block events/s)", reference.get("replay_block_events_per_s")),
        ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    print()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.core", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
