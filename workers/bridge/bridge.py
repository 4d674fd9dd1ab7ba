"""The bridge process: one real engine's ZMQ KV events -> ``JR_KV``, its /metrics -> load gauges.

Exactly-once across bridge restarts: see workers/bridge/resume.py.

Sequence discipline (one task appends, in engine order)
-------------------------------------------------------
* live ``seq > last + 1``: a gap -> replay ``last + 1 ..``; what cannot be replayed makes the next
  appended message start with ``AllBlocksCleared`` for every dp rank seen. A replay answer with
  a hole after some progress is asked again from the hole (a ZMQ ROUTER drops what overflows
  its send queue while the reader is slow, so a hole does not mean the engine lost the batches);
  so is one that goes silent before its end marker, or stops short of the batch asked up to.
* live ``seq <=`` the highest live seq seen: the engine restarted (its seq went back) -> a new
  ``gen``, ``AllBlocksCleared``, replay of the new run from 0. A changed ``process_start_time``
  seen while polling ``/metrics`` does the same even if the new engine is silent.
* never a silently wrong index: when in doubt, clear.

Also: load gauges on core NATS ``<ns>.load.<worker_id>`` (same JSON as the simulated worker),
re-announce requests (``<ns>.reannounce.<id>|all``) answered from a mirror of what the bridge put
in the index (or with a clear when the bridge did not see the whole history), ``WorkerRetired`` on
SIGTERM or when ``/health`` fails for ``--unhealthy-after`` seconds (re-registered when it
recovers); a ``/health`` that times out while the engine's KV events flow is a busy engine, not a
failing one (workers/bridge/monitor.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable

import zmq.asyncio
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js.errors import NotFoundError

from eventlog.appender import Appender, AppendFailed
from eventlog.events import EngineKind, Event, Role, WorkerRegistered, WorkerRetired
from eventlog.names import KV, Names
from workers.bridge.config import BridgeConfigInvalid, BridgeSettings
from workers.bridge.decode import BadPayload, EngineStored, decode_payload
from workers.bridge.engine_http import EngineHttp, EngineUnavailable, MetricsView
from workers.bridge.monitor import EngineMonitor
from workers.bridge.resume import (
    H_EVENT_ID,
    ResumePoint,
    new_gen,
    position_headers,
    resume_point,
)
from workers.bridge.translate import CacheMirror, Translator
from workers.bridge.zmqio import Frame, LiveFeed, ReplayUnavailable, replay
from workers.engine_link import (
    MAX_BLOCKS_PER_MESSAGE,
    MAX_EVENTS_PER_MESSAGE,
    block_count,
    connect_kv_stream,
)

log = logging.getLogger(__name__)

# Replay requests for one gap while each answer brings batches the previous ones did not.
REPLAY_ROUNDS = 50


class Bridge:
    def __init__(self, settings: BridgeSettings, *, clock: Callable[[], float] = time.time) -> None:
        self.s = settings
        self.names = Names(settings.namespace)
        self.subject = self.names.kv_subject(settings.worker_id)
        self.clock = clock
        self.engine = EngineHttp(settings.engine_url, settings.engine_http_timeout)
        self.ctx = zmq.asyncio.Context()
        self.nc: NatsClient | None = None
        self.appender: Appender | None = None
        # where we are
        self.gen = new_gen()
        self.last_seq = -1  # engine seq of the last batch handled in this gen
        self.live_high = -1  # highest seq seen on the live socket in this engine run
        self.registered = False
        self.retired = False
        self.block_size: int | None = settings.block_size
        self.engine_start: float | None = None
        # The engine run (its start time) the last restart clear was made for: a restart is
        # seen twice, by the live seq going back and by the monitor's start time changing, and
        # the second sighting must not clear blocks the new run has stored since.
        self.cleared_for_start: float | None = None
        self.kv_total_blocks: int | None = None  # from the settings or the engine, on register
        self.translator: Translator | None = None
        self.next_event_id = 1
        self.appended_event_id = 0  # the last event id on the stream (position headers)
        self.mirror = CacheMirror()
        self.mirror_valid = True  # the mirror equals what the index holds for this worker
        self.pending_clear = False
        self.ranks_seen: set[int] = {0}
        # translated engine batches not appended yet (one message for a run of them)
        self.out_events: list[Event] = []
        self.out_first = -1
        self.out_blocks = 0
        self.metrics = MetricsView()
        # monotonic time of the engine's last live KV batch: its engine core is making progress
        # (a busy engine whose HTTP side is slow to answer is not a dead one: monitor.py)
        self.last_progress: float | None = None
        self.control: asyncio.Queue[str] = asyncio.Queue()  # handled between batches
        self._stop = asyncio.Event()
        # counters (logged at exit; tests read them in-process)
        self.appended = 0
        self.replayed = 0
        self.unreplayable_gaps = 0
        self.replay_retries = 0
        self.engine_restarts = 0
        self.bad_payloads = 0
        self.dropped_before_block_size = 0
        self.reannounces = 0

    # --- start-up ----------------------------------------------------------------------------

    async def _connect_nats(self) -> None:
        nc, js = await connect_kv_stream(self.s.nats.with_servers(self.s.nats_url), self.names,
                                         name=f"jetrouter-bridge-{self.s.worker_id}")
        self.nc = nc
        self.appender = Appender(js)

    async def _wait_engine(self) -> tuple[str, list[str]]:
        """Block until the engine answers /health, /v1/models and /metrics."""
        delay = 0.2
        while True:
            try:
                if not await self.engine.healthy():
                    raise EngineUnavailable("/health is not 2xx")
                model, loras = await self.engine.models()
                self.metrics = await self.engine.metrics()
                return model, loras
            except EngineUnavailable as exc:
                log.info("engine %s not ready (%s); retrying in %.1fs", self.s.engine_url, exc,
                         delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)

    async def _last_message(self) -> ResumePoint | None:
        assert self.nc is not None
        js = self.nc.jetstream()
        try:
            msg = await js.get_last_msg(self.names.stream(KV), self.subject)
        except NotFoundError:
            return None
        return resume_point(msg.headers, msg.data or b"")

    async def start(self) -> None:
        """Connect, learn where we are, and (if starting afresh) register.

        Raises BridgeConfigInvalid."""
        await self._connect_nats()
        model, loras = await self._wait_engine()
        self.model = self.s.model or model
        self.loras = loras
        self.engine_start = self.metrics.start_time
        engine_bs = self.metrics.block_size
        if self.block_size is not None and engine_bs is not None and engine_bs != self.block_size:
            raise BridgeConfigInvalid(f"--block-size {self.block_size} differs from the engine's "
                                      f"block size {engine_bs} ({self.s.engine_url}/metrics)")
        if self.block_size is None:
            self.block_size = self.metrics.block_size
        self.kv_total_blocks = self.s.kv_total_blocks or self.metrics.num_gpu_blocks
        if not self.kv_total_blocks:
            raise BridgeConfigInvalid(
                f"{self.s.engine_url}/metrics reports no KV capacity "
                "(vllm:cache_config_info num_gpu_blocks): pass --kv-total-blocks")
        point = await self._last_message()
        same_engine = point is not None and (
            point.engine_start is None or self.engine_start is None
            or point.engine_start == self.engine_start)
        if point is not None and same_engine and (
                self.block_size is None or point.block_size == self.block_size):
            self.gen, self.last_seq = point.gen, point.seq
            self.live_high = point.seq
            self.block_size = point.block_size
            self.next_event_id = point.event_id + 1
            self.appended_event_id = point.event_id
            self.registered = True
            # The index holds what earlier runs appended, which this process never saw: the
            # mirror is rebuilt below from the engine's replay buffer when it still starts at 0.
            self.mirror_valid = False
            log.info("resuming %s: gen %s after engine seq %d, event id %d",
                     self.s.worker_id, self.gen, self.last_seq, point.event_id)
        else:
            if point is not None:
                self.next_event_id = point.event_id + 1
                self.appended_event_id = point.event_id
            log.info("starting %s afresh (gen %s)", self.s.worker_id, self.gen)
        self.live = LiveFeed(self.ctx, self.s.kv_events, self.s.kv_topic)
        self.live.open()
        assert self.nc is not None
        await self.nc.subscribe(self.names.reannounce_subject(self.s.worker_id),
                                cb=self._on_reannounce)
        await self.nc.subscribe(self.names.reannounce_subject("all"), cb=self._on_reannounce)
        if not self.registered and self.block_size is not None:
            await self._register()
        if self.registered and self.translator is None:
            assert self.block_size is not None
            self.translator = Translator(self.s.worker_id, self.block_size, self.next_event_id)
        if not self.mirror_valid:
            await self._rebuild_mirror()
        # What the engine did before (or while) no bridge listened.
        await self._fill_gap(self.last_seq + 1, None)
        await self._flush_clear()

    async def _rebuild_mirror(self) -> None:
        """After a resume: replay the engine's run from seq 0 up to where we left off into the
        mirror (not the stream), so re-announce requests get the whole cache, not just a clear.
        Possible only while the engine's buffer still holds its whole run."""
        assert self.block_size is not None
        head, _, _ = await self._replay_contiguous(0, self.last_seq + 1)
        if len(head) != self.last_seq + 1:
            log.info("engine replay buffer no longer starts at seq 0: re-announce will clear")
            return
        scratch = Translator(self.s.worker_id, self.block_size)
        for frame in head:
            with contextlib.suppress(BadPayload):
                batch = decode_payload(frame.payload)
                self.ranks_seen.add(batch.dp_rank)
                self.mirror.apply(scratch.translate(batch))
        self.mirror_valid = True

    # --- appending ---------------------------------------------------------------------------

    def _headers(self, events: list[Event]) -> dict[str, str]:
        """Position headers of a message holding ``events``, appended after engine batch
        ``last_seq`` was handled."""
        event_id = max((e.event_id for e in events if hasattr(e, "event_id")),  # type: ignore[attr-defined]
                       default=self.appended_event_id)
        return position_headers(self.gen, self.last_seq, event_id, self.block_size or 0,
                                self.engine_start)

    async def _append(self, events: list[Event], msg_id: str) -> None:
        """Append one message, retrying until it is stored: its ``event_id``s are taken, so it
        must land (the same id and bytes every time: stored once). Whatever the outbox holds
        goes first, so the stream keeps the engine's order."""
        await self._flush_out()
        await self._append_now(events, msg_id)

    async def _flush_out(self) -> None:
        """Append the engine batches gathered in the outbox as one message.

        Batches that arrive together (a backlog on the SUB socket, a replay) share a message:
        one JetStream round trip instead of one per engine step. The id names the seq range
        (``<worker>.<gen>.<first>-<last>``); a restarted bridge may cut ranges differently, and
        that is safe: equal seqs translate to the same events with the same ``event_id``s from
        the same resume point, so any overlap is dropped event by event by
        replicas/core/state.py."""
        if not self.out_events:
            return
        events, first = self.out_events, self.out_first
        self.out_events, self.out_blocks = [], 0
        await self._append_now(events, f"{self.s.worker_id}.{self.gen}.{first}-{self.last_seq}")
        self.mirror.apply(events)

    async def _append_now(self, events: list[Event], msg_id: str) -> None:
        assert self.appender is not None
        headers = self._headers(events)
        delay = 0.1
        while True:
            try:
                await self.appender.append(self.subject, events, msg_id, headers)
                self.appended += 1
                self.appended_event_id = int(headers[H_EVENT_ID])
                return
            except AppendFailed as exc:
                log.warning("append %s failed (%r); retrying in %.1fs", msg_id, exc.cause, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def _register(self) -> None:
        assert self.block_size is not None and self.kv_total_blocks is not None
        dp_size = max([1, *(r + 1 for r in self.metrics.load)])
        event = WorkerRegistered(
            self.s.worker_id, self.s.advertise_url or self.s.engine_url, self.model,
            self.block_size, self.kv_total_blocks, self.s.max_num_batched_tokens,
            self.clock(), dp_size=dp_size, loras=list(self.loras),
            role=Role(self.s.role), engine_kind=self._engine_kind(),
            bootstrap_port=self.s.bootstrap_port)
        self.translator = Translator(self.s.worker_id, self.block_size, self.next_event_id)
        await self._append([event], f"{self.s.worker_id}.{self.gen}.registered")
        self.registered = True
        self.retired = False
        self.mirror.reset()
        self.mirror_valid = True
        log.info("registered %s: model %s, block size %d, %d KV blocks, loras %s, role %s, "
                 "engine %s", self.s.worker_id, self.model, self.block_size,
                 self.kv_total_blocks, self.loras, event.role, event.engine_kind)

    def _engine_kind(self) -> EngineKind:
        if self.s.engine_kind != "auto":
            return EngineKind(self.s.engine_kind)
        found = self.metrics.engine_kind
        return EngineKind(found) if found in tuple(EngineKind) else EngineKind.JETROUTER

    async def _handle(self, frame: Frame) -> None:
        """Append one engine batch (its seq follows ``last_seq``)."""
        try:
            batch = decode_payload(frame.payload)
        except BadPayload as exc:
            self.bad_payloads += 1
            log.warning("engine batch seq %d skipped: %s", frame.seq, exc)
            self.last_seq = frame.seq
            return
        if self.retired:
            self.last_seq = frame.seq
            return
        if not self.registered:
            if self.block_size is None:
                first = next((e for e in batch.events if isinstance(e, EngineStored)), None)
                if first is None:
                    # Nothing indexed for this worker yet: removals and clears change nothing.
                    self.dropped_before_block_size += 1
                    self.last_seq = frame.seq
                    return
                self.block_size = first.block_size
            await self._register()
        if self.translator is None:
            assert self.block_size is not None
            self.translator = Translator(self.s.worker_id, self.block_size, self.next_event_id)
        self.ranks_seen.add(batch.dp_rank)
        events: list[Event] = []
        if self.pending_clear:
            events.extend(self.translator.clear(self.ranks_seen, batch.ts))
        events.extend(self.translator.translate(batch))
        self.last_seq = frame.seq
        self.next_event_id = self.translator.next_event_id
        if not events:
            return
        self.pending_clear = False
        if not self.out_events:
            self.out_first = frame.seq
        self.out_events.extend(events)
        self.out_blocks += sum(block_count(e) for e in events)
        if (len(self.out_events) >= MAX_EVENTS_PER_MESSAGE
                or self.out_blocks >= MAX_BLOCKS_PER_MESSAGE):
            await self._flush_out()

    async def _replay_contiguous(self, start: int, upto: int | None
                                 ) -> tuple[list[Frame], bool, bool]:
        """The engine's batches ``start ..`` (before ``upto``; None: all it buffers) from the
        replay socket, in order and without a hole, as far as they can be had; whether the last
        answer stopped at a hole, and whether the last one failed (went silent before its end).

        An answer that made progress and then has a hole, goes silent before its end marker, or
        ends before ``upto`` is most likely the engine's ROUTER socket dropping what overflowed
        its send queue while this process read slowly (ZMQ drops silently at the high-water
        mark, the end marker too), not batches gone from its buffer: it is asked again from the
        first one missing. An answer that brings nothing new settles it. (A resumed bridge that
        threw away a silent answer's batches, or took a short answer for the whole run, had no
        mirror: its re-announce was a clear only.)"""
        got: list[Frame] = []
        hole = failed = False
        for _ in range(REPLAY_ROUNDS):
            asked = len(got)
            try:
                frames = await replay(self.ctx, self.s.kv_replay, start + asked,
                                      self.s.replay_timeout)
                failed = False
            except ReplayUnavailable as exc:
                log.warning("replay from seq %d unavailable: %s", start + asked, exc)
                frames, failed = exc.received, True
            hole = False
            for frame in frames:
                expected = start + len(got)
                if frame.seq < expected:
                    continue
                if upto is not None and frame.seq >= upto:
                    break
                if frame.seq != expected:
                    hole = True
                    break
                got.append(frame)
            short = upto is not None and start + len(got) < upto
            if not (hole or failed or short) or len(got) == asked:
                break
            self.replay_retries += 1
        return got, hole, failed

    async def _fill_gap(self, start: int, upto: int | None) -> None:
        """Append batches ``start .. upto-1`` (``upto`` None: all the engine buffers) from the
        replay socket; if some are gone, the next message starts with a clear."""
        if upto is not None and upto <= start:
            return
        frames, hole, replay_failed = await self._replay_contiguous(start, upto)
        for frame in frames:
            await self._handle(frame)
            self.replayed += 1
        expected = start + len(frames)
        # An empty answer to "everything from `start`" is normal (the engine was idle); a failed
        # one after a resume is not knowable, so it counts as lost.
        if hole or (upto is not None and expected < upto) or (
                upto is None and replay_failed and start > 0):
            self._unreplayable(start, expected)

    def _unreplayable(self, start: int, seen_up_to: int) -> None:
        if self.mirror_valid and not any(self.mirror.ranks.values()):
            return  # nothing indexed for this worker: missed history only makes the index smaller
        self.unreplayable_gaps += 1
        self.pending_clear = True
        log.warning("engine batches from seq %d are gone (replayed up to %d): clearing %s's "
                    "blocks", start, seen_up_to, self.s.worker_id)

    async def _flush_clear(self) -> None:
        """Append what the outbox holds, and a pending clear now (at start-up the next batch may
        be far away)."""
        await self._flush_out()
        if not self.pending_clear or not self.registered or self.translator is None:
            return
        events = self.translator.clear(self.ranks_seen, self.clock())
        self.next_event_id = self.translator.next_event_id
        await self._append(events, f"{self.s.worker_id}.{self.gen}.{self.last_seq}.clear")
        self.pending_clear = False
        self.mirror.apply(events)

    async def _on_live(self, frame: Frame) -> None:
        if frame.seq <= self.live_high:
            await self._engine_restarted(f"seq went back from {self.live_high} to {frame.seq}")
        self.live_high = frame.seq
        if frame.seq <= self.last_seq:
            return  # already appended from a replay
        if frame.seq > self.last_seq + 1:
            await self._fill_gap(self.last_seq + 1, frame.seq)
        await self._handle(frame)

    async def _engine_restarted(self, why: str) -> None:
        """A new engine run: its cache is empty and its seqs start again at 0."""
        await self._flush_out()  # what the old run sent belongs under the old gen
        self.engine_restarts += 1
        log.warning("engine %s restarted (%s): clearing its blocks", self.s.worker_id, why)
        try:
            self.engine_start = (await self.engine.metrics()).start_time
        except EngineUnavailable:
            self.engine_start = None  # not known yet: the monitor adopts the next one it reads
        self.cleared_for_start = self.engine_start
        self.gen = new_gen()
        self.last_seq = -1
        self.live_high = -1
        if self.registered and not self.retired:
            assert self.translator is not None
            events = self.translator.clear(self.ranks_seen, self.clock())
            self.next_event_id = self.translator.next_event_id
            await self._append(events, f"{self.s.worker_id}.{self.gen}.restart")
            self.mirror.apply(events)
            self.mirror.reset()
            self.mirror_valid = True
            self.pending_clear = False
            # The new run from its first batch: a restart seen by its start time alone came
            # after batches of the new run that were taken for replayed ones of the old run
            # (seqs at or below what the bridge appended from a replay, with no live seq to go
            # back from: the old run learnt by replay alone). Those are in the engine's buffer.
            await self._fill_gap(0, None)
            await self._flush_clear()

    async def _reannounce(self) -> None:
        if not self.registered or self.retired or self.translator is None:
            return
        self.reannounces += 1
        ts = self.clock()
        if self.mirror_valid:
            events = self.mirror.announce(self.translator, ts, self.ranks_seen)
        else:  # this process did not see the whole history: a clear is the truth we can tell
            events = self.translator.clear(self.ranks_seen, ts)
            self.mirror.reset()
            self.mirror_valid = True
        self.next_event_id = self.translator.next_event_id
        tag = uuid.uuid4().hex[:8]
        await self._append(events, f"{self.s.worker_id}.{self.gen}.{self.last_seq}.re-{tag}")
        log.info("re-announced %s: %d events", self.s.worker_id, len(events))

    async def _retire(self, reason: str) -> None:
        if not self.registered or self.retired:
            return
        event = WorkerRetired(self.s.worker_id, reason, self.clock())
        await self._append([event], f"{self.s.worker_id}.{self.gen}.retired")
        self.retired = True
        log.warning("retired %s: %s", self.s.worker_id, reason)

    # --- control items, handled between batches by the one appending task -----------------

    async def _on_reannounce(self, msg: Msg) -> None:
        self.control.put_nowait("reannounce")
        if msg.reply:
            with contextlib.suppress(Exception):
                await msg.respond(b"ok")

    async def control_item(self, item: str) -> None:
        await self._flush_out()
        if item == "reannounce":
            await self._reannounce()
        elif item == "unhealthy":
            await self._retire("engine unhealthy")
        elif item == "recovered" and self.retired:
            # The engine may be a new run, or the old one with its cache: start over from seq 0.
            self.gen = new_gen()
            self.last_seq = self.live_high = -1
            self.registered = False
            self.pending_clear = False
            with contextlib.suppress(EngineUnavailable):
                self.metrics = await self.engine.metrics()
                self.engine_start = self.metrics.start_time
            if self.block_size is not None:
                await self._register()
                await self._fill_gap(0, None)
                await self._flush_clear()
        elif (item == "engine_restarted" and not self.retired
              and self.engine_start != self.cleared_for_start):
            await self._engine_restarted("engine process start time changed")

    async def _events_loop(self) -> None:
        recv: asyncio.Task[Frame] | None = None
        ctl: asyncio.Task[str] | None = None
        try:
            while True:
                recv = recv or asyncio.create_task(self.live.receive())
                ctl = ctl or asyncio.create_task(self.control.get())
                done, _ = await asyncio.wait({recv, ctl}, return_when=asyncio.FIRST_COMPLETED)
                if ctl in done:
                    item, ctl = ctl.result(), None
                    await self.control_item(item)
                if recv in done:
                    frame, recv = recv.result(), None
                    self.last_progress = time.monotonic()
                    await self._on_live(frame)
                    # A backlog goes out in few messages: take what is already queued, then send.
                    while len(self.out_events) < MAX_EVENTS_PER_MESSAGE and self.live.ready():
                        await self._on_live(await self.live.receive())
                    await self._flush_out()
        finally:
            for task in (recv, ctl):
                if task is not None:
                    task.cancel()

    # --- lifecycle ---------------------------------------------------------------------------

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        starting = asyncio.create_task(self.start(), name="bridge-start")
        stopping = asyncio.create_task(self._stop.wait())
        await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():  # SIGTERM while the engine or NATS was not ready yet
            starting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await starting
            stopping.cancel()
            await self.close()
            return
        stopping.cancel()
        starting.result()  # raises BridgeConfigInvalid
        monitor = EngineMonitor(self)
        tasks = [asyncio.create_task(self._events_loop(), name="bridge-events"),
                 asyncio.create_task(monitor.health_loop(), name="bridge-health"),
                 asyncio.create_task(monitor.load_loop(), name="bridge-load")]
        stopper = asyncio.create_task(self._stop.wait())
        try:
            done, _ = await asyncio.wait({*tasks, stopper}, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task is not stopper and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
        finally:
            for task in (*tasks, stopper):
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        await self._retire("shutdown")
        await self.close()

    async def close(self) -> None:
        log.info("bridge %s: %d messages appended, %d batches replayed (%d replays asked again "
                 "after a dropped answer), %d unreplayable gaps, %d engine restarts, %d bad "
                 "payloads, skipped %s", self.s.worker_id, self.appended, self.replayed,
                 self.replay_retries, self.unreplayable_gaps, self.engine_restarts,
                 self.bad_payloads, self.translator.skipped if self.translator else {})
        with contextlib.suppress(Exception):
            self.live.close()
        self.ctx.destroy(linger=0)
        await self.engine.close()
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await self.nc.drain()
