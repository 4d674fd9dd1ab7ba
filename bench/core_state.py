"""`jetrouter bench core --router-state`: decisions the way a replica makes them.

``bench core``'s decision figures time the index and the selection with a fixed load table. The
replica decides on a whole ``RouterState``: registered workers with health weights, in-flight
requests whose load is read per worker rank, the optimistic overlay. This builds that state from
the same workload (every ``BlocksStored`` batch through ``RouterState.apply``, the workers
registered with the model ``m``, ``--router-inflight`` requests in flight on every worker, each
sharing part of the worker's conversation) and times what ``Dispatcher.decide`` runs, per path:

* ``fast``: ``request_hashes`` (compiled), ``build_candidate_columns`` (rows kept in a
  ``CandidateRowCache`` as the dispatcher keeps them), ``select_columns``;
* ``pure``: ``request_hashes`` in Python, ``build_candidates`` (a ``Candidate`` per row),
  ``Selector.select``.

Samples alternate between the paths; ``paths_differed_samples`` counts decisions that differed
(worker or overlap). Stages: ``hashing``, ``candidates`` (matching included), ``selection``.
``shed_check_p50_us`` (not in the decision's total) is the shedding check every request passes
before it (``api/shed.py``): the model's pressure from the load columns (``fast``:
``PressureRowCache``) or rank by rank (``pure``: ``model_pressure``).
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

from eventlog import compiled
from eventlog import events as ev
from eventlog.hashing import prompt_hashes
from eventlog.names import KV, ROUTER
from replicas.core.candidate_columns import select_columns
from replicas.core.candidates import (
    CandidateRowCache,
    build_candidate_columns,
    build_candidates,
    request_hashes,
)
from replicas.core.pressure_columns import PressureRowCache
from replicas.core.selection import Selector
from replicas.core.shedding import model_pressure
from replicas.core.state import RouterState, StateConfig

MODEL = "m"


def build_state(work: Any, block_size: int, inflight: int, index_form: str = "reference"
                ) -> RouterState:
    """The workload's workers registered and its KV events applied, then ``inflight`` requests in
    flight per worker (each holding a growing prefix of that worker's conversation); the prefix
    index in ``index_form`` (``--router-index-form``)."""
    state = RouterState(StateConfig(block_size=block_size, index_form=index_form))
    workers = sorted({w for w, _, _ in work.batches})
    state.apply(KV, 1, [ev.WorkerRegistered(wid, f"http://{wid}", MODEL, block_size, 100_000,
                                            8192, 1.0) for wid, _ in workers])
    position = 2
    event_ids: dict[str, int] = {}
    for (wid, rank), parent, blocks in work.batches:
        event_ids[wid] = event_ids.get(wid, 0) + 1
        state.apply(KV, position, [ev.BlocksStored(wid, event_ids[wid], rank, parent, blocks,
                                                   2.0)])
        position += 1
    routed = 1
    for i, (wid, rank) in enumerate(workers):
        seq = prompt_hashes(work.prompts[i % len(work.prompts)], block_size)
        for j in range(inflight):
            state.apply(ROUTER, routed, [ev.RequestRouted(
                f"bench-{i}-{j}", "bench", wid, rank, len(seq) * block_size,
                seq[: len(seq) * (j + 1) // (inflight + 1)], 0, 64, 0, 3.0)])
            routed += 1
    return state


def bench_state_decisions(work: Any, args: Any, selector: Selector) -> dict[str, Any]:
    # the form `--index` names (with `both`, the router's default: reference)
    form = "compact" if args.index == "compact" else "reference"
    state = build_state(work, args.block_size, args.router_inflight, form)
    rows = CandidateRowCache()
    pressures = PressureRowCache()
    bs = args.block_size
    clock = time.perf_counter_ns
    shed: dict[str, list[int]] = {"fast": [], "pure": []}

    def shed_check(path: str) -> Any:
        t0 = clock()
        if path == "fast":
            pressure = pressures.pressure(state, MODEL, block_size=bs)
        else:
            pressure = model_pressure(state, MODEL, block_size=bs)
        shed[path].append(clock() - t0)
        return pressure

    def fast(tokens: list[int], rng: random.Random) -> tuple[tuple[int, int, int], Any]:
        t0 = clock()
        seq = request_hashes(state, MODEL, tokens, bs)
        t1 = clock()
        columns = build_candidate_columns(state, MODEL, seq, rows=rows.get(state, MODEL))
        t2 = clock()
        decision = select_columns(selector, columns, len(tokens), rng)
        return (t1 - t0, t2 - t1, clock() - t2), decision

    def pure(tokens: list[int], rng: random.Random) -> tuple[tuple[int, int, int], Any]:
        t0 = clock()
        seq = request_hashes(state, MODEL, tokens, bs)
        t1 = clock()
        candidates = build_candidates(state, MODEL, seq)
        t2 = clock()
        decision = selector.select(candidates, len(tokens), rng)
        return (t1 - t0, t2 - t1, clock() - t2), decision

    paths = {"fast": fast, "pure": pure}
    rngs = {p: random.Random(args.seed + 3) for p in paths}
    stages: dict[str, list[tuple[int, int, int]]] = {p: [] for p in paths}
    differed = 0
    was = compiled.active() is not None
    try:
        for i in range(args.samples + 50):
            tokens = work.prompts[i % len(work.prompts)]
            picked = set()
            pressure = set()
            for path in (list(paths) if i % 2 else list(paths)[::-1]):
                compiled.use_compiled(path == "fast")
                pressure.add(shed_check(path))
                times, decision = paths[path](tokens, rngs[path])
                picked.add((getattr(decision, "worker", None),
                            getattr(decision, "overlap_blocks", None)))
                if i >= 50:
                    stages[path].append(times)
            differed += len(picked) > 1 or len(pressure) > 1
    finally:
        compiled.use_compiled(was)
    out: dict[str, Any] = {"inflight_per_worker": args.router_inflight, "index_form": form,
                           "paths_differed_samples": differed}
    for path, samples in stages.items():
        totals = sorted(sum(s) for s in samples)
        out[path] = {
            "decision_p50_us": round(statistics.median(totals) / 1e3, 1),
            "decision_p99_us": round(totals[min(len(totals) - 1, int(0.99 * len(totals)))] / 1e3,
                                     1),
            "decision_stage_p50_us": {
                name: round(statistics.median(s[k] for s in samples) / 1e3, 1)
                for k, name in enumerate(("hashing", "candidates", "selection"))},
            "shed_check_p50_us": round(statistics.median(shed[path][100:]) / 1e3, 1),
        }
    return out
