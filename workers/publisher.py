"""Publishes the worker's KV events to JetStream and its load gauges to core NATS.

The engine hands over cache changes synchronously (:meth:`KvPublisher.emit` never blocks or
awaits); they get strictly increasing ``event_id``s at once and wait in an in-memory queue that one
task drains, in order, through ``Appender.append`` with the message id
``{worker_id}.{incarnation}.{first event_id}`` — so a retried publish is stored once. While NATS is
away the queue grows; past ``max_pending`` events it is dropped and replaced by a re-announce
(``AllBlocksCleared`` + the whole cache) when NATS is back: the skipped ``event_id``s tell the
router it missed something, and the re-announce puts it right.

Also: ``WorkerRegistered`` first, ``WorkerRetired`` on shutdown (after which KV events stop),
answers to re-announce requests, and load gauges every ``load_interval`` seconds as JSON on
``<ns>.load.<worker_id>``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from eventlog.appender import Appender, AppendFailed
from eventlog.connect import NatsOptions
from eventlog.events import (
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    Event,
    WorkerRegistered,
    WorkerRetired,
)
from eventlog.names import Names
from workers.engine_link import (
    MAX_BLOCKS_PER_MESSAGE,
    MAX_EVENTS_PER_MESSAGE,
    block_count,
    connect_kv_stream,
)
from workers.kvcache import Cleared, KvChange, Removed, Stored

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Outgoing:
    msg_id_suffix: str
    events: list[Event]
    blocks: int
    mergeable: bool  # KV batches may be merged with their neighbours; lifecycle events not
    attempted: bool = False  # once sent under its msg id, its content must never change


class KvPublisher:
    def __init__(
        self,
        nats_url: str,
        names: Names,
        worker_id: str,
        incarnation: str,
        *,
        dump: Callable[[], list[tuple[int, list[KvChange]]]] = list,
        load: Callable[[], list[dict[str, Any]]] = list,
        load_interval: float = 0.5,
        max_pending: int = 100_000,
        clock: Callable[[], float] = time.time,
        nats: NatsOptions | None = None,
    ) -> None:
        self.nats_url = nats_url
        self.nats = (nats or NatsOptions()).with_servers(nats_url)  # credentials and TLS
        self.names = names
        self.worker_id = worker_id
        self.incarnation = incarnation
        self.subject = names.kv_subject(worker_id)
        self._dump = dump
        self._load = load
        self.load_interval = load_interval
        self.max_pending = max_pending
        self._clock = clock
        self._queue: deque[_Outgoing] = deque()
        self._pending_events = 0
        self._kick = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._next_event_id = 1
        self._retired = False
        self._resync_needed = False
        self._nc: NatsClient | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.published_messages = 0
        self.dropped_events = 0
        self.reannounces = 0

    @property
    def enabled(self) -> bool:
        return bool(self.nats_url)

    @property
    def connected(self) -> bool:
        return self._nc is not None and self._nc.is_connected

    # --- producer side (synchronous, never blocks) -----------------------------------------

    def emit(self, dp_rank: int, changes: list[KvChange]) -> None:
        """Queue one scheduler step's cache changes as one batch."""
        if not self.enabled or self._retired or not changes:
            return
        ts = self._clock()
        events: list[Event] = []
        for change in changes:
            if isinstance(change, Stored):
                parent = change.parent_id
                for i in range(0, len(change.blocks), MAX_BLOCKS_PER_MESSAGE):
                    chunk = list(change.blocks[i:i + MAX_BLOCKS_PER_MESSAGE])
                    events.append(BlocksStored(self.worker_id, self._take_id(), dp_rank, parent,
                                               chunk, ts))
                    parent = chunk[-1][0]
            elif isinstance(change, Removed):
                ids = change.block_ids
                for i in range(0, len(ids), MAX_BLOCKS_PER_MESSAGE):
                    events.append(BlocksRemoved(self.worker_id, self._take_id(), dp_rank,
                                                list(ids[i:i + MAX_BLOCKS_PER_MESSAGE]), ts))
            elif isinstance(change, Cleared):
                events.append(AllBlocksCleared(self.worker_id, self._take_id(), dp_rank, ts))
        # One message per step, split only when it would be too big for one NATS message.
        batch: list[Event] = []
        blocks = 0
        for event in events:
            size = block_count(event)
            if batch and (blocks + size > MAX_BLOCKS_PER_MESSAGE
                          or len(batch) >= MAX_EVENTS_PER_MESSAGE):
                self._enqueue_kv(batch, blocks)
                batch, blocks = [], 0
            batch.append(event)
            blocks += size
        if batch:
            self._enqueue_kv(batch, blocks)

    def _take_id(self) -> int:
        eid = self._next_event_id
        self._next_event_id += 1
        return eid

    def _enqueue_kv(self, events: list[Event], blocks: int) -> None:
        first_id = events[0].event_id  # type: ignore[union-attr]
        self._enqueue(_Outgoing(str(first_id), events, blocks, True))

    def register(self, event: WorkerRegistered) -> None:
        if self.enabled:
            self._enqueue(_Outgoing("registered", [event], 1, False), front=True)

    def retire(self, reason: str = "shutdown") -> None:
        """Announce the end of this worker; no KV events follow it."""
        if not self.enabled or self._retired:
            return
        self._retired = True
        self._enqueue(_Outgoing("retired", [WorkerRetired(self.worker_id, reason, self._clock())],
                                1, False))

    def reannounce(self) -> None:
        """``AllBlocksCleared`` + ``BlocksStored`` chains for the whole cache, per dp rank."""
        self.reannounces += 1
        for dp_rank, changes in self._dump():
            self.emit(dp_rank, changes)

    def _enqueue(self, item: _Outgoing, *, front: bool = False) -> None:
        if item.mergeable and self._pending_events + len(item.events) > self.max_pending:
            self._drop_kv_backlog()
            return
        if front:
            self._queue.appendleft(item)
        else:
            self._queue.append(item)
        self._pending_events += len(item.events)
        self._idle.clear()
        self._kick.set()

    def _drop_kv_backlog(self) -> None:
        kept = deque(item for item in self._queue if not item.mergeable)
        dropped = self._pending_events - sum(len(item.events) for item in kept)
        self.dropped_events += dropped
        self._queue = kept
        self._pending_events -= dropped
        self._resync_needed = True
        log.warning("KV event backlog over %d events: dropped %d, will re-announce",
                    self.max_pending, dropped)

    # --- consumer side ----------------------------------------------------------------------

    async def start(self) -> None:
        if self.enabled:
            self._tasks = [asyncio.create_task(self._pump(), name="kv-publisher")]

    async def flush(self, timeout: float) -> bool:
        """Wait until everything queued so far is published (or ``timeout``); True if it was."""
        if not self.enabled:
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True

    async def close(self, flush_timeout: float = 5.0) -> None:
        if not await self.flush(flush_timeout):
            log.warning("closing with %d unpublished KV events", self._pending_events)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        if self._nc is not None:
            with contextlib.suppress(Exception):
                await self._nc.drain()
            self._nc = None

    async def _connect(self) -> Appender:
        nc, js = await connect_kv_stream(self.nats, self.names,
                                         name=f"jetrouter-worker-{self.worker_id}")
        self._nc = nc
        await nc.subscribe(self.names.reannounce_subject(self.worker_id), cb=self._on_reannounce)
        await nc.subscribe(self.names.reannounce_subject("all"), cb=self._on_reannounce)
        self._tasks.append(asyncio.create_task(self._publish_load(), name="load-gauges"))
        # Same reasoning as the replica's appender: resume soon after a stream leader election.
        return Appender(js, timeout=1.5, attempts=1000, backoff_max=0.25, retry_window=20.0)

    async def _on_reannounce(self, msg: Msg) -> None:
        log.info("re-announce requested on %s", msg.subject)
        self.reannounce()
        if msg.reply:
            with contextlib.suppress(Exception):
                await msg.respond(b"ok")

    async def _pump(self) -> None:
        appender = await self._connect()
        delay = 0.1
        while True:
            if self._resync_needed:
                self._resync_needed = False
                self.reannounce()
            if not self._queue:
                self._idle.set()
                self._kick.clear()
                await self._kick.wait()
                continue
            item = self._merge_head()
            try:
                await appender.append(self.subject, item.events,
                                      f"{self.worker_id}.{self.incarnation}.{item.msg_id_suffix}")
            except AppendFailed as exc:
                log.warning("KV publish failed (%r); retrying in %.1fs", exc.cause, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
                continue
            delay = 0.1
            self._queue.popleft()
            self._pending_events -= len(item.events)
            self.published_messages += 1

    def _merge_head(self) -> _Outgoing:
        """Fold queued KV batches into the head one (fewer messages when publishing lags)."""
        head = self._queue[0]
        head_was_attempted, head.attempted = head.attempted, True
        if not head.mergeable or head_was_attempted:
            return head
        while len(self._queue) > 1:
            nxt = self._queue[1]
            if (not nxt.mergeable
                    or len(head.events) + len(nxt.events) > MAX_EVENTS_PER_MESSAGE
                    or head.blocks + nxt.blocks > MAX_BLOCKS_PER_MESSAGE):
                break
            del self._queue[1]
            head.events.extend(nxt.events)
            head.blocks += nxt.blocks
        return head

    async def _publish_load(self) -> None:
        subject = self.names.load_subject(self.worker_id)
        while True:
            nc = self._nc
            if nc is not None and nc.is_connected:
                for gauges in self._load():
                    payload = {"worker_id": self.worker_id, "ts": self._clock(), **gauges}
                    with contextlib.suppress(Exception):
                        await nc.publish(subject, json.dumps(payload).encode())
            await asyncio.sleep(self.load_interval)
