"""Sticky sessions on the routing path: which engine a session's turn goes to, and the events
that record it (the pins themselves are replicated state: replicas/core/sessions.py).

A turn of a pinned session goes to its engine when that engine is still usable (registered for
the model, not unhealthy, not excluded after a failure); otherwise it is routed by KV cost like
any request and the session is re-pinned to the new engine (``reason="repin"``), so a retired or
unhealthy engine releases its sessions and the client still gets an answer.

``StickyOverlay`` is to pins what the load overlay (replicas/core/overlay.py) is to load: a pin
this replica routed and appended, seen by its own next turn before it comes back from the stream.

Pure: no clock (times arrive as arguments), no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from eventlog import events as ev
from replicas.core.load import WorkerKey
from replicas.core.state import RouterState

ACTIONS = ("open", "bind", "close")
DEFAULT_SESSION_TTL = 300.0


@dataclass(frozen=True, slots=True)
class SessionRequest:
    session_id: str
    action: str = "bind"  # "open" | "bind" (a non-final turn) | "close" (the last turn)
    ttl: float = DEFAULT_SESSION_TTL  # seconds of event time without a turn before it lapses

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"unknown session action {self.action!r}; expected one of {ACTIONS}")
        if not self.ttl > 0:
            raise ValueError("session ttl must be > 0")


class StickyOverlay:
    """Pins routed here whose message has not been applied yet: request_id -> (session, worker)."""

    def __init__(self) -> None:
        self._by_request: dict[str, tuple[str, WorkerKey, bool]] = {}
        self._by_session: dict[str, WorkerKey | None] = {}

    def routed(self, request_id: str, session: SessionRequest, worker: WorkerKey) -> None:
        # A request id decided again (a retry under the same id) counts once: its earlier
        # decision must not keep the session it named known here for ever.
        self.settled(request_id)
        closing = session.action == "close"
        self._by_request[request_id] = (session.session_id, worker, closing)
        self._by_session[session.session_id] = None if closing else worker

    def settled(self, request_id: str) -> None:
        """The decision came back from the stream (or was refused): the state knows now."""
        entry = self._by_request.pop(request_id, None)
        if entry is None:
            return
        session_id = entry[0]
        if not any(s == session_id for s, _, _ in self._by_request.values()):
            self._by_session.pop(session_id, None)

    def lookup(self, session_id: str) -> tuple[bool, WorkerKey | None]:
        """(known here, worker or None when the pending turn closes the session)."""
        if session_id in self._by_session:
            return True, self._by_session[session_id]
        return False, None

    def clear(self) -> None:
        self._by_request.clear()
        self._by_session.clear()


def sticky_target(state: RouterState, overlay: StickyOverlay, session_id: str, model: str,
                  exclude: frozenset[str], health_weight: Mapping[str, float]
                  ) -> tuple[WorkerKey | None, str]:
    """(engine the turn must go to or None to route by cost, why): "pinned", "open", "repin"."""
    known, worker = overlay.lookup(session_id)
    if not known:
        pin = state.sessions.get(session_id)
        worker = pin.worker if pin is not None else None
    if worker is None:
        return None, "open"
    info = state.workers.get(worker[0])
    usable = (info is not None and (info.model == model or model in info.loras)
              and worker[1] < info.dp_size and worker[0] not in exclude
              and health_weight.get(state.health.get(worker[0], "healthy"), 0.0) > 0.0)
    return (worker, "pinned") if usable else (None, "repin")


def session_events(session: SessionRequest, request_id: str, worker: WorkerKey, model: str,
                   sticky: str | None, ts: float) -> list[ev.Event]:
    """What goes into the decision's message: the pin (refreshing its TTL), or its release on
    the session's last turn."""
    if session.action == "close":
        return [ev.SessionReleased(session.session_id, "closed", ts)]
    reason = "repin" if sticky == "repin" else ("open" if sticky == "open" else "bind")
    return [ev.SessionPinned(session.session_id, worker[0], worker[1], model, session.ttl, ts,
                             request_id, reason)]
