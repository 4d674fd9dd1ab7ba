"""How long taking a snapshot holds the event loop, against a real nats-server.

Not a test (prints figures, asserts nothing about speed). Run:

    .venv/bin/python -m benchmarks.bench_snapshot_capture [--blocks 2000000] [--workers 64]

Builds a ``RouterState`` (``--index-form``, compact by default) in-process (``bench
durability``'s workload: chains of 32 blocks, half starting with one of 50 shared 8-block
prompts), then has a real ``Leader`` (its lease taken on the server, the KV hold of a real
``StreamFollower`` around the state) take ``--repeats`` snapshots into the object store.
Meanwhile a probe sleeps 1 ms at a time on the same loop and records how late each wake-up is:
the largest lateness is the longest the loop was held (on a shared machine, scheduling noise
too: hence also the count of stalls over 20 ms). With ``--decisions`` a second task routes
meanwhile (``match_columns`` on a prompt the index holds, one per pass through the loop), as a
serving replica would. Per snapshot: end to end (capture, encode, put, record, purge), the
loop's largest stall, how long the KV stream was held and in how many slices
(``Leader.last_capture``; absent before the capture was sliced), decisions made meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import os
import time
from collections.abc import Sequence
from typing import Any

import nats
from nats.js import JetStreamContext

from bench.durability import Workload
from eventlog import events as ev
from eventlog.hashing import CHAIN_MULTIPLIER, MASK64
from eventlog.names import KV, Names
from eventlog.streams import ensure_streams
from natsops.server import NatsServer
from replicas.core.state import RouterState, StateConfig
from replicas.runtime.follower import StreamFollower
from replicas.runtime.leader import Leader
from snapshots.store import SnapshotStore

NAMES = Names("capbench")
_RUN = 2048  # KV messages applied at once while building (as a replica catching up)


def build_state(blocks: int, workers: int, chain_blocks: int, seed: int, index_form: str
                ) -> tuple[RouterState, list[int]]:
    """A state holding ``blocks`` pairs, and one stored chain's sequence hashes (a prompt that
    matches)."""
    state = RouterState(StateConfig(index_form=index_form))
    wl = Workload(workers, seed)
    ts = time.time()
    state.apply(KV, 1, wl.registrations(ts))
    seq, total, turn = 1, 0, 0
    run: list[tuple[int, Sequence[ev.Event]]] = []
    first: ev.BlocksStored | None = None
    while total < blocks:
        worker = wl.workers[turn % workers]
        turn += 1
        batch: list[ev.Event] = []
        for _ in range(4):
            n = min(chain_blocks, blocks - total)
            if n <= 0:
                break
            stored = wl.chain(worker, n, ts)
            first = first or stored
            batch.append(stored)
            total += n
        wl.held[worker].clear()  # only the tail bench evicts from these
        seq += 1
        run.append((seq, batch))
        if len(run) == _RUN:
            state.apply_many(KV, run)
            run = []
    if run:
        state.apply_many(KV, run)
    assert first is not None
    prompt, parent = [], 0
    for _, tokens_hash in first.blocks:
        parent = (parent * CHAIN_MULTIPLIER + tokens_hash) & MASK64
        prompt.append(parent)
    return state, prompt


class Port:
    """The little of ``ReplicaPort`` that taking a snapshot uses."""

    def __init__(self, state: RouterState, js: JetStreamContext) -> None:
        self.replica_id = "capbench-r0"
        self.names = NAMES
        self.state = state
        self.ready = True
        self.js = js

    async def append(self, subject: str, event: ev.Event | list[ev.Event],
                     msg_id: str | None) -> int:
        events = event if isinstance(event, list) else [event]
        ack = await self.js.publish(subject, ev.encode_batch(events),
                                    headers={"Nats-Msg-Id": msg_id} if msg_id else None)
        return ack.seq


async def probe(stop: asyncio.Event, late: list[float]) -> None:
    """How late each 1 ms sleep wakes up, into ``late``."""
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        t = loop.time()
        await asyncio.sleep(0.001)
        late.append(loop.time() - t - 0.001)


async def decide(stop: asyncio.Event, state: RouterState, prompt: list[int],
                 made: list[int]) -> None:
    while not stop.is_set():
        state.index.match_columns(prompt)
        made[0] += 1
        await asyncio.sleep(0)


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    start = time.perf_counter()
    state, prompt = build_state(args.blocks, args.workers, args.chain_blocks, args.seed,
                                args.index_form)
    built = {"pairs": state.index.total_blocks, "nodes": state.index.node_count,
             "build_s": round(time.perf_counter() - start, 1)}
    server = NatsServer().start()
    nc = await nats.connect(server.url)
    runs: list[dict[str, Any]] = []
    try:
        js = nc.jetstream()
        await ensure_streams(js, NAMES)
        port = Port(state, js)
        store = SnapshotStore(js, NAMES, keep=2)
        extra: dict[str, Any] = {}
        if "hold_kv" in inspect.signature(Leader).parameters:  # the sliced capture
            follower = StreamFollower(NAMES, state.config, port)  # type: ignore[arg-type]
            follower.state = state
            extra["hold_kv"] = follower.hold_kv
        leader = Leader(port, nc, js, store, snapshot_threshold=10**12,  # type: ignore[arg-type]
                        **extra)
        lease = asyncio.create_task(leader.lease.run())  # renewed on the loop, as a leader's
        while not leader.is_leader:
            await asyncio.sleep(0.01)
        for _ in range(args.repeats):
            stop, late, made = asyncio.Event(), [], [0]
            tasks = [asyncio.create_task(probe(stop, late))]
            if args.decisions:
                tasks.append(asyncio.create_task(decide(stop, state, prompt, made)))
            await asyncio.sleep(0.05)
            late.clear()
            t0 = time.perf_counter()
            answer = await leader.take_snapshot("bench")
            total = time.perf_counter() - t0
            stop.set()
            await asyncio.gather(*tasks)
            capture = getattr(leader, "last_capture", {})
            runs.append({"total_s": round(total, 3), "loop_stall_max_ms": round(max(late) * 1e3, 1),
                         "stalls_over_20ms": sum(x > 0.02 for x in late),
                         "kv_held_s": round(capture["held_s"], 3) if capture else None,
                         "slices": capture.get("slices"), "decisions": made[0],
                         "size": answer["size"]})
            if not leader.is_leader:
                raise SystemExit("the lease was lost during the snapshot")
        await leader.lease.release()
        await lease
    finally:
        await nc.close()
        server.cleanup()
    return {"params": vars(args), "state": built, "runs": runs,
            "load_avg_1m": round(os.getloadavg()[0], 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=2_000_000, help="(block, worker) pairs held")
    p.add_argument("--workers", type=int, default=64)
    p.add_argument("--chain-blocks", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--index-form", choices=("compact", "reference"), default="compact")
    p.add_argument("--decisions", action="store_true",
                   help="route (match_columns) on the same loop while the snapshots are taken")
    p.add_argument("--json", action="store_true", help="print only the JSON object")
    args = p.parse_args()
    result = asyncio.run(measure(args))
    if args.json:
        print(json.dumps(result))
        return
    print(f"state: {result['state']}  (load {result['load_avg_1m']})")
    for run in result["runs"]:
        print("  " + "  ".join(f"{k} {v}" for k, v in run.items()))


if __name__ == "__main__":
    main()
