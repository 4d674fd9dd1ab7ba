"""`jetrouter admin export FILE` / `import FILE`: the streams and the newest snapshot, to a file
and back into an empty NATS (design.md §8, README "Backups").

What JetStream's own stream backup gives, in jetrouter's terms: every message of the three
streams with its subject, headers and **stream sequence**, and the newest snapshot that
verifies. Sequences are what a replica's positions, a snapshot's positions and a `StateReset`'s
cut are written in, so an import puts every message back at its own sequence: each stream is
first moved to start at the exported first sequence (a purge up to it, which is how JetStream
sets the first sequence of an empty stream), then every publish names the sequence it expects
to follow (`Nats-Expected-Last-Sequence`), so a message can land nowhere else. Replicas started
on the imported NATS load the snapshot, replay the rest and reach the digests the exported
cluster had at the same positions.

The file: gzip of length-prefixed msgpack records: a header (backup format, namespace, the
release that wrote it, each stream's bounds), the snapshot (its meta and the uncompressed state
bytes), one record per message, and an end record with the counts (a truncated file is refused).

The export reads while the cluster runs: each stream up to its last sequence when the export
began. The leader purges a stream only up to the snapshot *before* the newest one, so the
messages after the exported snapshot stay; a purge that overtook the export anyway (two
snapshots taken while it ran) is reported, and the export has to run again.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import importlib.metadata
import struct
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import msgspec
from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from errors.root import JetrouterError
from eventlog import wire
from eventlog.appender import MSG_ID_HEADER
from eventlog.connect import (
    NATS_SECURITY,
    NatsOptions,
    NatsOptionsInvalid,
    connect,
    options_from_args,
)
from eventlog.names import STREAM_KINDS, Names
from eventlog.streams import ensure_streams, stream_bounds
from replicas.core.state_codec import SNAPSHOT_FORMAT
from settings.flags import add_options
from snapshots.store import SnapshotMeta, SnapshotStore

BACKUP_FORMAT = 1
MAGIC = b"jetrouter-backup\n"
_FETCH = 256
_FRAME = struct.Struct(">I")
_EXPECTED_LAST = "Nats-Expected-Last-Sequence"


class BackupError(JetrouterError):
    """An export or import that cannot go on; the message says why in one line."""


def _write(f: IO[bytes], record: dict[str, Any]) -> None:
    data = msgspec.msgpack.encode(record)
    f.write(_FRAME.pack(len(data)))
    f.write(data)


def _records(f: IO[bytes]) -> Iterator[dict[str, Any]]:
    while True:
        head = f.read(_FRAME.size)
        if not head:
            return
        if len(head) < _FRAME.size:
            raise BackupError("the backup file is truncated")
        (size,) = _FRAME.unpack(head)
        data = f.read(size)
        if len(data) < size:
            raise BackupError("the backup file is truncated")
        record = msgspec.msgpack.decode(data)
        if not isinstance(record, dict) or "kind" not in record:
            raise BackupError("the backup file holds a record that is not one of ours")
        yield record


# --- export -----------------------------------------------------------------------------------


async def export_backup(js: JetStreamContext, names: Names, path: Path, *,
                        version: str = "") -> dict[str, Any]:
    """Write the newest valid snapshot and every stream message to ``path``; a summary."""
    store = SnapshotStore(js, names)
    loaded = await store.load_newest_valid()
    bounds = {kind: await stream_bounds(js, names.stream(kind)) for kind in STREAM_KINDS}
    summary: dict[str, Any] = {"file": str(path), "namespace": names.namespace,
                               "snapshot": None, "messages": {}}
    tmp = path.with_name(path.name + ".partial")
    with gzip.open(tmp, "wb", compresslevel=1) as f:
        f.write(MAGIC)
        _write(f, {"kind": "header", "backup_format": BACKUP_FORMAT,
                   "namespace": names.namespace, "created_ts": time.time(),
                   "written_by": {"version": version, "events": wire.EVENT_FORMAT,
                                  "snapshots": SNAPSHOT_FORMAT},
                   "streams": {k: {"first_seq": b[0], "last_seq": b[1]}
                               for k, b in bounds.items()}})
        if loaded is not None:
            _write(f, {"kind": "snapshot", "meta": msgspec.to_builtins(loaded.meta),
                       "state": loaded.data})
            summary["snapshot"] = loaded.meta.snapshot_id
        for kind in STREAM_KINDS:
            first, last = bounds[kind]
            n, first_read = await _export_stream(js, names, kind, first, last, f)
            after = loaded.meta.positions.get(kind, 0) + 1 if loaded is not None else 1
            if n and first_read > max(after, first):
                raise BackupError(f"stream {names.stream(kind)} was purged up to {first_read} "
                                  "while exporting (snapshots were taken meanwhile): run the "
                                  "export again")
            summary["messages"][kind] = n
        _write(f, {"kind": "end", "messages": summary["messages"]})
    tmp.replace(path)
    return summary


async def _export_stream(js: JetStreamContext, names: Names, kind: str, first: int, last: int,
                         f: IO[bytes]) -> tuple[int, int]:
    """Messages ``first..last`` of one stream into ``f``: (how many, the first sequence read)."""
    if last < max(first, 1):
        return 0, 0
    stream = names.stream(kind)
    config = ConsumerConfig(ack_policy=AckPolicy.NONE,
                            deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
                            opt_start_seq=max(first, 1), inactive_threshold=30.0,
                            mem_storage=True)
    sub = await js.pull_subscribe(names.subjects(kind), stream=stream, config=config)
    count, expect, first_read = 0, 0, 0
    try:
        while expect <= last:
            for msg in await sub.fetch(_FETCH, timeout=10.0):
                seq = msg.metadata.sequence.stream
                if seq > last:
                    return count, first_read
                if expect and seq != expect:
                    raise BackupError(f"stream {stream} has no message {expect} (next is {seq}): "
                                      "a deleted message; jetrouter streams never hold a hole")
                first_read = first_read or seq
                expect = seq + 1
                _write(f, {"kind": "message", "stream": kind, "seq": seq,
                           "subject": msg.subject, "headers": dict(msg.headers or {}),
                           "data": msg.data})
                count += 1
    finally:
        await sub.unsubscribe()
    return count, first_read


# --- import -----------------------------------------------------------------------------------


def read_header(path: Path) -> dict[str, Any]:
    """The header record of a backup file (what `import` checks before touching NATS)."""
    try:
        with gzip.open(path, "rb") as f:
            if f.read(len(MAGIC)) != MAGIC:
                raise BackupError(f"{path} is not a jetrouter backup")
            header = next(_records(f), None)
    except (gzip.BadGzipFile, EOFError, msgspec.DecodeError) as exc:
        raise BackupError(f"{path} is not a jetrouter backup ({exc})") from None
    if header is None or header.get("kind") != "header":
        raise BackupError(f"{path} has no backup header")
    found = int(header.get("backup_format", 0))
    if found > BACKUP_FORMAT:
        raise wire.NewerFormat(f"backup {path}", found, BACKUP_FORMAT)
    return header


async def import_backup(js: JetStreamContext, names: Names, path: Path) -> dict[str, Any]:
    """Put a backup into a NATS whose jetrouter streams and snapshot bucket are empty."""
    header = read_header(path)
    if header["namespace"] != names.namespace:
        raise BackupError(f"{path} holds namespace {header['namespace']!r}, not "
                          f"{names.namespace!r}: import it with --namespace "
                          f"{header['namespace']}")
    await ensure_streams(js, names)
    store = SnapshotStore(js, names)
    await _check_empty(js, names, store)
    for kind in STREAM_KINDS:
        first = int(header["streams"][kind]["first_seq"])
        if first > 1:  # an empty stream starts where the exported one did
            await js.purge_stream(names.stream(kind), seq=first)
    counts = {k: 0 for k in STREAM_KINDS}
    summary: dict[str, Any] = {"file": str(path), "namespace": names.namespace,
                               "snapshot": None, "messages": counts}
    ended = False
    with gzip.open(path, "rb") as f:
        f.read(len(MAGIC))
        for record in _records(f):
            kind = record["kind"]
            if kind == "message":
                await _import_message(js, names, record)
                counts[record["stream"]] += 1
            elif kind == "snapshot":
                meta = msgspec.convert(record["meta"], SnapshotMeta)
                stored = await store.put(record["state"], positions=meta.positions,
                                         epoch=meta.epoch, created_by=meta.created_by,
                                         trigger=f"import of {meta.snapshot_id}",
                                         format=meta.format)
                summary["snapshot"] = stored.snapshot_id
            elif kind == "end":
                ended = record.get("messages") == counts
    if not ended:
        raise BackupError(f"{path} ends before its end record (or its counts differ): the "
                          "file is incomplete; the import stopped after "
                          f"{sum(counts.values())} messages")
    return summary


async def _check_empty(js: JetStreamContext, names: Names, store: SnapshotStore) -> None:
    for kind in STREAM_KINDS:
        _, last = await stream_bounds(js, names.stream(kind))
        if last:
            raise BackupError(f"stream {names.stream(kind)} already holds messages (last "
                              f"sequence {last}): import needs an empty NATS")
    if await store.list():
        raise BackupError(f"snapshot bucket {store.bucket} is not empty: import needs an empty "
                          "NATS")


async def _import_message(js: JetStreamContext, names: Names, record: dict[str, Any]) -> None:
    seq = int(record["seq"])
    headers = {k: v for k, v in (record.get("headers") or {}).items() if k != MSG_ID_HEADER}
    # The message id was the writer's guard against its own retries; here the expected last
    # sequence is the guard: the message lands at `seq` or the import stops.
    headers[_EXPECTED_LAST] = str(seq - 1)
    ack = await js.publish(record["subject"], record["data"], headers=headers, timeout=10.0)
    if ack.seq != seq:
        raise BackupError(f"message {seq} of {names.stream(record['stream'])} landed at "
                          f"{ack.seq}")


# --- the `jetrouter admin export|import FILE` verbs -------------------------------------------


def add_verbs(sub: Any) -> None:
    """The two verbs on `jetrouter admin`'s subparsers; they talk to NATS, not to a replica."""
    helps = {"export": "write the streams and the newest snapshot to FILE (a backup)",
             "import": "load a backup FILE into an empty NATS, before any replica starts"}
    for verb, text in helps.items():
        p = sub.add_parser(verb, help=text, description=text)
        p.add_argument("file", type=Path, metavar="FILE")
        p.add_argument("--nats-url", default=None,
                       help="NATS to read from / write into (default: nats_url in the cluster "
                            "file)")
        p.add_argument("--namespace", default=None,
                       help="namespace of the streams (default: the cluster file's; for "
                            "import, the backup's)")
        add_options(p, [NATS_SECURITY])


def run_verb(args: argparse.Namespace, cluster: dict[str, Any] | None) -> int:
    """Run `export` or `import`; one line on stdout, or one `error:` line and status 1/2."""
    try:
        url = args.nats_url or (cluster or {}).get("nats_url")
        if not url:
            raise ValueError("no NATS to talk to: pass --nats-url URL (or start a cluster with "
                             "`jetrouter up`, whose cluster file names it)")
        namespace = args.namespace or (cluster or {}).get("namespace")
        if args.admin_verb == "import":
            namespace = namespace or read_header(args.file)["namespace"]
        elif args.file.is_dir():
            raise ValueError(f"{args.file} is a directory: name the backup file to write")
        options = options_from_args(args, url=url)
        summary = asyncio.run(_run(args.admin_verb, options, Names(namespace or "jr"),
                                   args.file))
    except (ValueError, OSError, NatsOptionsInvalid) as exc:
        print(f"jetrouter admin: error: {exc}", file=sys.stderr)
        return 2
    except (JetrouterError, NatsError, TimeoutError) as exc:
        print(f"jetrouter admin: error: {args.admin_verb} failed: {exc or type(exc).__name__}",
              file=sys.stderr)
        return 1
    counts = ", ".join(f"{k} {n}" for k, n in summary["messages"].items())
    done = "exported to" if args.admin_verb == "export" else "imported from"
    print(f"{done} {summary['file']}: namespace {summary['namespace']}, snapshot "
          f"{summary['snapshot'] or 'none'}, messages: {counts}")
    return 0


async def _run(verb: str, options: NatsOptions, names: Names, path: Path) -> dict[str, Any]:
    nc = await connect(options, name=f"jetrouter-admin-{verb}", max_reconnect_attempts=2)
    try:
        js = nc.jetstream(timeout=10.0)
        if verb == "export":
            return await export_backup(js, names, path, version=release_version())
        return await import_backup(js, names, path)
    finally:
        await nc.close()


def release_version() -> str:
    try:
        return importlib.metadata.version("jetrouter")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
