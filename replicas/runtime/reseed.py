"""Re-seeding an event log that NATS lost: it came back, but with its storage gone.

Every NATS node restarted with empty volumes holds no stream, no bucket and no snapshot: the
snapshot store lives in NATS too (an object-store bucket), so no snapshot survives to restore
from. What survives is the replicas' memory: each holds the complete state it had applied when
NATS went away. So the best honest thing is to make that state the new beginning:

* **Detection** (:func:`log_lost`): connected, yet a stream this replica followed does not exist,
  or ends before the position this replica applied (someone created it again). Either way the
  sequence numbers the state holds no longer name anything on the server.
* **The seeder** is the replica that creates the KV stream again (JetStream lets one creator
  win). It creates each stream numbering on from its own positions (`first_seq` =
  position + 1, `eventlog.streams.recreate_stream`), so its state is exactly "the log up to
  there", writes that state as a snapshot (``trigger="log-lost"``) into the re-created
  snapshot bucket, and asks every engine to re-announce its cache (`AllBlocksCleared` + the
  whole cache): KV events that engines dropped while NATS was away are made good, and routing
  quality is back once those land.
* **Every other replica** waits for the three streams to exist. Its state at equal positions is
  the seeder's (both applied the same log up to the outage): it simply follows on. At other
  positions (it had applied more or less of the old log than the seeder) it loads the seed
  snapshot, whose positions are exactly the new streams' starts, and follows from there — so
  every replica converges to the seeder's state and equal digests.

What cannot come back: decisions and events appended to the old streams after the seeder's
positions (unless this replica is the seeder), admin changes in them, older snapshots, and the
projector's ledger rows beyond its own database. Requests that were in flight keep their local
accounting (the overlay) and their finishes are appended to the new streams, where a finish for
an unknown request is a no-op.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from errors.root import JetrouterError
from eventlog.names import KV, STREAM_KINDS, Names
from eventlog.streams import lookup_stream, recreate_stream
from replicas.core.state import RouterState, StateConfig
from snapshots.store import SnapshotStore

log = logging.getLogger("jetrouter.replica")


class SeedNotFound(JetrouterError, TimeoutError):
    """The seeder's snapshot did not appear in time (the seeder may have died mid-way)."""


@dataclass(frozen=True, slots=True)
class Reseeded:
    """What one replica did: ``seeded`` (it created the streams and wrote the snapshot),
    ``starts`` (each new stream's first sequence), ``loaded`` (it replaced its state with the
    seed snapshot's), ``snapshot_id`` (the seed snapshot it wrote or loaded)."""

    seeded: bool
    starts: dict[str, int]
    loaded: RouterState | None = None
    snapshot_id: str | None = None


async def log_lost(js: JetStreamContext, names: Names, positions: dict[str, int]) -> bool:
    """True when every stream is missing (storage lost: never just one of them), or a stream
    ends before what this replica applied from it (a seeder created it again)."""
    missing = 0
    for kind in STREAM_KINDS:
        try:
            info = await lookup_stream(js, names.stream(kind))
        except NotFoundError:
            missing += 1
            continue
        if info.state.last_seq < positions[kind]:
            return True
    return missing == len(STREAM_KINDS)


async def reseed(js: JetStreamContext, nc: NatsClient, names: Names, store: SnapshotStore,
                 state: RouterState, config: StateConfig, replica_id: str, *,
                 max_bytes: int | None = None, wait: float = 30.0) -> Reseeded:
    """Re-create the lost log from ``state`` (as the seeder) or join the seeder's."""
    positions = dict(state.positions)
    store.reopen()
    _, seeder = await recreate_stream(js, names, KV, positions[KV] + 1, max_bytes=max_bytes)
    if seeder:
        starts = {KV: positions[KV] + 1}
        for kind in STREAM_KINDS:
            if kind != KV:
                info, _ = await recreate_stream(js, names, kind, positions[kind] + 1,
                                                max_bytes=max_bytes)
                starts[kind] = info.state.first_seq
        meta = await store.put(state.encoder(), positions=positions, epoch=state.epoch,
                               created_by=replica_id, trigger="log-lost",
                               format=state.snapshot_format)
        await nc.publish(names.reannounce_subject("all"), b"")
        log.warning("replica %s: NATS came back without its streams; re-created them from "
                    "this replica's state at %s, wrote snapshot %s from it and asked every "
                    "engine to re-announce its cache", replica_id, positions, meta.snapshot_id)
        return Reseeded(True, starts, snapshot_id=meta.snapshot_id)
    starts = await _starts_when_created(js, names, wait)
    if all(starts[k] == positions[k] + 1 for k in STREAM_KINDS):
        log.warning("replica %s: NATS came back without its streams; another replica "
                    "re-created them from the same positions %s: following on", replica_id,
                    positions)
        return Reseeded(False, starts)
    want = {k: starts[k] - 1 for k in STREAM_KINDS}
    snapshot_id, loaded = await _seed_snapshot(store, want, config, wait)
    log.warning("replica %s: NATS came back without its streams; another replica re-created "
                "them at %s (this one had applied %s): loaded its snapshot %s", replica_id,
                want, positions, snapshot_id)
    return Reseeded(False, starts, loaded=loaded, snapshot_id=snapshot_id)


async def _starts_when_created(js: JetStreamContext, names: Names, wait: float
                               ) -> dict[str, int]:
    """Each stream's first sequence, once the seeder has created all three."""
    deadline = time.monotonic() + wait
    starts: dict[str, int] = {}
    while True:
        for kind in STREAM_KINDS:
            if kind in starts:
                continue
            try:
                starts[kind] = (await lookup_stream(js, names.stream(kind))).state.first_seq
            except NotFoundError:
                break
        if len(starts) == len(STREAM_KINDS):
            return starts
        if time.monotonic() > deadline:
            raise SeedNotFound(f"streams not re-created within {wait}s: have {sorted(starts)}")
        await asyncio.sleep(0.2)  # polling the server for the seeder's streams, with a deadline


async def _seed_snapshot(store: SnapshotStore, want: dict[str, int], config: StateConfig,
                         wait: float) -> tuple[str, RouterState]:
    """The seeder's snapshot: the newest valid one at exactly ``want``'s positions."""
    deadline = time.monotonic() + wait
    while True:
        found = await store.load_newest_valid()
        if found is not None:
            meta, blob = found[0], found[1]
            if {k: int(meta.positions.get(k, 0)) for k in STREAM_KINDS} == want:
                state = await asyncio.to_thread(RouterState.decode, blob, config)
                return meta.snapshot_id, state
        if time.monotonic() > deadline:
            raise SeedNotFound(f"no snapshot at {want} within {wait}s")
        await asyncio.sleep(0.2)  # polling for the seeder's snapshot, with a deadline
