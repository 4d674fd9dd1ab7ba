"""Numbered stores to append and the items a log reader yields, for the event log's tests (the
contract every log keeps, the JetStream reader, the log on a cluster)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from eventlog.events import BlocksStored, Event

Items = list[tuple[int, list[Event]]]


def stored(event_id: int, worker_id: str = "w1") -> BlocksStored:
    """One block stored by ``worker_id``, hash and parentage named by ``event_id``."""
    return BlocksStored(worker_id=worker_id, event_id=event_id, dp_rank=0, parent_hash=None,
                        blocks=[(event_id, event_id)], ts=1.0)


async def take(reader: AsyncIterator[tuple[int, list[Event]]], n: int,
               timeout: float = 60.0) -> Items:
    """The next ``n`` items, failing (not hanging) when they do not come within ``timeout``."""

    async def collect() -> Items:
        out: Items = []
        async for item in reader:
            out.append(item)
            if len(out) == n:
                break
        return out

    return await asyncio.wait_for(collect(), timeout)


def event_ids(items: Items) -> list[int]:
    return [e.event_id for _, events in items for e in events]  # type: ignore[union-attr]
