"""Group commit: many events appended to one subject as few JetStream messages.

A replica writes three router-stream events per request (routed, prefill completed, finished),
and every other replica applies each of them; one message per event made the per-message costs
(a publish and its ack here, a delivery, an ack and a state apply on every peer) the largest part
of replication. ``GroupCommit`` keeps at most one publish in flight per subject: events that
arrive while it is in flight wait and go out together as the next message, so at low load an
event is published at once (no added latency) and under load a message carries every event of
one publish round trip.

* **Exactly once, per message.** A message's id is ``<id_prefix>.<n>`` (``n`` counts this
  writer's messages; the prefix names one writer incarnation), and a retried publish of the same
  message reuses it, so the stream's duplicate window applies it once
  (docs/decisions/0003-apply-whole-messages.md).
* **Order.** Messages go out one after the other on one subject, so events keep the order in
  which they were appended, also across a failed message.
* **Lazy events** (``urgent=False``: a prefill completion, a request's end) do not start a
  publish by themselves: they ride with the next one, or go out after ``linger`` seconds. A
  ``PrefillCompleted`` still waiting when its request's ``RequestFinished`` arrives is folded
  into it (``prefill_ts``): one event instead of two, with the same effect on every replica's
  state (a finish frees the prefill tokens of a request whose prefill never completed).
* **Size.** A message holds at most ``max_events`` events and about ``max_bytes`` bytes.
* **Holding through an outage.** While ``hold()`` says so (the writer knows the log is down:
  its replica is in degraded mode), a message whose append failed for a passing reason is sent
  again under the same id instead of failing its events. Dropping it would lose for good the
  ``RequestFinished`` of requests whose ``RequestRouted`` did land, and every replica would
  charge their load until it aged out; held, the message lands once NATS is back, in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from eventlog import events as ev
from eventlog.appender import Appender, AppendFailed, is_transient
from eventlog.wire import event_format, headers_for

log = logging.getLogger(__name__)

_raw_encoder = msgspec.msgpack.Encoder()


@dataclass(slots=True)
class _Queued:
    event: ev.Event | None  # None: folded into a later event
    future: asyncio.Future[int]


class GroupCommit:
    """Appends events to one subject, batching those that arrive while a publish is in flight."""

    def __init__(self, appender: Appender, subject: str, id_prefix: str, *,
                 max_events: int = 256, max_bytes: int = 256 * 1024,
                 linger: float = 0.002, hold: Callable[[], bool] | None = None) -> None:
        if max_events < 1 or max_bytes < 1:
            raise ValueError("max_events and max_bytes must be positive")
        self._appender = appender
        self.subject = subject
        self._prefix = id_prefix
        self.max_events = max_events
        self.max_bytes = max_bytes
        self.linger = linger
        self.hold = hold
        self.held = 0  # times a failed message was kept and sent again (see "Holding")
        self._queue: list[_Queued] = []
        self._prefill: dict[str, _Queued] = {}  # request id -> its queued PrefillCompleted
        self._urgent = False
        self._task: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._sent = 0
        self.messages = 0  # messages appended (acked)
        self.last_seq = 0  # the stream sequence of the last of them
        self.events = 0  # events in them
        self.folded = 0  # PrefillCompleted events folded into their RequestFinished

    async def append(self, event: ev.Event, *, urgent: bool = True) -> int:
        """Queue ``event``; return the stream sequence of the message that carried it. Raises
        what the message's append raised (``AppendFailed``) for every event it carried."""
        return await self.submit(event, urgent=urgent)

    def submit(self, event: ev.Event, *, urgent: bool = True) -> asyncio.Future[int]:
        """Queue ``event`` without waiting: the future resolves as ``append`` would return."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[int] = loop.create_future()
        if isinstance(event, ev.RequestFinished) and event.prefill_ts is None:
            waiting = self._prefill.pop(event.request_id, None)
            if waiting is not None and isinstance(waiting.event, ev.PrefillCompleted):
                event = msgspec.structs.replace(event, prefill_ts=waiting.event.ts)
                waiting.event = None
                self.folded += 1
                # The folded event is carried by the finish's message: same outcome.
                fut.add_done_callback(lambda f, w=waiting: _mirror(f, w.future))
        item = _Queued(event, fut)
        self._queue.append(item)
        if isinstance(event, ev.PrefillCompleted):
            self._prefill[event.request_id] = item
        if urgent:
            self._urgent = True
        self._kick(loop)
        return fut

    def _kick(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._task is not None and not self._task.done():
            return  # the running drain takes everything queued once its publish is back
        if self._urgent:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._task = loop.create_task(self._drain())
        elif self._timer is None:
            self._timer = loop.call_later(self.linger, self._linger_expired)

    def _linger_expired(self) -> None:
        self._timer = None
        if self._queue and (self._task is None or self._task.done()):
            self._task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        while self._queue:
            self._urgent = False
            taken, payload, fmt = self._take()
            if not taken:
                continue
            self._sent += 1
            msg_id = f"{self._prefix}.{self._sent}"
            try:
                # _take judged every event's format already: no second pass over them.
                seq = await self._append_held(payload, msg_id, headers_for(fmt))
            except asyncio.CancelledError:
                for item in taken:
                    _settle(item.future, exc=asyncio.CancelledError())
                raise
            except Exception as exc:  # AppendFailed, or a closed connection
                for item in taken:
                    _settle(item.future, exc=exc)
                continue
            self.messages += 1
            self.last_seq = max(self.last_seq, seq)
            self.events += sum(1 for item in taken if item.event is not None)
            for item in taken:
                _settle(item.future, seq=seq)
            if self._queue and not self._urgent:
                break  # only lazy events left: they wait for the next publish or the linger
        if self._queue and self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.linger,
                                                               self._linger_expired)

    async def _append_held(self, payload: bytes, msg_id: str,
                           headers: dict[str, str] | None) -> int:
        """One message's append; while ``hold()`` is true a passing failure is retried under
        the same msg id (applied once), with a backoff capped at 2 s."""
        delay = 0.25
        while True:
            try:
                return await self._appender.append_raw(self.subject, payload, msg_id, headers)
            except AppendFailed as exc:
                if self.hold is None or not self.hold() or not is_transient(exc.cause):
                    raise
            self.held += 1
            await asyncio.sleep(delay)  # backoff between two tries of one message
            delay = min(delay * 2, 2.0)

    def _take(self) -> tuple[list[_Queued], bytes, int]:
        """The next message: queued items from the front, within the size limits."""
        parts: list[msgspec.Raw] = []
        taken: list[_Queued] = []
        size = 0
        queue = self._queue
        n = 0
        first_format = 0
        for n, item in enumerate(queue, start=1):
            event = item.event
            if event is None:
                taken.append(item)  # folded: settled with the message that carries its finish
                continue
            raw = _raw_encoder.encode(event)
            # A message holds events of one format only: a release that cannot read a newer
            # event type then loses (or stops at) that message alone, never the format-1
            # decisions and finishes that would otherwise share it (eventlog.wire).
            fmt = event_format(event)
            if parts and (len(parts) >= self.max_events or size + len(raw) > self.max_bytes
                          or fmt != first_format):
                n -= 1
                break
            first_format = fmt
            parts.append(msgspec.Raw(raw))
            taken.append(item)
            size += len(raw)
            if isinstance(event, ev.PrefillCompleted):
                self._prefill.pop(event.request_id, None)
        del queue[:n]
        taken = [item for item in taken if item.event is not None]
        return taken, _raw_encoder.encode(parts) if parts else b"", first_format or 1

    async def flush(self, timeout: float = 5.0) -> None:
        """Send everything queued (lazy events too) and wait for it; used before shutting down."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._queue:
            self._urgent = True
            self._kick(asyncio.get_running_loop())
        task = self._task
        if task is not None and not task.done():
            with contextlib.suppress(Exception, asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(task), timeout)

    def close(self) -> None:
        """Stop: cancel the pending timer and publish; queued events fail as cancelled."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._task is not None and not self._task.done():
            self._task.cancel()
        for item in self._queue:
            _settle(item.future, exc=asyncio.CancelledError())
        self._queue.clear()
        self._prefill.clear()


def _settle(fut: asyncio.Future[int], *, seq: int | None = None,
            exc: BaseException | None = None) -> None:
    if fut.done():
        return  # its caller stopped waiting (a timeout): the outcome has no one to tell
    if exc is not None:
        fut.set_exception(exc)
        fut.exception()  # retrieved: a fire-and-forget event's failure is logged by its caller
    else:
        fut.set_result(seq)  # type: ignore[arg-type]


def _mirror(source: asyncio.Future[int], target: asyncio.Future[int]) -> None:
    if source.cancelled():
        _settle(target, exc=asyncio.CancelledError())
    elif source.exception() is not None:
        _settle(target, exc=source.exception())
    else:
        _settle(target, seq=source.result())
