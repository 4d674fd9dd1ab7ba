"""Stored responses (OpenAI Responses API): which engine holds each response a client may continue.

An engine answering ``/v1/responses`` with ``store`` true keeps the response in its own memory; a
follow-up naming it as ``previous_response_id`` is answered only by that engine (any other one
does not know the id). So the response-id -> engine mapping is a fact on the router stream, like
a session pin: a ``ResponseStored`` event, applied here by every replica alike, kept in
snapshots, and dropped once its time-to-live in EVENT time has passed. The expiry rules are the
session pins' own (the same table, :class:`replicas.core.sessions.SessionTable`): a response stored
again under the same id slides its window, an older timestamp never shortens it.

Whether the storing engine can still answer is judged at lookup time against the engine's
lifecycle (:func:`response_target`), never by deleting the mapping from another stream's event:
that would make the state depend on how a replica interleaves the streams.

Pure: no I/O, no clock, no randomness.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from enum import StrEnum

from eventlog import events as ev
from replicas.core.load import WorkerKey
from replicas.core.sessions import Pin, SessionTable


class Lookup(StrEnum):
    """What became of a ``previous_response_id``."""

    FOUND = "found"              # its engine is registered for the model: route there
    UNKNOWN = "unknown"          # never stored (or expired): the client gets a 404
    ENGINE_GONE = "engine_gone"  # its engine was retired or lost: the response is gone with it
    UNAVAILABLE = "unavailable"  # its engine is marked unhealthy: retry later


class StoredResponses:
    """response_id -> the engine that stored it, with expiry in event time."""

    def __init__(self, table: SessionTable | None = None) -> None:
        self._table = table if table is not None else SessionTable()

    def __len__(self) -> int:
        return len(self._table)

    def __iter__(self) -> Iterator[Pin]:
        return iter(self._table)

    @property
    def digest(self) -> int:
        return self._table.digest

    def get(self, response_id: str) -> Pin | None:
        return self._table.get(response_id)

    def store(self, e: ev.ResponseStored) -> str:
        """Apply one ``ResponseStored``; the apply status ("ok", "refreshed", "moved")."""
        return self._table.pin(e.response_id, (e.worker_id, e.dp_rank), e.model, e.ttl, e.ts)

    def expire(self, now: float) -> list[str]:
        return self._table.expire(now)

    def clear(self) -> None:
        self._table.clear()

    def to_plain(self) -> list[list[object]]:
        return self._table.to_plain()

    @classmethod
    def from_plain(cls, rows: list[list[object]]) -> StoredResponses:
        return cls(SessionTable.from_plain(rows))


def response_target(responses: StoredResponses, workers: Mapping[str, object],
                    health: Mapping[str, str], health_weight: Mapping[str, float],
                    response_id: str) -> tuple[WorkerKey | None, Lookup]:
    """The engine a follow-up of ``response_id`` must go to, and how the lookup went.

    ``workers``: the registered engines (worker_id -> anything with ``dp_size``); ``health``:
    their status; ``health_weight``: the routing weight of each status (0 or absent: unusable)."""
    pin = responses.get(response_id)
    if pin is None:
        return None, Lookup.UNKNOWN
    worker_id, rank = pin.worker
    info = workers.get(worker_id)
    if info is None or rank >= int(getattr(info, "dp_size", 1)):
        return pin.worker, Lookup.ENGINE_GONE
    if health_weight.get(health.get(worker_id, "healthy"), 0.0) <= 0.0:
        return pin.worker, Lookup.UNAVAILABLE
    return pin.worker, Lookup.FOUND
