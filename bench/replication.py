"""Replication cost for `jetrouter bench core`: what one replica spends applying another
replica's routed requests.

Every replica applies every other replica's router stream, so its own cost grows with the whole
cluster's request rate. This module times exactly that work, in-process and with no network:
decoding router-stream messages (msgpack bytes, as a reader hands them over) and applying them to a
``RouterState`` — ``RequestRouted``, ``PrefillCompleted`` and ``RequestFinished`` of requests
routed by a peer, with ``--replication-inflight`` of them active at any time (their blocks
refcounted on ``--replication-workers`` workers, as under load).

Timed in this process's CPU seconds. Two wire shapes are timed on the same requests:

* ``grouped`` — what a replica writes now (`eventlog.group_commit`): the events of
  ``--replication-group`` consecutive requests per message, and a short request's prefill
  completion folded into its ``RequestFinished`` (``prefill_ts``), so two events per request;
* ``single`` — one event per message, three events per request (the older wire shape, which
  every replica still decodes and applies).

``replication_load_holders_us_per_request`` is the grouped shape again on a state whose load
keeps its blocks' holder bitmasks (``ActiveLoad.prefix_groups``: what a replica keeps from its
first decision over 16 or more loaded rows on), timed alternately with the plain one (each the
better of two runs): what that costs every replica per applied request.
"""

from __future__ import annotations

import argparse
import gc
import random
import time
from collections.abc import Callable
from typing import Any

from eventlog import events as ev
from eventlog.hashing import prompt_hashes
from eventlog.names import ROUTER
from replicas.core.state import RouterState

PEER = "replica-peer"
VOCAB = 50_000


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replication-requests", type=int, default=20_000,
                   help="peer requests to apply for the replication figure (0 = skip)")
    p.add_argument("--replication-prompt-tokens", type=int, default=1024,
                   help="prompt tokens of each replicated request")
    p.add_argument("--replication-workers", type=int, default=16,
                   help="workers (candidate rows per RequestRouted)")
    p.add_argument("--replication-inflight", type=int, default=64,
                   help="peer requests active at once while applying")
    p.add_argument("--replication-group", type=int, default=16,
                   help="requests whose events share one message in the grouped shape")


def _routed_events(args: argparse.Namespace, block_size: int) -> list[ev.RequestRouted]:
    rng = random.Random(args.seed + 7)
    workers = [f"worker-{i:03d}" for i in range(args.replication_workers)]
    # Conversations share a few system prompts, so blocks are refcounted across requests.
    shared = [[rng.randrange(VOCAB) for _ in range(args.replication_prompt_tokens // 2)]
              for _ in range(8)]
    tail_len = args.replication_prompt_tokens - len(shared[0])
    out: list[ev.RequestRouted] = []
    for i in range(args.replication_requests):
        tokens = shared[i % len(shared)] + [rng.randrange(VOCAB) for _ in range(tail_len)]
        hashes = prompt_hashes(tokens, block_size)
        chosen = rng.randrange(len(workers))
        rows = [(w, 0, len(hashes) // 2 if j == chosen else 0, float(len(hashes)),
                 float(rng.randrange(4000)), float(rng.randrange(10_000)), False)
                for j, w in enumerate(workers)]
        out.append(ev.RequestRouted(
            request_id=f"req-{i:08d}", replica_id=PEER, worker_id=workers[chosen], dp_rank=0,
            isl_tokens=len(tokens), block_seq_hashes=hashes, overlap_blocks=len(hashes) // 2,
            expected_osl=64, priority=0, ts=1.7e9 + i * 1e-3, candidates=rows,
            model="bench-model", block_size=block_size))
    return out


def _lifecycle(routed: list[ev.RequestRouted], inflight: int, merged: bool) -> list[ev.Event]:
    """Events in stream order: request i finishes once request i + inflight is routed."""
    events: list[ev.Event] = []
    n = len(routed)
    for i in range(n + inflight):
        if i < n:
            events.append(routed[i])
        j = i - inflight
        if 0 <= j < n:
            done = routed[j].ts + inflight * 1e-3
            if merged:
                events.append(ev.RequestFinished(routed[j].request_id, "ok", 64, done,
                                                 prefill_ts=done - 1e-4))
            else:
                events.append(ev.PrefillCompleted(routed[j].request_id, done - 1e-4))
                events.append(ev.RequestFinished(routed[j].request_id, "ok", 64, done))
    return events


def _messages(events: list[ev.Event], per_message: int) -> list[bytes]:
    return [ev.encode_batch(events[i:i + per_message]) for i in range(0, len(events), per_message)]


def _time_apply(payloads: list[bytes], new_state: Callable[[], RouterState],
                keep_holders: bool = False) -> tuple[float, int]:
    state = new_state()
    if keep_holders:
        state.load.prefix_groups(())
    gc.collect()
    t0 = time.process_time()  # CPU time: other processes on a busy machine do not count
    applied = 0
    for seq, payload in enumerate(payloads, start=1):
        batch = ev.decode_batch(payload)
        state.apply(ROUTER, seq, batch)
        applied += len(batch)
    elapsed = time.process_time() - t0
    if len(state.load):  # every request finished: the state must be back to empty
        raise AssertionError(f"{len(state.load)} requests still active after replication bench")
    return elapsed, applied


def bench_replication(args: argparse.Namespace, new_state: Callable[[], RouterState]
                      ) -> dict[str, Any]:
    if args.replication_requests <= 0:
        return {"replication_us_per_request": None}
    routed = _routed_events(args, args.block_size)
    n = len(routed)
    # grouped: a message carries the events of `group` requests (2 events each)
    grouped = _messages(_lifecycle(routed, args.replication_inflight, merged=True),
                        2 * max(args.replication_group, 1))
    single = _messages(_lifecycle(routed, args.replication_inflight, merged=False), 1)
    runs = [(_time_apply(grouped, new_state), _time_apply(grouped, new_state, True))
            for _ in range(2)]
    g_s, g_events = min(plain for plain, _ in runs)
    h_s = min(held for _, held in runs)[0]
    s_s, s_events = _time_apply(single, new_state)
    return {
        "replication_us_per_request": round(g_s / n * 1e6, 2),
        "replication_load_holders_us_per_request": round(h_s / n * 1e6, 2),
        "replication_router_events_per_s": round(g_events / g_s),
        "replication_events_per_request": round(g_events / n, 2),
        "replication_messages_per_request": round(len(grouped) / n, 3),
        "replication_single_event_us_per_request": round(s_s / n * 1e6, 2),
        "replication_single_event_router_events_per_s": round(s_events / s_s),
        "replication_message_bytes_per_request": round(sum(map(len, grouped)) / n),
    }
