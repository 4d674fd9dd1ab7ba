"""Degraded mode: routing on the state a replica has while the event log cannot take appends.

Inference must not stop because the log is down: the engines are healthy and the replica still
holds a complete state (as of the last event it applied). So when the log is *unavailable* —
every NATS server gone, or JetStream not acknowledging anything for longer than a stream leader
election can last — the replica enters **degraded mode**:

* routing decisions are made as usual, counted in this replica's optimistic overlay (so its
  own routing stays load-aware) and released when their request ends, but **not appended**: an
  append that cannot succeed must not hold up requests, and queueing every decision for later
  would pile up memory and replay, after the outage, load that ended long ago. They are counted
  (``not_appended``); the events that would have followed them (prefill completed, progress,
  finished) are skipped too (``followups_skipped``);
* with ``--decision-record-grace 0`` (strict: never serve a request whose decision is not
  recorded) the operator chose refusals over serving unrecorded, so decisions are refused at
  once instead (503, `/ready` 503), not after waiting on an append that cannot succeed;
* `/ready` stays 200 with ``"degraded": true`` (the replica can serve; see `api/app.py`),
  `/admin/state` shows :meth:`LogOutage.view`, metrics carry the flag and the counts, and one
  log line marks each transition (never one per request).

Entering: the NATS connection has been down for ``after_disconnect`` seconds (a single NATS
node's death costs a reconnect to another node within a second, which must not count), or the
replica has been serving decisions unacknowledged for ``after_unacknowledged`` seconds
(connected, but no quorum: longer than nats-server's 4-9 s election,
docs/decisions/0031-election-is-the-floor.md).
Leaving: connected again and JetStream answering an API call (the replica's watchdog probes
it); appends resume, and if JetStream still cannot acknowledge them for that long, degraded
mode starts again.

Bookkeeping only, no I/O: the runtime reports the connection's state and JetStream's answers
(`replica.py`, `decision_log.py`); the clock is read only to time the spells.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from errors.root import JetrouterError

log = logging.getLogger("jetrouter.replica")

DISCONNECTED = "NATS connection lost"
UNACKNOWLEDGED = "JetStream acknowledged no append"


class LogUnavailable(JetrouterError, ConnectionError):
    """Degraded mode: an append that is not even tried (it cannot succeed now)."""

    def __init__(self) -> None:
        super().__init__("the event log is unavailable (degraded mode)")


class LogOutage:
    """One replica's view of whether its event log can take appends."""

    def __init__(self, replica_id: str, *, after_disconnect: float = 3.0,
                 after_unacknowledged: float = 15.0) -> None:
        if after_disconnect <= 0 or after_unacknowledged <= 0:
            raise ValueError("degraded-mode thresholds must be positive")
        self.replica_id = replica_id
        self.after_disconnect = after_disconnect
        self.after_unacknowledged = after_unacknowledged
        self.degraded_since: float | None = None  # monotonic
        self.degraded_since_wall: float | None = None
        self.reason: str | None = None
        self.disconnected_since: float | None = None  # monotonic; None while connected
        self.outages = 0  # degraded spells since start
        self.last_outage_s: float | None = None
        self.not_appended = 0  # decisions served without being appended (since start)
        self.followups_skipped = 0  # their prefill/progress/finish events, not appended either
        self._spell_not_appended = 0
        # Told on every transition: (degraded) -> None (the decision log restarts its
        # unacknowledged spell, the replica's group commit stops or resumes holding messages).
        self.listeners: list[Callable[[bool], None]] = []

    # --- what the runtime reports -----------------------------------------------------------

    def connection_lost(self, now: float) -> None:
        if self.disconnected_since is None:
            self.disconnected_since = now

    def connection_back(self) -> None:
        self.disconnected_since = None

    @property
    def connected(self) -> bool:
        return self.disconnected_since is None

    def unacknowledged_for(self, seconds: float) -> None:
        """Decisions have been served unacknowledged for ``seconds``; past the bound the log
        counts as unavailable."""
        if seconds >= self.after_unacknowledged:
            self._enter(time.monotonic(), UNACKNOWLEDGED,
                        f"for {seconds:.1f} s while connected (no quorum?)")

    def log_answered(self, now: float) -> None:
        """Connected and JetStream answered: appends may go out again."""
        if self.degraded_since is None or not self.connected:
            return
        spell = now - self.degraded_since
        self.last_outage_s = spell
        log.warning("replica %s: event log available again after %.1f s; leaving degraded mode "
                    "(%d routing decisions were served without being appended, their load "
                    "counted on this replica only)", self.replica_id, spell,
                    self._spell_not_appended)
        self.degraded_since = self.degraded_since_wall = None
        self.reason = None
        self._spell_not_appended = 0
        for listener in self.listeners:
            listener(False)

    # --- what the request path asks ----------------------------------------------------------

    def degraded(self, now: float) -> bool:
        """In degraded mode now (entering it once the connection has been down long enough)."""
        if self.degraded_since is None and self.disconnected_since is not None \
                and now - self.disconnected_since >= self.after_disconnect:
            self._enter(now, DISCONNECTED,
                        f"for {now - self.disconnected_since:.1f} s (every server unreachable)")
        return self.degraded_since is not None

    def skipped_decision(self) -> None:
        self.not_appended += 1
        self._spell_not_appended += 1

    def skipped_followup(self) -> None:
        self.followups_skipped += 1

    def view(self, now: float) -> dict[str, object]:
        degraded = self.degraded(now)
        return {
            "degraded": degraded,
            "reason": self.reason,
            "degraded_for_s": (round(now - self.degraded_since, 3)
                               if self.degraded_since is not None else None),
            "degraded_since": self.degraded_since_wall,
            "connected": self.connected,
            "decisions_not_appended": self.not_appended,
            "followups_not_appended": self.followups_skipped,
            "outages": self.outages,
            "last_outage_s": (round(self.last_outage_s, 3)
                              if self.last_outage_s is not None else None),
        }

    def _enter(self, now: float, reason: str, detail: str) -> None:
        if self.degraded_since is not None:
            return
        self.degraded_since = now
        self.degraded_since_wall = time.time()
        self.reason = reason
        self.outages += 1
        log.error("replica %s: event log unavailable (%s %s); DEGRADED: routing on the state "
                  "applied so far, decisions counted locally and not appended", self.replica_id,
                  reason, detail)
        for listener in self.listeners:
            listener(True)
