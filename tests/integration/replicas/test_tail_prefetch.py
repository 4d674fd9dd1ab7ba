"""The follower reads the KV tail while the snapshot before it loads (real nats-server): adopted
when the restored state continues where it starts, dropped otherwise; every tail message applied
once, in order, a malformed one counted and skipped, with or without a prefetch."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
from nats.js import JetStreamContext

from eventlog import events as ev
from eventlog.jetstream_log import JetStreamLog
from eventlog.names import KV, Names
from replicas.core.state import RouterState, StateConfig
from replicas.runtime import follower as follower_module
from replicas.runtime.follower import StreamFollower
from snapshots.store import SnapshotStore
from tests.eventgen import interleave, worker_history
from tests.integration.snapshots.test_snapshot_store import corrupt_blob
from tests.waiting import until

NAMES = Names("jr")
MALFORMED_AT = 500  # the tail's message at this index is garbage


class Listener:
    def __init__(self) -> None:
        self.applied: list[int] = []

    def stream_applied(self, kind: str, messages: Sequence[tuple[int, Sequence[ev.Event]]]
                       ) -> None:
        if kind == KV:
            self.applied += [seq for seq, _ in messages]

    def stream_rewound(self) -> None:
        pass

    def stream_blocked(self, kind: str, reason: str) -> None:
        pass


async def history(js: tuple[object, JetStreamContext], snapshots_at: Sequence[int]
                  ) -> tuple[JetStreamLog, SnapshotStore, RouterState, list[str]]:
    """~900 KV messages; a snapshot after each index of ``snapshots_at`` (the last is newest).
    Returns the log, the store, the state after every message, and the snapshots' ids."""
    log = JetStreamLog(js[1])
    await log.ensure_streams(NAMES)
    store = SnapshotStore(js[1], NAMES, keep=5)
    rng = random.Random(11)
    batches = interleave(rng, [worker_history(rng, f"w{w}", 150) for w in range(4)])
    reference = RouterState()
    ids = []
    for i, batch in enumerate(batches):
        subject = NAMES.kv_subject(str(batch[0].worker_id))  # type: ignore[union-attr]
        if i == MALFORMED_AT:
            seq = await log.append_raw(subject, b"\xc1 not a batch", msg_id=f"m{i}")
            batch = []
        else:
            seq = await log.append(subject, batch, msg_id=f"m{i}")
        reference.apply(KV, seq, batch)
        if i in snapshots_at:
            meta = await store.put(reference.encode(), positions=dict(reference.positions),
                                   epoch=reference.epoch, created_by="test", trigger="test")
            ids.append(meta.snapshot_id)
    return log, store, reference, ids


async def catch_up(log: JetStreamLog, store: SnapshotStore, reference: RouterState
                   ) -> tuple[StreamFollower, Listener]:
    listener = Listener()
    follower = StreamFollower(NAMES, StateConfig(), listener, replica_id="r1")
    follower.connect(log, store)
    assert await follower.restore("test")
    start = follower.state.positions[KV]
    await follower.measure_catch_up()
    follower.start()
    try:
        await until(lambda: follower.state.positions[KV], lambda p: p >= reference.positions[KV],
                    timeout=60, what="tail applied")
    finally:
        await follower.stop()
    assert follower.state.digests() == reference.digests()
    assert listener.applied == list(range(start + 1, reference.positions[KV] + 1))
    return follower, listener


async def test_the_tail_read_while_the_snapshot_loads_is_applied_once_in_order(js):
    log, store, reference, _ = await history(js, snapshots_at=[300])
    follower, _ = await catch_up(log, store, reference)
    tail = reference.positions[KV] - 301
    assert follower.prefetched == tail  # all of it read ahead, then adopted
    assert follower.malformed_counts()[KV] == 1


async def test_a_prefetch_stops_at_its_limit_and_its_reader_goes_on(js, monkeypatch):
    monkeypatch.setattr(follower_module, "_PREFETCH_LIMIT", 40)
    log, store, reference, _ = await history(js, snapshots_at=[300])
    follower, _ = await catch_up(log, store, reference)
    assert follower.prefetched == 40
    assert follower.malformed_counts()[KV] == 1


@pytest.mark.parametrize("corrupt", [False, True])
async def test_a_prefetch_for_another_snapshot_than_the_one_restored_is_dropped(js, corrupt):
    """The newest snapshot does not verify: the one before it is restored, from an earlier
    position; the prefetch (after the newest) is dropped and the tail read from there."""
    log, store, reference, ids = await history(js, snapshots_at=[200, 600])
    if corrupt:
        await corrupt_blob(js[1], NAMES, ids[-1])
    follower, _ = await catch_up(log, store, reference)
    if corrupt:
        assert follower.prefetched == 0
        assert follower.malformed_counts()[KV] == 1  # the garbage lies after the older one
    else:
        assert follower.prefetched == reference.positions[KV] - 601
        assert follower.malformed_counts()[KV] == 0
