"""`jetrouter bench core`'s apply and replay figures in runs, as a replica catching up applies.

A replica catching up (after a restart, or behind after a stall) takes what a pull brought and
applies the KV messages' stores and removals as runs (``RouterState.apply_many`` ->
``PrefixIndex.apply_run``, replicas/core/index_run.py); live, each message applies on its own.
These figures are the run path's, beside ``bench core``'s one-event-at-a-time ones:

* ``index_apply_runs_blocks_per_s`` - the same ``BlocksStored`` batches as
  ``index_apply_blocks_per_s``, applied to a fresh index in runs of ``RUN_EVENTS`` events, per
  second of CPU; ``index_apply_runs_digest_equal`` - its digest equals the index built one event
  at a time.
* ``replay_runs_block_events_per_s`` - the replay figure's stream read again, each pull's messages
  taken at once (``take_received``) and applied as one run, wall clock as the replay figure.
"""

from __future__ import annotations

import gc
import time
from typing import Any

from eventlog.events import BlocksStored
from eventlog.reader import StreamReader
from replicas.core import index_reference
from replicas.core.index import PrefixIndex, WorkerKey
from replicas.core.index_run import STORE, KvOp
from replicas.core.state_run import kv_decoder

RUN_EVENTS = 2048  # what the follower applies at once while catching up (its KV slice)
AnyIndex = PrefixIndex | index_reference.PrefixIndex


def bench_apply_runs(batches: list[tuple[WorkerKey, int | None, list[tuple[int, int]]]],
                     index: AnyIndex, one_by_one: AnyIndex) -> dict[str, Any]:
    ops: list[KvOp] = [(STORE, worker, parent, blocks) for worker, parent, blocks in batches]
    blocks = sum(len(b) for _, _, b in batches)
    gc.collect()
    t0 = time.process_time()
    for start in range(0, len(ops), RUN_EVENTS):
        index.apply_run(ops[start:start + RUN_EVENTS])
    elapsed = time.process_time() - t0
    return {"index_apply_runs_blocks_per_s": round(blocks / elapsed),
            "index_apply_runs_digest_equal": index.digest == one_by_one.digest}


async def replay_runs(js: Any, stream: str, last: int, index: AnyIndex) -> dict[str, Any]:
    applied = 0
    gc.collect()
    t0 = time.perf_counter()
    # as the replica's KV follower reads (replicas/runtime/follower.py): no decode timing, and
    # blocks left packed where the index's kernel takes them so
    reader = StreamReader(js, stream, start_seq=1, time_decode=False, decode=kv_decoder(index))
    try:
        async for first in reader:
            taken = [first, *reader.take_received(RUN_EVENTS - 1)]
            ops: list[KvOp] = []
            for _, events in taken:
                for e in events:
                    if isinstance(e, BlocksStored):
                        ops.append((STORE, (e.worker_id, e.dp_rank), e.parent_hash, e.blocks))
                        applied += len(e.blocks)
            index.apply_run(ops)
            if taken[-1][0] >= last:
                break
    finally:
        elapsed = time.perf_counter() - t0
        await reader.close()
    return {"replay_runs_block_events_per_s": round(applied / elapsed),
            "replay_runs_seconds": round(elapsed, 3)}
