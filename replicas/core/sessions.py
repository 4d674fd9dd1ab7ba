"""Sticky sessions: which engine each open session is pinned to
(docs/decisions/0041-sticky-sessions-replicated-pins.md).

A pin is replicated state like the load: it is set by a ``SessionPinned`` event on the router
stream (in the same message as the decision that chose the engine) and removed by a
``SessionReleased`` event or by its time-to-live running out. The TTL is a sliding window in
EVENT time: every pin of the same session moves ``last_ts`` forward, and the pin lapses once the
state's event time passes ``last_ts + ttl``. No clock is read here, so every replica that applied
the same events holds the same pins.

Whether a pinned engine may still be used (registered, not unhealthy) is not decided here: the
engine's lifecycle lives on other streams, and letting a KV-stream event delete a router-stream
pin would make the result depend on how a replica interleaves the streams. The router asks
:meth:`SessionTable.get` and judges the engine itself; an unusable engine is re-pinned by the
next request's ``SessionPinned`` (replicas/core/sticky.py).

Pure: no I/O, no clock, no randomness.
"""

from __future__ import annotations

import heapq
import struct
from collections.abc import Iterator
from dataclasses import dataclass

import xxhash

from replicas.core.load import WorkerKey

_MASK64 = (1 << 64) - 1


@dataclass(slots=True)
class Pin:
    session_id: str
    worker: WorkerKey
    model: str
    ttl: float          # seconds of event time without a request before the pin lapses
    opened_ts: float    # event time of the first pin of this session (for the admin view)
    last_ts: float      # event time of the latest pin: the sliding window starts here
    requests: int = 1   # pins applied (one per routed turn)

    @property
    def expires_at(self) -> float:
        return self.last_ts + self.ttl

    def view(self, now: float) -> dict[str, object]:
        return {"session_id": self.session_id, "worker_id": self.worker[0],
                "dp_rank": self.worker[1], "model": self.model, "ttl_s": self.ttl,
                "opened_ts": self.opened_ts, "last_ts": self.last_ts,
                "expires_in_s": round(max(self.expires_at - now, 0.0), 3),
                "requests": self.requests}


def _mix(pin: Pin) -> int:
    """Stable hash of what every replica must agree on (not ``requests``/``opened_ts``: a pin
    that lapsed and was re-made on one replica and refreshed on another counts differently)."""
    h = xxhash.xxh3_64(seed=11)
    for text in (pin.session_id, pin.worker[0], pin.model):
        raw = text.encode()
        h.update(struct.pack("<I", len(raw)))
        h.update(raw)
    h.update(struct.pack("<qdd", pin.worker[1], pin.ttl, pin.last_ts))
    return h.intdigest()


class SessionTable:
    """session_id -> Pin, with expiry in event time."""

    def __init__(self) -> None:
        self._pins: dict[str, Pin] = {}
        # (expires_at, session_id); stale entries (a pin refreshed or released since) are
        # skipped when popped, so a refresh is O(log n) without searching the heap.
        self._expiry: list[tuple[float, str]] = []
        self._digest = 0

    def __len__(self) -> int:
        return len(self._pins)

    def __iter__(self) -> Iterator[Pin]:
        return iter(self._pins.values())

    def get(self, session_id: str) -> Pin | None:
        return self._pins.get(session_id)

    @property
    def digest(self) -> int:
        return self._digest

    def pin(self, session_id: str, worker: WorkerKey, model: str, ttl: float, ts: float) -> str:
        """Pin (or re-pin, or refresh) a session; returns the apply status."""
        old = self._pins.get(session_id)
        if old is None:
            pin = Pin(session_id, worker, model, ttl, ts, ts)
            status = "ok"
        else:
            self._digest = (self._digest - _mix(old)) & _MASK64
            status = "refreshed" if old.worker == worker else "moved"
            # max(): an event stamped by a replica whose clock is behind must not shorten the
            # window another replica's later pin opened.
            pin = Pin(session_id, worker, model, ttl, old.opened_ts, max(old.last_ts, ts),
                      old.requests + 1)
        self._pins[session_id] = pin
        self._digest = (self._digest + _mix(pin)) & _MASK64
        heapq.heappush(self._expiry, (pin.expires_at, session_id))
        return status

    def release(self, session_id: str) -> bool:
        pin = self._pins.pop(session_id, None)
        if pin is None:
            return False
        self._digest = (self._digest - _mix(pin)) & _MASK64
        return True

    def expire(self, now: float) -> list[str]:
        """Drop the pins whose window ended before event time ``now``; returns their ids."""
        gone: list[str] = []
        heap = self._expiry
        while heap and heap[0][0] < now:
            expires_at, session_id = heapq.heappop(heap)
            pin = self._pins.get(session_id)
            if pin is not None and pin.expires_at == expires_at and self.release(session_id):
                gone.append(session_id)
        return gone

    def clear(self) -> None:
        self._pins.clear()
        self._expiry.clear()
        self._digest = 0

    # --- snapshots ---------------------------------------------------------------------------

    def to_plain(self) -> list[list[object]]:
        return [[p.session_id, p.worker[0], p.worker[1], p.model, p.ttl, p.opened_ts, p.last_ts,
                 p.requests] for p in self._pins.values()]

    @classmethod
    def from_plain(cls, rows: list[list[object]]) -> SessionTable:
        table = cls()
        for sid, wid, rank, model, ttl, opened, last, requests in rows:
            pin = Pin(str(sid), (str(wid), int(rank)), str(model), float(ttl),  # type: ignore[arg-type]
                      float(opened), float(last), int(requests))  # type: ignore[arg-type]
            table._pins[pin.session_id] = pin
            table._digest = (table._digest + _mix(pin)) & _MASK64
            table._expiry.append((pin.expires_at, pin.session_id))
        heapq.heapify(table._expiry)
        return table
