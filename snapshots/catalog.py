"""Snapshot catalog: a SQL view of every ``SnapshotTaken`` on the control stream (design.md §8).

One row per snapshot (the first ``SnapshotTaken`` for an id wins; a repeat is ignored). A later
``StateReset`` deletes every blob, so it marks the rows before it ``discarded`` rather than
dropping them: the catalog is history. The control stream is low-volume, so statements run one
by one in stream order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from eventlog import events as ev
from eventlog.names import CONTROL
from snapshots.db import Tracking, from_json, snapshot_catalog, to_json

Message = tuple[int, Sequence[ev.Event]]


class CatalogView:
    projection = "snapshot_catalog"
    stream = CONTROL

    async def write(
        self, conn: AsyncConnection, messages: Sequence[Message], track: Tracking
    ) -> None:
        """Apply ``messages`` (already filtered to seq > tracked position) inside ``conn``'s
        transaction; ``track.event_ts`` is advanced to the newest ``ts`` seen."""
        table = snapshot_catalog
        for seq, batch in messages:
            for event in batch:
                track.event_ts = max(track.event_ts, float(event.ts))
                if isinstance(event, ev.SnapshotTaken):
                    known = await conn.execute(
                        select(table.c.snapshot_id).where(table.c.snapshot_id == event.snapshot_id)
                    )
                    if known.first() is not None:
                        continue
                    await conn.execute(table.insert().values(
                        snapshot_id=event.snapshot_id,
                        seq=seq,
                        positions=to_json(event.positions),
                        size=event.size,
                        sha256=event.sha256,
                        created_by=event.created_by,
                        trigger=event.trigger,
                        ts=event.ts,
                        discarded=False,
                    ))
                elif isinstance(event, ev.StateReset):
                    await conn.execute(
                        update(table).where(table.c.discarded.is_(False)).values(discarded=True)
                    )

    async def snapshots(self, conn: AsyncConnection, limit: int) -> list[dict[str, Any]]:
        """Newest first, in stream order (leaders' clocks may disagree; the stream does not)."""
        table = snapshot_catalog
        rows = await conn.execute(select(table).order_by(table.c.seq.desc()).limit(limit))
        return [_snapshot_dict(row._mapping) for row in rows]

    async def count(self, conn: AsyncConnection) -> int:
        query = select(func.count()).select_from(snapshot_catalog)
        return int((await conn.execute(query)).scalar_one())


def _snapshot_dict(row: Any) -> dict[str, Any]:
    return {
        "snapshot_id": row["snapshot_id"],
        "seq": row["seq"],
        "positions": from_json(row["positions"]),
        "size": row["size"],
        "sha256": row["sha256"],
        "created_by": row["created_by"],
        "trigger": row["trigger"],
        "ts": row["ts"],
        "discarded": bool(row["discarded"]),
    }
