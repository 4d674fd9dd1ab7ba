"""Applying a catch-up tail in-process: what a replica does after restoring a snapshot.

``python -m bench.core_tail`` builds a compact prefix index (``--workers`` workers, ``--blocks``
pairs in 32-block chains, half of them under one of 50 shared 8-block prompts), then times a tail
of ``--events`` KV events of ``--event-blocks`` blocks each — half ``BlocksStored`` extending a
chain (the parent is the chain's last block), half ``BlocksRemoved`` evicting a chain's oldest
blocks — applied to copies of that index (restored from its snapshot) three ways:

* ``one_by_one`` - ``store`` / ``remove`` per event (a live replica applies events so);
* ``runs`` - ``apply_run`` over runs of ``RUN_EVENTS`` events (a replica catching up);
* ``state_runs`` - ``RouterState.apply_many`` over messages of one event each, in slices of
  ``RUN_EVENTS`` (the follower's catch-up path, per-event checks included).

Each figure is CPU time (``process_time``) per event and blocks per second; the digests of the
three copies must be equal. ``--kernel`` picks the index's code: ``compiled`` (its C kernel,
``replicas/core/_fastindex.c``, when built), ``python`` (the reference code), or ``both``, one
after the other in one process on the same tail (figures under ``python`` and ``compiled``).
Nothing is asserted: figures are printed, one JSON object.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import time
from typing import Any

from eventlog import events as ev
from eventlog.names import KV
from replicas.core import index_kernel
from replicas.core.index import PrefixIndex
from replicas.core.index_run import REMOVE, STORE, KvOp
from replicas.core.state import RouterState, StateConfig

RUN_EVENTS = 2048
CHAIN_BLOCKS = 32
SHARED_PROMPTS, SHARED_BLOCKS = 50, 8


def build(workers: int, blocks: int, seed: int) -> tuple[list[KvOp], dict[str, list[int]]]:
    """The stores that fill the index, and each worker's chains' block ids (oldest first)."""
    rng = random.Random(seed)
    shared = [[(rng.getrandbits(63), rng.getrandbits(64)) for _ in range(SHARED_BLOCKS)]
              for _ in range(SHARED_PROMPTS)]
    names = [f"worker-{i:03d}" for i in range(workers)]
    ops: list[KvOp] = []
    held: dict[str, list[int]] = {n: [] for n in names}
    stored = 0
    i = 0
    while stored < blocks:
        name = names[i % workers]
        i += 1
        parent = None
        if i % 2:
            prefix = shared[rng.randrange(SHARED_PROMPTS)]
            ops.append((STORE, (name, 0), None, prefix))
            parent = prefix[-1][0]
        own = [(rng.getrandbits(63), rng.getrandbits(64)) for _ in range(CHAIN_BLOCKS)]
        ops.append((STORE, (name, 0), parent, own))
        held[name].extend(b for b, _ in own)
        stored += CHAIN_BLOCKS
    return ops, held


def tail(held: dict[str, list[int]], events: int, event_blocks: int, seed: int
         ) -> list[ev.Event]:
    """Half stores extending a worker's newest chain, half removals of its oldest blocks."""
    rng = random.Random(seed + 1)
    names = sorted(held)
    tips = {n: held[n][-1] for n in names}
    oldest = {n: 0 for n in names}
    event_ids = {n: 0 for n in names}
    out: list[ev.Event] = []
    for k in range(events):
        name = names[rng.randrange(len(names))]
        event_ids[name] += 1
        if k % 2 == 0:
            blocks = [(rng.getrandbits(63), rng.getrandbits(64)) for _ in range(event_blocks)]
            out.append(ev.BlocksStored(worker_id=name, event_id=event_ids[name], dp_rank=0,
                                       parent_hash=tips[name], blocks=blocks, ts=1.0))
            tips[name] = blocks[-1][0]
            held[name].extend(b for b, _ in blocks)
        else:
            start = oldest[name]
            gone = held[name][start:start + event_blocks]
            oldest[name] = start + len(gone)
            out.append(ev.BlocksRemoved(worker_id=name, event_id=event_ids[name], dp_rank=0,
                                        block_hashes=gone, ts=1.0))
    return out


def as_ops(events: list[ev.Event]) -> list[KvOp]:
    return [(STORE, (e.worker_id, e.dp_rank), e.parent_hash, e.blocks)
            if isinstance(e, ev.BlocksStored)
            else (REMOVE, (e.worker_id, e.dp_rank), e.block_hashes, None) for e in events]


def timed(fn: Any) -> float:
    gc.collect()
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


def run(args: argparse.Namespace) -> dict[str, Any]:
    fill, held = build(args.workers, args.blocks, args.seed)
    base = PrefixIndex()
    base.apply_run(fill)
    plain = base.to_plain()
    events = tail(held, args.events, args.event_blocks, args.seed)
    figures: dict[str, Any] = {"workers": args.workers, "pairs": base.total_blocks,
                               "events": len(events), "event_blocks": args.event_blocks,
                               "kernel_built": index_kernel.available(),
                               "loadavg_1m_start": os.getloadavg()[0]}
    kernels = ["python", "compiled"] if args.kernel == "both" else [args.kernel]
    was = index_kernel.active() is not None
    try:
        for kernel in kernels:
            index_kernel.use_compiled(kernel == "compiled")
            figures[kernel] = time_tail(plain, events)
    finally:
        index_kernel.use_compiled(was)
    figures["loadavg_1m_end"] = os.getloadavg()[0]
    return figures


def time_tail(plain: dict[str, object], events: list[ev.Event]) -> dict[str, Any]:
    ops = as_ops(events)
    blocks = sum(len(e.blocks) if isinstance(e, ev.BlocksStored) else len(e.block_hashes)
                 for e in events)
    figures: dict[str, Any] = {"tail_blocks": blocks}
    one = PrefixIndex.from_plain(plain)

    def one_by_one() -> None:
        store, remove = one.store, one.remove
        for kind, worker, a, b in ops:
            if kind == STORE:
                store(worker, a, b)
            else:
                remove(worker, a)

    runs = PrefixIndex.from_plain(plain)

    def in_runs() -> None:
        for start in range(0, len(ops), RUN_EVENTS):
            runs.apply_run(ops[start:start + RUN_EVENTS])

    state = RouterState(StateConfig(index_form="compact"))
    state.index = PrefixIndex.from_plain(plain)
    messages = [(1 + i, [e]) for i, e in enumerate(events)]

    def state_runs() -> None:
        for start in range(0, len(messages), RUN_EVENTS):
            state.apply_many(KV, messages[start:start + RUN_EVENTS])

    for name, fn in (("one_by_one", one_by_one), ("runs", in_runs), ("state_runs", state_runs)):
        seconds = timed(fn)
        figures[f"{name}_us_per_event"] = round(seconds / len(events) * 1e6, 2)
        figures[f"{name}_blocks_per_s"] = round(blocks / seconds)
    figures["digests_equal"] = one.digest == runs.digest == state.index.digest
    figures["digest"] = one.digest
    return figures


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.core_tail", description=__doc__)
    p.add_argument("--workers", type=int, default=256)
    p.add_argument("--blocks", type=int, default=1_000_000)
    p.add_argument("--events", type=int, default=100_000)
    p.add_argument("--event-blocks", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kernel", choices=["compiled", "python", "both"], default="both")
    print(json.dumps(run(p.parse_args())))


if __name__ == "__main__":
    main()
