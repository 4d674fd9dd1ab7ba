"""What a decision's cost rows cost, per decision, by fleet size and ``--decision-candidates``.

Not a test (prints figures, asserts nothing about speed). Run:

    .venv/bin/python -m benchmarks.bench_decision_rows [--engines 8 256] [--rows 0 8]

For each fleet size and row limit (0: every candidate's row), one ``RequestRouted`` per decision
goes through what the replicas do with it: the deciding replica selects (over candidate columns
from 32 rows, as the dispatcher does) and builds the rows (``CostTable.rows``), encodes the
batch; every peer decodes it; each replica's projector writes the ledger row (SQLite, 100
messages per transaction, as the feeder groups them under load). Each stage is timed over the
whole run, five times; the best of the five is printed (the machine is shared).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from pathlib import Path

import numpy as np

from eventlog import events as ev
from eventlog.names import ROUTER
from replicas.core.candidate_columns import COLUMNS_FROM_ROWS, CandidateColumns, select_columns
from replicas.core.selection import Decision, RoutingConfig, Selector
from snapshots.db import default_url
from snapshots.projections import Projections

ISL = 2048
REPEATS = 5


def fleet(engines: int, seed: int) -> CandidateColumns:
    r = np.random.default_rng(seed)
    return CandidateColumns(
        [(f"worker-{i:04d}", 0) for i in range(engines)], r.integers(0, 40, engines),
        r.integers(0, 10_000, engines), r.random(engines) * 4000, r.random(engines) * 500,
        np.full(engines, ISL // 16), np.full(engines, 100_000), np.full(engines, 8192),
        np.ones(engines))


def routed(decisions: int, engines: int, rows: int) -> tuple[dict[str, float], list[bytes]]:
    """Seconds per stage over ``decisions`` decisions, and the encoded messages."""
    selector = Selector(RoutingConfig(kv_overlap_score_weight=8.0, prefill_queue_weight=1.0))
    columns = fleet(engines, 1)
    objects = columns.to_candidates()
    rng = random.Random(1)
    hashes = [random.Random(2).getrandbits(64) for _ in range(ISL // 16)]
    spent = {"select": 0.0, "rows": 0.0, "encode": 0.0, "decode": 0.0}
    out: list[bytes] = []
    for n in range(decisions):
        t0 = time.perf_counter()
        if engines >= COLUMNS_FROM_ROWS:
            d = select_columns(selector, columns, ISL, rng)
        else:
            d = selector.select(objects, ISL, rng)
        t1 = time.perf_counter()
        assert isinstance(d, Decision)
        cands = d.costs.rows(rows, d.worker)
        t2 = time.perf_counter()
        data = ev.encode_batch([ev.RequestRouted(
            f"req-{n}", "r1", d.worker[0], d.worker[1], ISL, hashes, d.overlap_blocks, 256, 0,
            1.7e9 + n * 1e-3, cands, "model", 16)])
        t3 = time.perf_counter()
        ev.decode_batch(data)
        t4 = time.perf_counter()
        for stage, s in zip(spent, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            spent[stage] += s
        out.append(data)
    return spent, out


async def ledger(messages: list[bytes], tmp: Path) -> float:
    """Seconds to write the ledger rows of ``messages``, 100 messages per transaction."""
    projections = Projections(default_url(tmp))
    await projections.start()
    numbered = [(i, ev.decode_batch(m)) for i, m in enumerate(messages, start=1)]
    t0 = time.perf_counter()
    for i in range(0, len(numbered), 100):
        await projections.apply_many(ROUTER, numbered[i:i + 100])
    elapsed = time.perf_counter() - t0
    await projections.close()
    return elapsed


def best(runs: list[dict[str, float]]) -> dict[str, float]:
    return {stage: min(r[stage] for r in runs) for stage in runs[0]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engines", type=int, nargs="+", default=[8, 256])
    parser.add_argument("--rows", type=int, nargs="+", default=[0, 8],
                        help="--decision-candidates values (0: every candidate's row)")
    parser.add_argument("--decisions", type=int, default=1000)
    args = parser.parse_args()
    print(f"µs per decision, best of {REPEATS} runs of {args.decisions} decisions")
    print(f"{'engines':>7} {'rows':>5} {'bytes':>6} {'select':>7} {'rows':>7} {'encode':>7} "
          f"{'decode':>7} {'ledger':>7} {'total':>7}")
    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(ledger(routed(100, 8, 0)[1], Path(tmp) / "warm-up"))  # imports, caches
        for engines in args.engines:
            for rows in args.rows:
                runs = []
                size = 0
                for k in range(REPEATS):
                    spent, messages = routed(args.decisions, engines, rows)
                    spent["ledger"] = asyncio.run(
                        ledger(messages, Path(tmp) / f"{engines}-{rows}-{k}"))
                    runs.append(spent)
                    size = len(messages[0])
                b = best(runs)
                kept = "all" if rows <= 0 else str(rows)
                print(f"{engines:>7} {kept:>5} {size:>6} "
                      + " ".join(f"{s / args.decisions * 1e6:7.1f}"
                                 for s in [*b.values(), sum(b.values())]))


if __name__ == "__main__":
    main()
