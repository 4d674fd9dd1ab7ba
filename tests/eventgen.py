"""Random but valid event histories, for property tests and the replay integration test.

Each worker's history is a list of batches (one batch = one stream message) in that worker's
event_id order; interleaving different workers' histories in any order must give the same state.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from eventlog import events as ev


def worker_history(rng: random.Random, worker_id: str, n_batches: int, *,
                   dp_size: int = 1, tokens_pool: int = 12, ts0: float = 1000.0
                   ) -> list[list[ev.Event]]:
    """A registration followed by stores (chains sharing tokens with other workers), removals
    (some unknown), clears, and the odd store with an unknown parent."""
    batches: list[list[ev.Event]] = [[ev.WorkerRegistered(
        worker_id, f"http://{worker_id}", "m", 16, 1000, 8192, ts0, dp_size)]]
    held: dict[int, list[int]] = {r: [] for r in range(dp_size)}  # engine block hashes per rank
    event_id = 0
    next_block = rng.getrandbits(40)
    for i in range(n_batches):
        ts = ts0 + i + 1
        rank = rng.randrange(dp_size)
        batch: list[ev.Event] = []
        for _ in range(rng.randint(1, 3)):
            event_id += 1
            roll = rng.random()
            if roll < 0.6 or not held[rank]:
                parent = rng.choice(held[rank]) if held[rank] and rng.random() < 0.6 else None
                if rng.random() < 0.03:
                    parent = rng.getrandbits(60)  # unknown parent: rejected and counted
                blocks = []
                for _ in range(rng.randint(1, 5)):
                    next_block += 1
                    blocks.append((next_block, rng.randrange(tokens_pool)))
                held[rank].extend(b for b, _ in blocks)
                batch.append(ev.BlocksStored(worker_id, event_id, rank, parent, blocks, ts))
            elif roll < 0.92:
                k = min(len(held[rank]), rng.randint(1, 3))
                gone = rng.sample(held[rank], k)
                for b in gone:
                    held[rank].remove(b)
                if rng.random() < 0.1:
                    gone.append(rng.getrandbits(60))  # unknown block: counted, rest applies
                batch.append(ev.BlocksRemoved(worker_id, event_id, rank, gone, ts))
            else:
                held[rank].clear()
                batch.append(ev.AllBlocksCleared(worker_id, event_id, rank, ts))
        batches.append(batch)
    return batches


def router_history(rng: random.Random, replica_id: str, workers: Sequence[str], n: int, *,
                   ts0: float = 1000.0) -> list[list[ev.Event]]:
    """Requests routed (some with output blocks tracked or a modeled prefill), prefilled, making
    output progress and finished (some never finish), plus the odd ReplicaLost."""
    out: list[list[ev.Event]] = []
    open_: list[str] = []
    generated: dict[str, int] = {}
    for i in range(n):
        ts = ts0 + i * 0.5
        roll = rng.random()
        if roll < 0.5 or not open_:
            rid = f"{replica_id}-{i}"
            hashes = [rng.randrange(50) for _ in range(rng.randint(0, 6))]
            out.append([ev.RequestRouted(rid, replica_id, rng.choice(list(workers)), 0,
                                         rng.randint(1, 200), hashes, rng.randint(0, 3), 64, 1,
                                         ts, block_size=16,
                                         track_output_blocks=rng.random() < 0.5,
                                         osl_hint=rng.choice((0, 40)),
                                         prefill_load_model=rng.choice(("none", "linear")))])
            open_.append(rid)
        elif roll < 0.7:
            out.append([ev.PrefillCompleted(rng.choice(open_), ts)])
        elif roll < 0.8:
            rid = rng.choice(open_)
            generated[rid] = generated.get(rid, 0) + rng.randint(1, 40)
            out.append([ev.OutputProgress(rid, generated[rid], ts)])
        elif roll < 0.98:
            rid = open_.pop(rng.randrange(len(open_)))
            out.append([ev.RequestFinished(rid, "ok", rng.randint(1, 50), ts)])
        else:
            out.append([ev.ReplicaLost(replica_id, ts)])
            open_.clear()
    return out


def interleave(rng: random.Random, histories: Sequence[Sequence[list[ev.Event]]]
               ) -> list[list[ev.Event]]:
    """A random merge that keeps each history's own order."""
    cursors = [0] * len(histories)
    merged: list[list[ev.Event]] = []
    live = [i for i, h in enumerate(histories) if h]
    while live:
        i = rng.choice(live)
        merged.append(list(histories[i][cursors[i]]))
        cursors[i] += 1
        if cursors[i] == len(histories[i]):
            live.remove(i)
    return merged
