"""SQL projections of the streams: the snapshot catalog and the decision ledger (design.md §8).

:class:`Projections` applies stream messages to the views with the tracking row in the same
transaction (exactly once, resumable, rebuildable by replay); :class:`ProjectionFeeder` follows
the router and control streams from the tracked positions and feeds it in group commits: once a
message arrives, the writer collects what arrives within the next ``batch_window`` seconds
(unless a full transaction's worth is already queued) plus whatever queued while the previous
transaction was committing, up to ``max_messages``, and applies it all in one transaction with
the tracking row. A transaction costs far more than a message (about a millisecond of CPU
through SQLAlchemy and aiosqlite's thread, a handful of statements), so at a few hundred
requests/s a transaction per message cost the projector more CPU than the router's own request
handling; the window caps the ledger's transactions at ``1 / batch_window`` per second. The
window applies to the router stream only: the control stream carries a message per snapshot or
configuration change, and ``jetrouter admin snapshots`` right after ``admin snapshot`` must list
it. When the streams are idle the writers wait on their queues: no timer runs. The router
stream's reader lingers (:class:`eventlog.reader.StreamReader`, ``linger``): after the first
message of a quiet spell it takes the rest in one pull half a window later, so at low load the
projector wakes a few times per window instead of once per message.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import nats.errors
from nats.js import JetStreamContext
from sqlalchemy import exc as sa_exc
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from eventlog import events as ev
from eventlog.names import CONTROL, ROUTER, Names
from eventlog.reader import StartPurged, StreamReader
from eventlog.wire import NewerFormat
from snapshots.catalog import CatalogView
from snapshots.db import Tracking, create_tables, make_engine, read_tracking, write_tracking
from snapshots.ledger import LedgerView

log = logging.getLogger(__name__)

Message = tuple[int, Sequence[ev.Event]]
DEFAULT_LEDGER_RETENTION = 7 * 86400.0
# How long the ledger may trail the stream to save transactions; the admin views read it, no
# routing decision does.
DEFAULT_BATCH_WINDOW = 0.1
POSITION_POLL = 0.02
# A stream leader election lasts 4-9 s (docs/decisions/0031-election-is-the-floor.md).
MAX_READ_RETRY_DELAY = 2.0


class View(Protocol):
    projection: str
    stream: str

    async def write(
        self, conn: AsyncConnection, messages: Sequence[Message], track: Tracking
    ) -> None: ...


class Projections:
    """Both views over one database URL (``sqlite+aiosqlite:///…`` or any async SQLAlchemy URL)."""

    def __init__(self, url: str, *, ledger_retention: float = DEFAULT_LEDGER_RETENTION) -> None:
        self.url = url
        self.catalog = CatalogView()
        self.ledger = LedgerView(ledger_retention)
        self._views: dict[str, View] = {CONTROL: self.catalog, ROUTER: self.ledger}
        # One write transaction at a time, on one held connection: SQLite has a single writer
        # anyway (two deferred transactions that both read the tracking row and then both
        # write would deadlock), and a held connection saves the pool's checkout and reset on
        # every transaction. Reads go through the pool and run beside it (WAL).
        self._write_lock = asyncio.Lock()
        self._writer: AsyncConnection | None = None
        self._engine: AsyncEngine | None = None

    @property
    def kinds(self) -> tuple[str, ...]:
        """The stream kinds that have a projection (router and control; not kv)."""
        return tuple(self._views)

    async def start(self) -> None:
        if self._engine is None:
            engine = make_engine(self.url)
            try:
                await create_tables(engine)
                self._writer = await engine.connect()
            except BaseException:
                await engine.dispose()
                raise
            self._engine = engine

    async def close(self) -> None:
        async with self._write_lock:
            writer, self._writer = self._writer, None
            engine, self._engine = self._engine, None
            if writer is not None:
                await writer.close()
            if engine is not None:
                await engine.dispose()

    async def __aenter__(self) -> Projections:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- writing -------------------------------------------------------------------------------

    async def position(self, stream_kind: str) -> int:
        """The last stream sequence applied to ``stream_kind``'s projection (0 before any)."""
        view = self._view(stream_kind)
        async with self._engine_or_fail().connect() as conn:
            return (await read_tracking(conn, view.projection, view.stream)).seq

    async def reached(self, stream_kind: str, seq: int, within: float) -> bool:
        """Whether ``stream_kind``'s projection has applied ``seq``, waiting up to ``within``
        seconds for it. The projector is another process writing the same database, so its
        progress is read, not awaited: a read every ``POSITION_POLL`` seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        while await self.position(stream_kind) < seq:
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(POSITION_POLL)
        return True

    async def apply(self, stream_kind: str, seq: int, batch: Sequence[ev.Event]) -> bool:
        """Apply one stream message; False (nothing written) when ``seq`` is at or below the
        tracked position. An empty ``batch`` just advances the position (skip a message)."""
        return await self.apply_many(stream_kind, [(seq, batch)]) == 1

    async def apply_many(self, stream_kind: str, messages: Sequence[Message]) -> int:
        """Apply messages (ascending seq) in ONE transaction with the tracking row set to the
        last one; messages at or below the tracked position are ignored. Returns how many were
        applied. On any exception nothing of the call is kept."""
        view = self._view(stream_kind)
        async with self._write_lock:
            conn = self._writer
            if conn is None:
                raise RuntimeError("Projections.start() has not been called (or close() was)")
            async with conn.begin():
                return await self._apply_in(conn, view, messages)

    async def _apply_in(
        self, conn: AsyncConnection, view: View, messages: Sequence[Message]
    ) -> int:
        track = await read_tracking(conn, view.projection, view.stream)
        todo: list[Message] = []
        last = track.seq
        for seq, batch in messages:
            if seq > last:
                todo.append((seq, batch))
                last = seq
        if not todo:
            return 0
        await view.write(conn, todo, track)
        track.seq = last
        await self._write_tracking(conn, track)
        return len(todo)

    async def _write_tracking(self, conn: AsyncConnection, track: Tracking) -> None:
        await write_tracking(conn, track)

    # --- reading -------------------------------------------------------------------------------

    async def snapshots(self, limit: int = 50) -> list[dict[str, Any]]:
        """Catalogued snapshots, newest (highest control-stream sequence) first."""
        async with self._engine_or_fail().connect() as conn:
            return await self.catalog.snapshots(conn, limit)

    async def request(self, request_id: str) -> dict[str, Any] | None:
        """One routing decision with its candidates, timings, outcome and ``hops`` (every hop of
        the base request, hop 0 first); None when unknown or aged out."""
        async with self._engine_or_fail().connect() as conn:
            return await self.ledger.request(conn, request_id)

    async def stats(self) -> dict[str, Any]:
        """Row counts and positions, for ``/admin/state`` and tests."""
        async with self._engine_or_fail().connect() as conn:
            positions = {
                kind: (await read_tracking(conn, v.projection, v.stream)).seq
                for kind, v in self._views.items()
            }
            return {
                "positions": positions,
                "snapshots": await self.catalog.count(conn),
                "ledger_rows": await self.ledger.count(conn),
            }

    def _view(self, stream_kind: str) -> View:
        try:
            return self._views[stream_kind]
        except KeyError:
            raise ValueError(
                f"no projection follows stream kind {stream_kind!r} (only {sorted(self._views)})"
            ) from None

    def _engine_or_fail(self) -> AsyncEngine:
        if self._engine is None:
            raise RuntimeError("Projections.start() has not been called (or close() was)")
        return self._engine


def is_transient(exc: BaseException) -> bool:
    """Database trouble a retry can cure (locked, connection lost, disk momentarily full), as
    opposed to a message the views cannot take, which would fail the same way forever."""
    return isinstance(
        exc, sa_exc.OperationalError | sa_exc.InterfaceError | OSError | TimeoutError
    )


@dataclass(frozen=True, slots=True)
class _Jump:
    """The stream no longer holds what comes next: continue after ``to_seq``."""

    to_seq: int


@dataclass(slots=True)
class FeederStats:
    applied: int = 0
    transactions: int = 0
    skipped: int = 0  # poison messages stepped over (logged)
    retries: int = 0  # transient database failures retried
    purged_gaps: int = 0  # stream purged past the tracked position: history lost
    failures: list[str] = field(default_factory=list)  # the last 20


class ProjectionFeeder:
    """Follows ``kinds`` from the projections' tracked positions and applies what arrives.

    One reader task per stream puts messages on a bounded queue; one writer task per stream
    takes everything queued (up to ``max_messages``) per transaction — for the kinds in
    ``batched_kinds``, everything queued within ``batch_window`` of the first message.
    """

    def __init__(
        self,
        js: JetStreamContext,
        names: Names,
        projections: Projections,
        *,
        kinds: Sequence[str] = (ROUTER, CONTROL),
        max_messages: int = 1000,
        queue_size: int = 8192,
        retry_delay: float = 0.2,
        batch_window: float = DEFAULT_BATCH_WINDOW,
        batched_kinds: Sequence[str] = (ROUTER,),
    ) -> None:
        self._js = js
        self._names = names
        self.projections = projections
        self.kinds = tuple(kinds)
        self.max_messages = max_messages
        self.queue_size = queue_size
        self.retry_delay = retry_delay
        self.batch_window = batch_window
        self.batched_kinds = frozenset(batched_kinds)
        self.stats = {kind: FeederStats() for kind in self.kinds}
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        for kind in self.kinds:
            queue: asyncio.Queue[Message | _Jump] = asyncio.Queue(self.queue_size)
            start = await self.projections.position(kind) + 1
            self._tasks.append(asyncio.create_task(self._read(kind, start, queue),
                                                   name=f"projection-reader-{kind}"))
            self._tasks.append(asyncio.create_task(self._write(kind, queue),
                                                   name=f"projection-writer-{kind}"))

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _read(self, kind: str, start: int, queue: asyncio.Queue[Message | _Jump]) -> None:
        stream = self._names.stream(kind)
        delay = self.retry_delay
        # A batched stream is committed in windows anyway: its reader need not wake for every
        # message either (at low load, three per request), only about twice per window.
        linger = self.batch_window / 2 if kind in self.batched_kinds else 0.0
        while True:
            reader = StreamReader(self._js, stream, start_seq=start, linger=linger)
            try:
                async for seq, batch in reader:
                    await queue.put((seq, batch))
                    start = seq + 1
                    delay = self.retry_delay
                return
            except StartPurged as exc:
                log.warning("projection of %s: %s; the views lose that history", stream, exc)
                self.stats[kind].purged_gaps += 1
                await queue.put(_Jump(exc.first_seq - 1))
                start = exc.first_seq
            except asyncio.CancelledError:
                raise
            except NewerFormat as exc:  # only a newer release can read on: stop, as replicas do
                log.error("projection of %s stopped: %s", stream, exc)
                self._remember(kind, exc)
                return
            except nats.errors.ConnectionClosedError as exc:  # closed for good: nothing more
                log.warning("projection reader for %s stopped: the NATS connection is closed",
                            stream)
                self._remember(kind, exc)
                return
            except Exception as exc:
                # A NATS server lost and the stream electing a leader makes consumer creation
                # and stream info time out for seconds; the ledger must go on after it, from
                # the next message it has not queued yet.
                log.warning("projection reader for %s: %r; reading again from %d in %.2fs",
                            stream, exc, start, delay)
                self._remember(kind, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, MAX_READ_RETRY_DELAY)
            finally:
                await reader.close()

    def _remember(self, kind: str, exc: BaseException) -> None:
        failures = self.stats[kind].failures
        failures.append(repr(exc))
        del failures[:-20]

    async def _write(self, kind: str, queue: asyncio.Queue[Message | _Jump]) -> None:
        window = self.batch_window if kind in self.batched_kinds else 0.0
        while True:
            first = await queue.get()
            if window > 0 and queue.qsize() < self.max_messages - 1:
                await asyncio.sleep(window)  # let the next messages join (group commit)
            group: list[Message | _Jump] = [first]
            while len(group) < self.max_messages and not queue.empty():
                group.append(queue.get_nowait())
            chunk: list[Message] = []
            for item in group:
                if isinstance(item, _Jump):
                    await self._commit(kind, chunk)
                    chunk = []
                    await self._commit(kind, [(item.to_seq, [])])
                else:
                    chunk.append(item)
            await self._commit(kind, chunk)

    async def _commit(self, kind: str, chunk: list[Message]) -> None:
        """Apply ``chunk``, retrying transient failures; a chunk that fails otherwise is applied
        message by message so that only the bad message is stepped over."""
        if not chunk:
            return
        stats = self.stats[kind]
        delay = self.retry_delay
        while True:
            try:
                stats.applied += await self.projections.apply_many(kind, chunk)
                stats.transactions += 1
                return
            except Exception as exc:
                if is_transient(exc):
                    stats.retries += 1
                    log.warning("projection %s: database busy or away (%r); retrying", kind, exc)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 5.0)
                    continue
                if len(chunk) > 1:
                    for message in chunk:
                        await self._commit(kind, [message])
                    return
                seq, batch = chunk[0]
                if not batch:  # even a bare position advance fails: not ours to step over
                    raise
                log.error("projection %s: skipping seq %d, the views cannot take it: %r",
                          kind, seq, exc)
                stats.skipped += 1
                stats.failures = [*stats.failures[-19:], f"seq {seq}: {exc!r}"]
                chunk = [(seq, [])]
