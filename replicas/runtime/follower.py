"""The stream follower: replay each stream from the state's position + 1, then follow it live.

It owns the replica's `RouterState`: every event reaches the state through here, in stream order.
Catching up (after a restart, a tail of 100 k messages), the KV and control streams apply what each
pull brought in slices, one pass through the event loop a slice; the KV stream's stores and
removals as runs (`RouterState.apply_many`, replicas/core/state_run.py). The KV tail after a
snapshot is read while the snapshot loads (tail_prefetch.py) and applied first.
A purge under a follower (its start is gone) reloads the newest snapshot; a `StateReset` moved
the other streams' positions to its cut, so the followers restart from there (a rewind); any other
failure restarts them from the positions the state has applied — nothing is lost or applied twice.
A message in a format newer than this release reads (eventlog/wire.py) *blocks* its stream: that
stream's follower stops before it for good, the others go on, and the replica is told, so it
turns not ready instead of diverging from the replicas that can apply the message.
While the leader copies the index for a snapshot (leader.py), the KV stream is *held*
(`hold_kv`): its messages wait, in order, in the reader or in the slice taken from it, and
are applied once the hold is released; the router and control streams go on meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from errors.root import JetrouterError
from eventlog import events as ev
from eventlog.log import EventLog, LogReader
from eventlog.names import CONTROL, KV, ROUTER, STREAM_KINDS, Names
from eventlog.reader import StartPurged
from eventlog.wire import NewerFormat
from replicas.core.state import RouterState, StateConfig
from replicas.core.state_run import kv_decoder
from replicas.runtime.replication_cost import ReplicationCost
from replicas.runtime.tail_prefetch import TailPrefetch, adopt
from snapshots.store import SnapshotStore

log = logging.getLogger("jetrouter.replica")

# Messages of the control stream applied between two passes through the event loop while catching
# up (~10-50 ms of work: heartbeats, the lease and /ready go on meanwhile). The KV stream's slice is
# applied as runs (RouterState.apply_many): ~5-10 us a message, so a whole catch-up pull at once.
_APPLY_SLICE = 512
_KV_SLICE = 2048
# At most this many KV messages are read ahead while a snapshot loads (~0.5 KB each in memory
# at 4 blocks a message); the reader goes on from there once the state is restored.
_PREFETCH_LIMIT = 200_000


# Messages the follower applied, in order: (stream sequence, its events).
AppliedMessages = Sequence[tuple[int, Sequence[ev.Event]]]


class StreamListener(Protocol):
    """What the replica does after the follower applied a batch to the state."""

    def stream_applied(self, kind: str, messages: AppliedMessages) -> None:
        """``messages`` of ``kind`` were applied, in order (several at once while catching up:
        what does not depend on each message is done once, after the last)."""
        ...

    def stream_rewound(self) -> None:
        """A reset moved the positions: whatever was pending on the old streams is void."""
        ...

    def stream_blocked(self, kind: str, reason: str) -> None:
        """``kind`` holds a message this release cannot read: nothing more is applied from it."""
        ...


class _Rewind(JetrouterError):
    """Raised inside a follower when a StateReset moved positions: restart the followers."""


class StreamFollower:
    def __init__(self, names: Names, config: StateConfig, listener: StreamListener, *,
                 replica_id: str = "") -> None:
        self.names = names
        self.config = config
        self.state = RouterState(config)
        self.log: EventLog | None = None
        self.snapshots: SnapshotStore | None = None
        self.replica_id = replica_id
        self.restores = 0
        self.stream_last: dict[str, int] = {k: 0 for k in STREAM_KINDS}
        self.malformed: dict[str, int] = {k: 0 for k in STREAM_KINDS}  # by finished readers
        self.catch_up_targets: dict[str, int] = {}
        # Streams stopped at a message in a newer format: kind -> why (eventlog/wire.py).
        self.blocked: dict[str, str] = {}
        self._listener = listener
        self._readers: dict[str, LogReader] = {}
        self._prefetch: TailPrefetch | None = None  # the KV tail, read while a snapshot loads
        self.prefetched = 0  # KV messages applied from a prefetch
        self._supervisor: asyncio.Task[None] | None = None
        self.replication = ReplicationCost()  # decoding + applying peers' router messages
        self._kv_holds = 0  # holds not released yet: no KV message is applied while any is
        self._kv_free = asyncio.Event()
        self._kv_free.set()
        self.kv_waits = 0  # times a KV message (or slice) waited for a hold to be released

    def connect(self, log: EventLog, snapshots: SnapshotStore | None) -> None:
        """The streams to follow, and the snapshots to reload from (None: never reload)."""
        self.log = log
        self.snapshots = snapshots

    async def measure_catch_up(self) -> None:
        """Note each stream's end now: the replica is caught up once it has applied that far."""
        assert self.log is not None
        for kind in STREAM_KINDS:
            _, last = await self.log.bounds(self.names.stream(kind))
            self.catch_up_targets[kind] = last
            self.stream_last[kind] = max(last, self.state.positions[kind])

    def caught_up(self, lag: int) -> bool:
        return all(self.state.positions[k] + lag >= self.catch_up_targets.get(k, 0)
                   for k in STREAM_KINDS)

    def start(self) -> None:
        self._supervisor = asyncio.create_task(self._supervise(), name="followers")

    async def stop(self) -> None:
        if self._supervisor is not None:
            self._supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._supervisor
        await self._drop_prefetch()

    # --- snapshots ---------------------------------------------------------------------------

    async def restore(self, why: str) -> bool:
        """Replace the state with the newest valid snapshot if it is ahead of ours."""
        if self.snapshots is None:
            return False
        # Beside the load, not before it: listing the snapshots again takes a round trip.
        prefetching = asyncio.create_task(self._start_prefetch())
        try:
            found = await self.snapshots.load_newest_valid()
        except BaseException:
            prefetching.cancel()
            await asyncio.gather(prefetching, return_exceptions=True)
            await self._drop_prefetch()
            raise
        await prefetching
        if found is None:
            return False
        meta, blob = found[0], found[1]
        # Decoding a large state takes a while: off the loop, so heartbeats and the lease go on.
        try:
            candidate = await asyncio.to_thread(RouterState.decode, blob, self.config)
        except NewerFormat as exc:  # a snapshot whose meta did not say its format
            log.error("replica %s cannot load snapshot %s: %s", self.replica_id,
                      meta.snapshot_id, exc)
            return False
        ours = self.state.positions
        if candidate.epoch < self.state.epoch or all(
                candidate.positions[k] <= ours[k] for k in STREAM_KINDS):
            return False
        self.state = candidate
        self.restores += 1
        log.warning("replica %s loaded snapshot %s at %s (%s)", self.replica_id,
                    meta.snapshot_id, candidate.positions, why)
        return True

    async def reseat(self, state: RouterState) -> None:
        """Replace the state with a seed snapshot's (NATS lost its streams and another replica
        re-created them: `replicas.runtime.reseed`) and follow on from its positions."""
        await self.stop()
        self.state = state
        self.restores += 1
        self.stream_last = dict(state.positions)
        self._listener.stream_rewound()
        self.start()

    async def _start_prefetch(self) -> None:
        """Read the KV tail after the newest snapshot while it loads (tail_prefetch.py)."""
        assert self.log is not None and self.snapshots is not None
        await self._drop_prefetch()
        try:
            newest = await self.snapshots.list()
        except Exception:  # the load that follows meets it too, and says so
            return
        if newest and newest[0].positions.get(KV, 0) > self.state.positions[KV]:
            reader = self.log.reader(self.names.stream(KV),
                                     start_seq=newest[0].positions[KV] + 1, time_decode=False,
                                     decode=kv_decoder(self.state.index))
            self._prefetch = TailPrefetch(reader, _PREFETCH_LIMIT)

    async def _drop_prefetch(self) -> None:
        prefetch, self._prefetch = self._prefetch, None
        if prefetch is not None:
            await prefetch.close()

    # --- holding the KV stream ----------------------------------------------------------------

    def hold_kv(self) -> Callable[[], None]:
        """Apply no KV message until the returned function is called (calling it again does
        nothing). Outside approximate mode only KV messages change the prefix index, so the
        index stands still meanwhile while the other streams keep applying."""
        self._kv_holds += 1
        self._kv_free.clear()
        released = False

        def release() -> None:
            nonlocal released
            if released:
                return
            released = True
            self._kv_holds -= 1
            if not self._kv_holds:
                self._kv_free.set()

        return release

    @property
    def kv_held(self) -> bool:
        return self._kv_holds > 0

    async def _kv_released(self) -> None:
        """Return once no hold is on the KV stream; apply right after, with no await between."""
        if self._kv_holds:
            self.kv_waits += 1
            while self._kv_holds:
                await self._kv_free.wait()

    # --- following ---------------------------------------------------------------------------

    async def _supervise(self) -> None:
        """Run one follower per stream; a purge under us means reload from the snapshot, a
        StateReset means re-read from its cut; anything else restarts the followers from the
        positions the state has applied (nothing is lost or applied twice)."""
        backoff = 0.2
        while True:
            if KV in self.blocked:  # no KV follower will adopt it
                await self._drop_prefetch()
            followers = [asyncio.create_task(self._follow(k), name=f"follow-{k}")
                         for k in STREAM_KINDS if k not in self.blocked]
            if not followers:  # every stream is blocked: only an upgrade moves this replica
                await asyncio.Event().wait()
            done, pending = await asyncio.wait(followers, return_when=asyncio.FIRST_EXCEPTION)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            errors = [t.exception() for t in done if not t.cancelled() and t.exception()]
            purged = [e for e in errors if isinstance(e, StartPurged)]
            blocked = [e for e in errors if isinstance(e, NewerFormat)]
            if (blocked or any(isinstance(e, _Rewind) for e in errors)) and not purged:
                # Blocked streams were recorded by their follower; the others restart at once.
                backoff = 0.2
                continue
            if purged:
                reloaded = await self.restore(str(purged[0]))
                if not reloaded:
                    log.error("%s and no snapshot covers it yet; retrying", purged[0])
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, 5.0)
                else:
                    backoff = 0.2
                continue
            for e in errors:
                log.error("stream follower failed (%s: %s); restarting from applied positions",
                          type(e).__name__, e)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)

    async def _follow(self, kind: str) -> None:
        assert self.log is not None
        stream = self.names.stream(kind)
        reader: LogReader | None = None
        if kind == KV and (prefetch := self._prefetch) is not None:
            reader = await self._adopt_prefetch(prefetch)
        if reader is None:
            # Only the router stream's decode time is read (the replication cost of peers'
            # decisions)
            reader = self.log.reader(stream, start_seq=self.state.positions[kind] + 1,
                                     time_decode=kind == ROUTER,
                                     decode=kv_decoder(self.state.index) if kind == KV
                                     else ev.decode_batch)
        self._readers[kind] = reader
        own = self.names.router_subject(self.replica_id)
        try:
            async for seq, batch in reader:
                if kind == ROUTER:
                    if reader.last_subject != own:
                        t0 = time.thread_time()
                        self._apply(kind, seq, batch, reader)
                        self.replication.note(time.thread_time() - t0 + reader.last_decode_s,
                                              len(batch))
                    else:
                        self._apply(kind, seq, batch, reader)
                    continue
                if kind == KV:
                    await self._kv_released()
                self._apply(kind, seq, batch, reader)
                # What else a pull brought is applied now, without a pass through the event
                # loop per message: a replica catching up on a tail of 100 k messages awaits
                # once per pull. Bounded, so the loop still runs between slices of a pull.
                limit = _KV_SLICE if kind == KV else _APPLY_SLICE
                while taken := reader.take_received(limit):
                    if kind == KV:  # stores and removals as runs: one change to the index
                        await self._kv_released()
                        self._apply_many(kind, taken, reader)
                    else:
                        for seq, batch in taken:
                            self._apply(kind, seq, batch, reader)
                    if len(taken) == limit:
                        await asyncio.sleep(0)
        except NewerFormat as exc:
            self.blocked[kind] = str(exc)
            log.error("STREAM %s BLOCKED on replica %s at position %d: %s; nothing more is "
                      "applied from it until this replica runs a release that reads it",
                      stream, self.replica_id, self.state.positions[kind], exc)
            self._listener.stream_blocked(kind, str(exc))
            raise
        finally:
            self._readers.pop(kind, None)
            self.malformed[kind] += reader.malformed
            with contextlib.suppress(Exception):
                await reader.close()

    def _apply(self, kind: str, seq: int, batch: Sequence[ev.Event], reader: LogReader) -> None:
        state = self.state
        before = (state.epoch, state.positions[KV], state.positions[ROUTER])
        state.apply(kind, seq, batch)
        self.stream_last[kind] = max(self.stream_last[kind], seq + reader.pending)
        self._listener.stream_applied(kind, ((seq, batch),))
        if kind == CONTROL and state.epoch != before[0] and (
                state.positions[KV], state.positions[ROUTER]) != before[1:]:
            # A StateReset moved the other streams' positions to its cut: re-read from there.
            self._listener.stream_rewound()
            raise _Rewind()

    def _apply_many(self, kind: str, messages: Sequence[tuple[int, Sequence[ev.Event]]],
                    reader: LogReader) -> None:
        """``_apply`` of each message, the state changed by one ``apply_many`` (not for the
        control stream: a StateReset there must stop the follower at its own message)."""
        self.state.apply_many(kind, messages)
        self.stream_last[kind] = max(self.stream_last[kind], messages[-1][0] + reader.pending)
        self._listener.stream_applied(kind, messages)

    async def _adopt_prefetch(self, prefetch: TailPrefetch) -> LogReader | None:
        """Apply what ``prefetch`` read and return its reader, if the state continues where it
        starts; None (prefetch closed) otherwise, or when its reading failed."""
        self._prefetch = None
        if prefetch.start_seq != self.state.positions[KV] + 1:
            await prefetch.close()  # the state restored is not the snapshot it followed
            return None
        reader = prefetch.reader

        async def apply(items: list[tuple[int, list[ev.Event]]]) -> None:
            for start in range(0, len(items), _KV_SLICE):  # in slices, as a pull's
                await self._kv_released()
                self._apply_many(KV, items[start:start + _KV_SLICE], reader)
                await asyncio.sleep(0)
            self.prefetched += len(items)

        self._readers[KV] = reader  # its malformed count is the running reader's meanwhile
        adopted = None
        try:
            adopted = await adopt(prefetch, apply)
        finally:
            self._readers.pop(KV, None)
            if adopted is None:  # closed after what it read was applied: count what it skipped
                self.malformed[KV] += reader.malformed
        return adopted

    def malformed_counts(self) -> dict[str, int]:
        """Malformed messages skipped per stream, including the running readers' counts."""
        return {k: self.malformed[k] + (r.malformed if (r := self._readers.get(k)) else 0)
                for k in STREAM_KINDS}

    def lag(self) -> dict[str, int]:
        return {k: max(self.stream_last[k] - self.state.positions[k], 0) for k in STREAM_KINDS}
