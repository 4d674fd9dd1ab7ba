"""Micro-benchmark of the routing hot path (prints figures; asserts nothing about time).

    .venv/bin/python -m tests.unit.bench_routing_core [--json]

Measures ``Selector.select`` over 64 candidates (kv mode, temperature 0, with and without busy
thresholds), the deferred cost-table build the decision ledger pays later, and
``ActiveLoad.active_prefix_len`` for 64 workers x a 512-block query.
"""

from __future__ import annotations

import json
import random
import sys
import timeit
from collections.abc import Callable

from replicas.core.load import ActiveLoad
from replicas.core.selection import BusyThresholds, Candidate, RoutingConfig, Selector


def _per_call_us(fn: Callable[[], object], number: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6


def _candidates(rng: random.Random, n: int) -> list[Candidate]:
    return [
        Candidate(
            worker=(f"w{i:02d}", 0),
            overlap_blocks=rng.randrange(30),
            tree_size=rng.randrange(10_000),
            active_prefill_tokens=rng.randrange(5_000),
            active_decode_blocks=rng.randrange(900),
            new_request_blocks=rng.randrange(40),
            kv_total_blocks=1_000,
            max_num_batched_tokens=8_192,
        )
        for i in range(n)
    ]


def run() -> dict[str, float]:
    rng = random.Random(1)
    cands = _candidates(rng, 64)
    isl = 40 * 16
    plain = Selector(RoutingConfig.dynamo())
    with_thresholds = Selector(
        RoutingConfig.dynamo(thresholds=BusyThresholds(0.95, 100_000, 4.0))
    )
    results = {
        "select_64_kv_t0_us": _per_call_us(lambda: plain.select(cands, isl, rng), 5_000),
        "select_64_kv_t0_thresholds_us": _per_call_us(
            lambda: with_thresholds.select(cands, isl, rng), 5_000
        ),
        "select_64_plus_cost_table_us": _per_call_us(
            lambda: plain.select(cands, isl, rng).costs.as_tuple(), 2_000
        ),
    }

    # 64 workers, each with 20 active requests sharing system prompts of up to 512 blocks.
    load = ActiveLoad()
    prefixes = [[rng.getrandbits(64) for _ in range(512)] for _ in range(8)]
    workers = [(f"w{i:02d}", 0) for i in range(64)]
    for w_i, worker in enumerate(workers):
        for r in range(20):
            chain = prefixes[(w_i + r) % 8][: rng.randrange(1, 512)]
            load.add(f"{w_i}-{r}", "rep", worker, 100, chain, ts=0.0)
    query = prefixes[3]

    def all_workers() -> int:
        return sum(load.active_prefix_len(w, query) for w in workers)

    results["active_prefix_len_64x512_us"] = _per_call_us(all_workers, 500)
    return results


def main() -> int:
    results = run()
    if "--json" in sys.argv:
        print(json.dumps(results))
    else:
        for name, value in results.items():
            print(f"{name:36s} {value:9.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
