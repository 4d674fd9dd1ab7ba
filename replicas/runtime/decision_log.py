"""Recording routing decisions: each request's wait for its `RequestRouted`, off its critical path.

A decision is appended to the router stream as soon as it is made, and the request is forwarded
to its engine at once: the engine computes while JetStream acknowledges. The request waits for
its decision (:meth:`DecisionLog.wait`) only before anything reaches the client, so the append's
round trip overlaps the engine's first token instead of preceding it. Three outcomes:

* **recorded** — acknowledged (the usual case, long before the engine's first token);
* **refused** — JetStream said no (a limit: stream or account full, message too large), or, in
  strict mode (``grace`` 0), no acknowledgement within ``timeout``: the request is answered 503
  with nothing shown to the client, its engine request is cancelled, and its owner ends it as
  ``not_routed`` (docs/decisions/0023-refuse-unrecorded-decisions.md);
* **served unrecorded** — neither within ``grace`` (a stream leader election after a NATS node
  died): the request is served anyway while the same message keeps being retried under its
  msg id, so it lands once, late, in stream order (serving through an election:
  docs/decisions/0051-decision-append-beside-engine.md). A spell of this longer than
  ``timeout`` (JetStream gone for longer than an election: no quorum, or every NATS server
  down) puts the replica in degraded mode (``replicas.runtime.log_outage``,
  docs/decisions/0061-degraded-mode-when-nats-is-gone.md): requests are still served, and new
  decisions are no longer appended at all, so nothing piles up behind an append that cannot
  succeed. Only strict mode
  (``grace`` 0) refuses a decision for being late.

No I/O here: the append's future comes from the replica's port; the clock is read only to time
the waits and spells.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from replicas.core.routing_errors import RoutingError
from replicas.runtime.log_outage import LogOutage, LogUnavailable

log = logging.getLogger("jetrouter.replica")


class DecisionNotRecorded(RoutingError):
    """JetStream refused the routing decision's append or did not ack it in time: the request
    is not served (docs/decisions/0023-refuse-unrecorded-decisions.md)."""

    def __init__(self, request_id: str, cause: BaseException) -> None:
        super().__init__(f"the routing decision could not be recorded ({describe(cause)})")
        self.request_id = request_id
        self.cause = cause


def describe(exc: BaseException) -> str:
    cause = getattr(exc, "cause", None) or exc  # AppendFailed carries the server's answer
    if isinstance(cause, TimeoutError):
        return "no acknowledgement from JetStream in time"
    text = str(cause).strip() or type(cause).__name__
    return f"{type(cause).__name__}: {text}"[:300]


@dataclass(slots=True)
class DecisionLogHealth:
    """What /ready, metrics and logs say about recording routing decisions on this replica."""

    failures: int = 0          # decisions refused or timed out since start
    last_error: str | None = None
    last_failure_at: float | None = None  # time.monotonic()
    failing_since: float | None = None    # wall time of the first failure of the current run
    recent_window: float = 5.0  # seconds a failure keeps /ready at 503 without a success
    # Served before JetStream acknowledged their decision (past the grace), since start.
    served_unrecorded: int = 0
    recorded_late: int = 0     # ...of which the decision landed afterwards
    lost: int = 0              # ...of which the append failed for good (never recorded)
    unrecorded_since: float | None = None  # monotonic start of the current spell, if any
    spell_served: int = 0      # served unrecorded in the current spell

    def failing(self, now: float) -> bool:
        return self.last_failure_at is not None and now - self.last_failure_at < self.recent_window

    def view(self, now: float) -> dict[str, object]:
        spell = None if self.unrecorded_since is None else round(now - self.unrecorded_since, 3)
        return {"ok": not self.failing(now), "failures": self.failures,
                "last_error": self.last_error, "failing_since": self.failing_since,
                "served_unrecorded": self.served_unrecorded,
                "recorded_late": self.recorded_late, "lost": self.lost,
                "unrecorded_for_s": spell}


class RecordState(StrEnum):
    PENDING = "pending"
    RECORDED = "recorded"
    SERVED_UNRECORDED = "served_unrecorded"  # past the grace: served, the append still retrying
    REFUSED = "refused"


class DecisionRecord:
    """One decision's append as its request sees it (``Routed.record``)."""

    __slots__ = ("cause", "future", "landed", "request_id", "started", "state")

    def __init__(self, request_id: str, future: asyncio.Future[int], started: float) -> None:
        self.request_id = request_id
        self.future = future
        self.started = started  # time.monotonic() of the submission
        self.state = RecordState.PENDING
        self.cause: BaseException | None = None
        self.landed = False  # the append's outcome has been taken into account

    @property
    def refused(self) -> bool:
        return self.state is RecordState.REFUSED


class DecisionLog:
    """The recording policy of one replica: ``grace`` and ``timeout`` (seconds), the health view,
    and what a refusal undoes (``settle(request_id)``: drop the decision from the overlay)."""

    def __init__(self, replica_id: str, *, grace: float, timeout: float,
                 settle: Callable[[str], None], outage: LogOutage | None = None) -> None:
        if grace < 0 or timeout <= 0:
            raise ValueError("grace must be >= 0 and timeout > 0")
        self.replica_id = replica_id
        self.grace = grace
        self.timeout = timeout
        self.health = DecisionLogHealth()
        self._settle = settle
        self.outage = outage or LogOutage(replica_id, after_unacknowledged=timeout)
        self.outage.listeners.append(self._outage_changed)
        # (reason) -> None: the HTTP layer's counter of decisions JetStream did not take.
        self.on_refused: Callable[[str], None] | None = None

    def track(self, request_id: str, future: asyncio.Future[int]) -> DecisionRecord:
        """Follow the append of ``request_id``'s decision (already submitted)."""
        record = DecisionRecord(request_id, future, time.monotonic())
        future.add_done_callback(lambda f: self._landed(record, f))
        return record

    async def wait(self, record: DecisionRecord) -> None:
        """Until the decision is recorded, or served unrecorded past the grace; raises
        :class:`DecisionNotRecorded` when it is refused (nothing was sent to the client)."""
        fut = record.future
        if not fut.done() and record.state is RecordState.PENDING:
            # In an unrecorded spell, a later decision cannot be acknowledged before the message
            # being retried (one in flight per subject): waiting out the grace again gains
            # nothing, so it is served at once.
            limit = self.grace if self.grace > 0 else self.timeout
            now = time.monotonic()
            if self._serving_unrecorded(now) or (self.grace > 0 and self.outage.degraded(now)):
                limit = 0.0
            left = record.started + limit - time.monotonic()
            if left > 0:
                # asyncio.wait: the append's future is not cancelled when the wait ends.
                await asyncio.wait((fut,), timeout=left)
        if fut.done() and not record.landed:
            self._landed(record, fut)  # done in this very loop turn: its callback is still due
        if record.state is RecordState.PENDING and not fut.done():
            now = time.monotonic()
            if self.grace > 0:
                # Late is not refused: the request is served and its message keeps being
                # retried. A spell longer than ``timeout`` means the log is unavailable, not
                # electing: degraded mode (new decisions stop being appended).
                self._served_unrecorded(record, now)
                spell = self.health.unrecorded_since
                if spell is not None:
                    self.outage.unacknowledged_for(now - spell)
                return
            self._refuse(record, TimeoutError())
        if record.state is RecordState.REFUSED:
            assert record.cause is not None
            raise DecisionNotRecorded(record.request_id, record.cause)

    def _serving_unrecorded(self, now: float) -> bool:
        """In an unrecorded spell (its length is judged by the outage: past ``timeout`` it is
        degraded mode, and requests are still served)."""
        return self.grace > 0 and self.health.unrecorded_since is not None

    # --- outcomes ---------------------------------------------------------------------------

    def _landed(self, record: DecisionRecord, fut: asyncio.Future[int]) -> None:
        if record.landed:
            return
        record.landed = True
        exc: BaseException | None = (asyncio.CancelledError() if fut.cancelled()
                                     else fut.exception())
        health = self.health
        if exc is None:
            if record.state is RecordState.SERVED_UNRECORDED:
                health.recorded_late += 1
            if record.state is not RecordState.REFUSED:
                record.state = RecordState.RECORDED
            self._recorded()
        elif record.state is RecordState.PENDING:
            self._refuse(record, exc)
        elif record.state is RecordState.SERVED_UNRECORDED:
            health.lost += 1
            if self.outage.degraded_since is not None:
                return  # counted; the outage's own log lines say what happened, once
            log.error("replica %s: the routing decision of %s, already served, was never "
                      "recorded (%s)", self.replica_id, record.request_id, describe(exc))

    def _recorded(self) -> None:
        """A decision was acknowledged: every earlier one on the subject was settled before it
        (one message in flight at a time), so a failure run or an unrecorded spell ends."""
        health = self.health
        if health.last_failure_at is not None:
            log.warning("replica %s records routing decisions again (after %d refused)",
                        self.replica_id, health.failures)
            health.last_failure_at = None
            health.failing_since = None
        if health.unrecorded_since is not None:
            log.warning("replica %s: routing decisions acknowledged again after %.1f s; %d "
                        "requests were served before their decision was recorded",
                        self.replica_id, time.monotonic() - health.unrecorded_since,
                        health.spell_served)
            health.unrecorded_since = None
            health.spell_served = 0

    def _outage_changed(self, degraded: bool) -> None:
        """Degraded mode ends: a new unacknowledged spell is timed from the next late decision,
        not from before the outage."""
        if not degraded:
            self.health.unrecorded_since = None
            self.health.spell_served = 0

    def _served_unrecorded(self, record: DecisionRecord, now: float) -> None:
        record.state = RecordState.SERVED_UNRECORDED
        health = self.health
        health.served_unrecorded += 1
        health.spell_served += 1
        if health.unrecorded_since is None:
            health.unrecorded_since = now
            log.warning("replica %s: JetStream has not acknowledged the routing decision of %s "
                        "within %.2f s; serving requests while their decisions are retried "
                        "(degraded mode after %.1f s)", self.replica_id, record.request_id,
                        self.grace, self.timeout)

    def _refuse(self, record: DecisionRecord, exc: BaseException) -> None:
        """Count and log a decision JetStream did not take, and make sure it never counts here.
        Its request's owner ends it as ``not_routed``: that ``RequestFinished`` follows the
        decision on the same subject, so if an append that timed out lands after all, the
        finish closes it on every replica; if it never landed, the finish is a no-op
        (docs/decisions/0022-absurd-events-are-malformed.md)."""
        record.state = RecordState.REFUSED
        record.cause = exc
        self._settle(record.request_id)  # the overlay must not keep what the log refused
        health = self.health
        why = describe(exc)
        timed_out = isinstance(exc, TimeoutError) or isinstance(
            getattr(exc, "cause", None), TimeoutError)
        health.failures += 1
        health.last_error = why
        health.last_failure_at = time.monotonic()
        rid = self.replica_id
        if health.failing_since is None:
            health.failing_since = time.time()
            log.error("replica %s: JetStream did not take the routing decision of %s (%s); "
                      "refusing requests with 503 until it does", rid, record.request_id, why)
        elif not isinstance(getattr(exc, "cause", None), LogUnavailable):
            # (in degraded mode the outage's transition lines say it once, not per request)
            log.warning("replica %s: routing decision of %s not recorded (%s)", rid,
                        record.request_id, why)
        if self.on_refused is not None:
            self.on_refused("timeout" if timed_out else "refused")
