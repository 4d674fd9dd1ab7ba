"""The one port the replica's adapters (leader duties, liveness, canaries) see of the replica.

A `typing.Protocol`, so they depend on this small surface and not on `Replica` (no import cycle,
and a test can stand a real `RouterState` and a real appender behind it without a replica).
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from eventlog import events as ev
from eventlog.names import Names
from replicas.core.state import RouterState


class ReplicaPort(Protocol):
    @property
    def replica_id(self) -> str: ...

    @property
    def names(self) -> Names: ...

    @property
    def state(self) -> RouterState:
        """The replicated state as applied so far (replaced when a snapshot is loaded)."""
        ...

    @property
    def ready(self) -> bool:
        """Caught up with the streams and routing."""
        ...

    @property
    def is_leader(self) -> bool:
        """Holds the leader lease (never without durability)."""
        ...

    async def append(self, subject: str, event: ev.Event | list[ev.Event],
                     msg_id: str | None) -> int:
        """Append one event (or several, as one message: they apply together) to a stream
        subject; the stream's sequence number. ``msg_id`` None: a fresh one (no deduplication
        against earlier appends)."""
        ...

    def submit(self, subject: str, events: list[ev.Event],
               msg_id: str) -> asyncio.Future[int]:
        """Queue ``events`` for one append now, in call order with every other event queued on
        ``subject``, and hand back the future of its sequence without waiting (a routing
        decision's append runs while its request goes to the engine)."""
        ...

    async def stream_end(self, kind: str) -> int:
        """The last sequence of stream ``kind`` now (one round trip to the server)."""
        ...

    def append_later(self, subject: str, event: ev.Event) -> None:
        """Queue an event that may wait for the next message on its subject (a prefill
        completion, a request's end: `eventlog.group_commit`); a failure is logged."""
        ...

    async def wait_ready(self, timeout: float | None = None) -> None: ...

    async def wait_applied(self, kind: str, seq: int, timeout: float = 10.0) -> None:
        """Until this replica's state has applied ``seq`` of stream ``kind``."""
        ...
