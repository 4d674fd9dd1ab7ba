"""The projections' database: engine, schema and tracking rows (design.md §8).

Every projection stores, next to its view tables, one *tracking row*: the last stream sequence it
applied and the newest event time it has seen. The row is written in the same transaction as the
view update it accounts for, so after any crash the view and the position agree: either both moved
or neither did. Tables are created at start (no migrations tool); any SQLAlchemy async URL works,
SQLite through aiosqlite being the default.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
from sqlalchemy import (
    Boolean,
    Column,
    Float,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    event,
    select,
    update,
)
from sqlalchemy.engine.interfaces import DBAPIConnection
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from sqlalchemy.pool import ConnectionPoolEntry

DB_FILE = "jetrouter.db"

metadata = MetaData()

tracking = Table(
    "projection_tracking",
    metadata,
    Column("projection", String(64), primary_key=True),
    Column("stream", String(16), nullable=False),
    Column("seq", Integer, nullable=False),
    # Newest event ``ts`` applied: retention runs in event time, and must resume where it was.
    Column("event_ts", Float, nullable=False),
)

snapshot_catalog = Table(
    "snapshot_catalog",
    metadata,
    Column("snapshot_id", String(128), primary_key=True),
    Column("seq", Integer, nullable=False, index=True),
    Column("positions", Text, nullable=False),
    Column("size", Integer, nullable=False),
    Column("sha256", String(64), nullable=False),
    Column("created_by", String(128), nullable=False),
    Column("trigger", String(64), nullable=False),
    Column("ts", Float, nullable=False),
    # Set when a later StateReset deleted every blob: the entry stays as history.
    Column("discarded", Boolean, nullable=False, default=False),
)

decision_ledger = Table(
    "decision_ledger",
    metadata,
    Column("request_id", String(256), primary_key=True),
    Column("base_id", String(256), nullable=False, index=True),
    Column("hop", Integer, nullable=False),
    Column("seq", Integer, nullable=False),
    Column("replica_id", String(128), nullable=False),
    Column("worker_id", String(128), nullable=False),
    Column("dp_rank", Integer, nullable=False),
    Column("model", String(256), nullable=False),
    Column("isl_tokens", Integer, nullable=False),
    Column("overlap_blocks", Integer, nullable=False),
    Column("expected_osl", Integer, nullable=False),
    Column("priority", Integer, nullable=False),
    Column("candidates", Text, nullable=False),
    Column("routed_ts", Float, nullable=False, index=True),
    Column("prefill_ts", Float),
    Column("finished_ts", Float),
    Column("outcome", String(32)),
    Column("output_tokens", Integer),
    Column("lost", Boolean, nullable=False, default=False),
    Column("lost_ts", Float),
    # Prediction vs reality: the reuse the router predicted (overlap_blocks * block_size; NULL
    # when the decision did not record its block size) and the engine's own cached_tokens (NULL
    # until the request ends, or when the engine did not report it).
    Column("predicted_tokens", Integer),
    Column("cached_tokens", Integer),
    # The tenant the request was admitted for (NULL: none, or routed before tenants existed).
    Column("tenant", String(128)),
    # A decode decision's KV hand-off: the blocks its engine receives from the prefill hop
    # (RequestRouted.transfer_blocks; NULL: not a hand-off, or routed before it was recorded).
    Column("transfer_blocks", Integer),
    # ReplicaLost looks for the open requests of one replica.
    Index("ix_decision_ledger_open", "replica_id", "finished_ts"),
)

_json_encoder = msgspec.json.Encoder()


def to_json(value: Any) -> str:
    return _json_encoder.encode(value).decode()


def from_json(text: str) -> Any:
    return msgspec.json.decode(text)


def default_url(data_dir: str | Path) -> str:
    """``sqlite+aiosqlite:///<data-dir>/jetrouter.db`` (the directory is created)."""
    path = Path(data_dir).expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    return f"sqlite+aiosqlite:///{path / DB_FILE}"


def _sqlite_pragmas(dbapi_conn: DBAPIConnection, _record: ConnectionPoolEntry) -> None:
    # WAL lets the admin API read while the feeder writes; synchronous=NORMAL keeps commits off
    # fsync (a crash can lose the last commits, never tear one: replay re-applies them).
    cursor = dbapi_conn.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA busy_timeout=5000")
    cursor.close()


def make_engine(url: str) -> AsyncEngine:
    engine = create_async_engine(url)
    if engine.dialect.name == "sqlite":
        event.listen(engine.sync_engine, "connect", _sqlite_pragmas)
    return engine


# Nullable columns added after a table's first release: a database written by an older
# version gets them with ALTER TABLE at start (rows it already holds read NULL: unknown).
ADDED_COLUMNS: dict[str, tuple[str, ...]] = {
    "decision_ledger": ("predicted_tokens", "cached_tokens", "tenant", "transfer_blocks"),
}


def _add_missing_columns(sync_conn: Any) -> None:
    from sqlalchemy import inspect, text

    inspector = inspect(sync_conn)
    for table_name, columns in ADDED_COLUMNS.items():
        have = {c["name"] for c in inspector.get_columns(table_name)}
        table = metadata.tables[table_name]
        for name in columns:
            if name not in have:
                kind = table.c[name].type.compile(dialect=sync_conn.dialect)
                sync_conn.execute(text(f"ALTER TABLE {table_name} ADD COLUMN {name} {kind}"))


async def create_tables(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        await conn.run_sync(metadata.create_all)
        await conn.run_sync(_add_missing_columns)


@dataclass(slots=True)
class Tracking:
    """One projection's tracking row as read inside a transaction."""

    projection: str
    stream: str
    seq: int = 0
    event_ts: float = 0.0
    exists: bool = False


async def read_tracking(conn: AsyncConnection, projection: str, stream: str) -> Tracking:
    row = (
        await conn.execute(
            # FOR UPDATE (a no-op on SQLite): two processes sharing a server database must not
            # both apply the same messages.
            select(tracking.c.seq, tracking.c.event_ts)
            .where(tracking.c.projection == projection)
            .with_for_update()
        )
    ).first()
    if row is None:
        return Tracking(projection, stream)
    return Tracking(projection, stream, int(row.seq), float(row.event_ts), True)


async def write_tracking(conn: AsyncConnection, track: Tracking) -> None:
    """Insert or advance the tracking row (portable: no dialect-specific upsert)."""
    values = {"seq": track.seq, "event_ts": track.event_ts}
    if track.exists:
        await conn.execute(
            update(tracking).where(tracking.c.projection == track.projection).values(**values)
        )
    else:
        await conn.execute(
            tracking.insert().values(projection=track.projection, stream=track.stream, **values)
        )
        track.exists = True
