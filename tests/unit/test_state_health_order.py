"""The health map depends on the control stream alone: a worker retired (KV stream) and its
health changes (control stream) give the same state whatever order a replica applies the two
streams in — a live replica interleaves them as they arrive, a restarted one replays them."""

from __future__ import annotations

import itertools

from eventlog import events as ev
from eventlog.names import CONTROL, KV
from replicas.core.state import RouterState

KV_MSGS = [
    (KV, 1, [ev.WorkerRegistered("w1", "http://w1", "m", 16, 1024, 8192, 1.0)]),
    (KV, 2, [ev.WorkerRetired("w1", "heartbeat timeout", 2.0)]),
    (KV, 3, [ev.WorkerRegistered("w1", "http://w1", "m", 16, 1024, 8192, 3.0)]),
]
CONTROL_MSGS = [
    (CONTROL, 1, [ev.WorkerHealthChanged("w1", "suspicious", "passive", 1.5)]),
    (CONTROL, 2, [ev.WorkerHealthChanged("w1", "unhealthy", "canary", 1.6)]),
    (CONTROL, 3, [ev.WorkerHealthChanged("w1", "healthy", "half-open trial", 4.0)]),
]


def interleavings() -> list[list[tuple[str, int, list[ev.Event]]]]:
    """Every merge of the two streams that keeps each stream's own order."""
    n, m = len(KV_MSGS), len(CONTROL_MSGS)
    out = []
    for kv_slots in itertools.combinations(range(n + m), n):
        kv, ctl = iter(KV_MSGS), iter(CONTROL_MSGS)
        out.append([next(kv) if i in kv_slots else next(ctl) for i in range(n + m)])
    return out


def test_health_and_digests_do_not_depend_on_stream_interleaving() -> None:
    digests = set()
    healths = set()
    for order in interleavings():
        state = RouterState()
        for stream, seq, batch in order:
            state.apply(stream, seq, batch)
        digests.add(state.digests()["state"])
        healths.add(tuple(sorted(state.health.items())))
    assert len(healths) == 1 and len(digests) == 1, healths
    assert healths == {(("w1", "healthy"),)}
