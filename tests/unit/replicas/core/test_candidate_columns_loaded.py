"""Decisions over the load columns equal the reference path's, request after request, on a loaded
fleet whose in-flight requests keep arriving and leaving.

A random fleet of up to 90 (worker, dp rank) rows (more slots than a machine word has bits),
some of them caching prefixes of the prompts; then a random sequence of routed requests (sharing
prefixes, without KV reuse, for either phase of a disaggregated request, with output tracking
and the linear prefill model), first tokens, output progress, finishes, lost replicas and health
changes, with decisions in between. Each decision is made both ways on the same state:
``build_candidate_columns`` (its rows kept in a ``CandidateRowCache`` across the whole sequence,
as the dispatcher keeps them) and ``select_columns``, against ``build_candidates`` and
``Selector.select`` with the per-rank ``ActiveLoad`` reads. The same rows and values, the same
engine, the same cost table and the same tie-break draws. And at each decision the shedding
check's pressure from the columns (``PressureRowCache``, kept across the sequence too) is
``model_pressure``'s, bit for bit, with workers retired for cause and on purpose among the
events."""

from __future__ import annotations

import random

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from eventlog import events as ev
from eventlog.hashing import prompt_hashes, tokens_hashes
from eventlog.names import CONTROL, KV, ROUTER
from replicas.core import candidates, disagg
from replicas.core.candidate_columns import CandidateColumns, select_columns
from replicas.core.candidates import CandidateRowCache, build_candidate_columns, build_candidates
from replicas.core.pressure_columns import PressureRowCache
from replicas.core.selection import Decision, RoutingConfig, Selector
from replicas.core.shedding import model_pressure
from replicas.core.state import RouterState, StateConfig

BS = 4
PROMPTS = [[1000 * p + t for t in range(10 * BS)] for p in range(4)]  # 10 blocks each
SEQS = [prompt_hashes(p, BS) for p in PROMPTS]
SYSTEM = PROMPTS[0][: 3 * BS]  # prompts 1-3 start with prompt 0's first 3 blocks
for p in PROMPTS[1:]:
    p[: len(SYSTEM)] = SYSTEM
SEQS = [prompt_hashes(p, BS) for p in PROMPTS]

event = st.one_of(
    # most requests go to a few ranks: they share blocks there, and their prefill rate is learned
    st.tuples(st.just("route"), st.one_of(st.integers(0, 3), st.integers(0, 89)),
              st.integers(0, 3), st.integers(0, 10),
              st.sampled_from(["", "", "", disagg.PREFILL, disagg.DECODE]),
              st.sampled_from([True, True, False]), st.booleans(),
              st.sampled_from(["none", "linear"]), st.sampled_from(["A", "B"])),
    st.tuples(st.just("first_token"), st.integers(0, 5)),
    st.tuples(st.just("progress"), st.integers(0, 5), st.integers(1, 30)),
    st.tuples(st.just("finish"), st.integers(0, 5)),
    st.tuples(st.just("lost"), st.sampled_from(["A", "B"])),
    st.tuples(st.just("health"), st.integers(0, 44),
              st.sampled_from(["healthy", "suspicious", "unhealthy"])),
    st.tuples(st.just("retire"), st.integers(0, 44), st.booleans()),
    st.tuples(st.just("decide"), st.integers(0, 3), st.integers(0, 10), st.booleans()),
)


def fleet(workers: int, dp: list[int], cached: list[int]) -> tuple[RouterState, list]:
    state = RouterState(StateConfig(block_size=BS))
    state.apply(KV, 1, [ev.WorkerRegistered(f"w{i:02d}", f"http://w{i}", "m", BS, 64 + i,
                                            256, 1.0, dp_size=dp[i % len(dp)])
                        for i in range(workers)])
    ranks = [(f"w{i:02d}", r) for i in range(workers) for r in range(dp[i % len(dp)])]
    for i, blocks in enumerate(cached[: len(ranks)]):
        wid, rank = ranks[i]
        local = tokens_hashes(PROMPTS[i % 4], BS)[:blocks]
        if local:
            state.apply(KV, 2 + i, [ev.BlocksStored(wid, 1 + rank, rank, None,
                                                    [(10_000 * i + j, h)
                                                     for j, h in enumerate(local)], 2.0)])
    return state, ranks


@settings(max_examples=60, deadline=None)
@given(workers=st.integers(1, 45), dp=st.lists(st.integers(1, 2), min_size=1, max_size=3),
       cached=st.lists(st.integers(0, 10), max_size=20),
       events=st.lists(event, min_size=20, max_size=80),
       weight=st.sampled_from([8.0, 1.0, 0.0]), seed=st.integers(0, 2**16),
       grouped_from=st.sampled_from([0, 3, 10**9]))
def test_loaded_decisions_equal_the_reference(workers: int, dp: list[int], cached: list[int],
                                              events: list[tuple], weight: float, seed: int,
                                              grouped_from: int) -> None:
    # From how many loaded rows the active prefixes come from the grouped search (which then
    # keeps the holders for the rest of the sequence): always, from a few on, never.
    was = candidates.GROUPED_PREFIX_FROM
    candidates.GROUPED_PREFIX_FROM = grouped_from
    try:
        run(workers, dp, cached, events, weight, seed)
    finally:
        candidates.GROUPED_PREFIX_FROM = was


def run(workers: int, dp: list[int], cached: list[int], events: list[tuple], weight: float,
        seed: int) -> None:
    state, ranks = fleet(workers, dp, cached)
    selector = Selector(RoutingConfig(kv_overlap_score_weight=weight, prefill_queue_weight=1.0,
                                      block_size=BS))
    rows = CandidateRowCache()
    pressures = PressureRowCache()
    rng_columns, rng_objects = random.Random(seed), random.Random(seed)
    router = control = 1
    kv = 1000
    routed: list[str] = []  # request ids routed so far: the other events name one of them
    ts = 3.0
    for e in events:
        ts += 0.25
        kind, *a = e
        if kind == "route":
            i, p, n, phase, reuse, track, model, replica = a
            wid, rank = ranks[i % len(ranks)]
            routed.append(f"q{len(routed)}")
            out = [ev.RequestRouted(routed[-1], replica, wid, rank, n * BS + 1,
                                    SEQS[p][:n], 0, 8, 0, ts, phase=phase, kv_reuse=reuse,
                                    track_output_blocks=track, prefill_load_model=model)]
        elif kind in ("first_token", "progress", "finish"):
            if not routed:
                continue
            rid = routed[-1 - a[0] % len(routed)]  # the newest ones most often
            out = [ev.PrefillCompleted(rid, ts) if kind == "first_token" else
                   ev.OutputProgress(rid, a[1], ts) if kind == "progress" else
                   ev.RequestFinished(rid, "ok", 3, ts)]
        elif kind == "lost":
            out = [ev.ReplicaLost(a[0], ts)]
        elif kind == "health":
            state.apply(CONTROL, control, [ev.WorkerHealthChanged(f"w{a[0] % workers:02d}",
                                                                  a[1], "test", ts)])
            control += 1
            continue
        elif kind == "retire":
            state.apply(KV, kv, [ev.WorkerRetired(f"w{a[0] % workers:02d}",
                                                  "heartbeat timeout" if a[1] else "shutdown",
                                                  ts)])
            kv += 1
            continue
        else:
            p, n, reuse = a
            decide(state, selector, rows, SEQS[p][:n], n * BS + 1, reuse, rng_columns,
                   rng_objects)
            for block_size, usable in ((BS, 1.0), (1 + n, 0.35)):
                assert pressures.get(state, "m").pressure(
                    block_size=block_size, usable_fraction=usable) == model_pressure(
                    state, "m", block_size=block_size, usable_fraction=usable)
            continue
        state.apply(ROUTER, router, out)
        router += 1
    for p in range(4):
        decide(state, selector, rows, SEQS[p], 10 * BS, True, rng_columns, rng_objects)


def decide(state: RouterState, selector: Selector, rows: CandidateRowCache, seq: list[int],
           isl: int, reuse: bool, rng_columns: random.Random, rng_objects: random.Random
           ) -> None:
    objects = build_candidates(state, "m", seq, assume_kv_reuse=reuse)
    columns = build_candidate_columns(state, "m", seq, assume_kv_reuse=reuse,
                                      rows=rows.get(state, "m"))
    want = CandidateColumns.from_candidates(objects)
    assert columns.workers == want.workers
    for name in ("overlap_blocks", "tree_size", "active_prefill_tokens", "active_decode_blocks",
                 "new_request_blocks", "kv_total_blocks", "max_num_batched_tokens", "weight"):
        got, expected = getattr(columns, name), getattr(want, name)
        assert got.dtype == expected.dtype and np.array_equal(got, expected), name
    got = select_columns(selector, columns, isl, rng_columns)
    expected = selector.select(objects, isl, rng_objects)
    assert type(got) is type(expected)
    if isinstance(expected, Decision):
        assert isinstance(got, Decision)
        assert (got.worker, got.overlap_blocks) == (expected.worker, expected.overlap_blocks)
    assert got.costs == expected.costs
    assert rng_columns.random() == rng_objects.random()  # the same draws were taken


def test_a_decaying_prefill_is_read_at_the_states_time() -> None:
    state, _ = fleet(40, [1], [])
    selector = Selector(RoutingConfig(kv_overlap_score_weight=8.0, prefill_queue_weight=1.0,
                                      block_size=BS))
    linear = {"prefill_load_model": "linear"}
    state.apply(ROUTER, 1, [ev.RequestRouted("a", "A", "w03", 0, 400, SEQS[1][:4], 0, 8, 0, 3.0,
                                             **linear)])
    state.apply(ROUTER, 2, [ev.PrefillCompleted("a", 5.0)])  # w03 learns: 200 tokens a second
    state.apply(ROUTER, 3, [ev.RequestRouted("b", "A", "w03", 0, 400, SEQS[2][:6], 0, 8, 0, 5.0,
                                             **linear)])
    state.apply(ROUTER, 4, [ev.RequestRouted("c", "B", "w07", 0, 40, SEQS[2][:9], 0, 8, 0, 6.0)])
    assert state.load.active_prefill_tokens(("w03", 0), state.now) == 200.0  # half done
    rows = CandidateRowCache()
    decide(state, selector, rows, SEQS[2], 10 * BS, True, random.Random(1), random.Random(1))
    got = PressureRowCache().get(state, "m").pressure(block_size=BS)
    assert got == model_pressure(state, "m", block_size=BS)
    # w03: 7 distinct blocks (a and b share 3) + 200 tokens left; w07: 9 blocks + 40 tokens
    assert got is not None and got.demand == 7 + 200 / BS + 9 + 40 / BS
