"""Snapshot blobs in the JetStream object store bucket ``<ns>-snapshots`` (design.md §8).

A snapshot is an encoded ``RouterState`` (msgpack), compressed with zlib level 1 (state formats
up to 4) or stored as it is (format 5 on: see below), as one object whose NATS object-meta
``headers`` carry a :class:`SnapshotMeta` (positions, epoch, sha256 of the *uncompressed* bytes,
sizes, compression, who took it and why). Object names sort by creation:
``snap-<epoch:06d>-<unix_ms:013d>-<random hex>``.

Why zlib level 1: on a 1M-block state (26.8 MB of msgpack in state format 1; 17.0 MB, of random
64-bit hashes mostly, in the columnar format 2) it compresses to 68 % (91 %) in ~0.5 s (~0.3 s) and
inflates in ~0.09 s; zlib 6 gains 1 % for more time, lzma preset 0 gains 4 % but takes 2.2 s to
compress and 0.9 s to inflate — restore speed matters more than bytes (figures:
``benchmarks/bench_snapshot_store.py``). Compression and hashing run in a worker thread
(both release the GIL), so the event loop — and the leader lease renewing on it — keeps running;
``put`` also accepts a function (``RouterState.encoder()``), so encoding runs there too.

Why not compress format 5 (the compact index's arrays, ``replicas/core/state_codec.py``): it is
almost all random 64-bit hashes, which zlib level 1 shrank by 6 % (172 → 161 MB at 10 M pairs)
for ~0.5 s of inflating and two SHA-256 passes on the way to ``/ready``, and ~4 s of CPU to
compress on the leader. Stored as it is, reading it is fetching it and one SHA-256 (the object
digest and the state's sha256 are then the same hash of the same bytes). Formats up to 4 stay
compressed, so the release before reads what this one writes for them (it knows no other
compression; format 5 it passes over by its format before fetching).

Writing uses the stock nats-py ``ObjectStore.put`` with chunks as large as the server's
``max_payload`` allows (fewer acked publishes). Reading does *not* use ``ObjectStore.get``: it
reads through a push consumer with flow control and concatenates ``bytes`` chunk by chunk
(quadratic), ~0.8 s for 18 MB and 1.6-6.6 s for 50 MB. Here an ephemeral pull consumer fetches
the chunks in batches and joins them once: ~0.05 s for 18 MB, ~0.15 s for 50 MB. The wire layout
stays the standard object-store one, so ``nats object`` tools still work.

Reads must see the newest write from any node. The server places an ephemeral R1 consumer on
any replica of the stream, not only on its leader (one time in three on a 3-node cluster,
measured), and a follower may not have stored a write that the leader has already acknowledged.
So the listing asks the stream leader (stream info with a subject filter, then each object's
last meta message: both answered by the leader only), and a chunk read that finds fewer chunks
than the meta names is asked again on a fresh consumer before the snapshot counts as corrupt.

Writing right after the bucket's stream was created (or while it elects a leader) can find no
stream to answer yet: the create is acknowledged by the new stream leader before its interest
has reached the server this client is connected to, so the first chunk's publish comes back "no
response from stream" (seen on a 3-node cluster one put in four under load). A put failing so is
tried again under the same id, up to ``_PUT_WINDOW`` seconds: nats-py's put purges the chunks of a
failed try, and a meta that was stored without our hearing of it is replaced by the next try's
(same name, a rollup), whose chunks are then the object's. (A try whose purge fails as well leaves
its chunks behind, named by no meta, until ``delete_all``.)

Deleting purges the object's chunks and then its meta subject (no tombstone left behind, so the
bucket does not accumulate one meta message per snapshot ever taken). A crash in between leaves a
meta without chunks: it lists, fails verification loudly, and is pruned as the oldest later.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import logging
import secrets
import time
import zlib
from collections.abc import Callable
from typing import Any, NamedTuple

import msgspec
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    ObjectInfo,
    ObjectMeta,
    ObjectMetaOptions,
    StorageType,
    StreamConfig,
)
from nats.js.errors import NotFoundError, ServiceUnavailableError
from nats.js.object_store import ObjectStore

from errors.root import JetrouterError
from eventlog.appender import is_transient
from eventlog.names import Names
from eventlog.streams import cluster_size_hint, ensure_stream, lookup_stream
from replicas.core.state_codec import SNAPSHOT_FORMAT

log = logging.getLogger("jetrouter.snapshots")

META_HEADER = "Jetrouter-Snapshot"
COMPRESSION = "zlib"
NO_COMPRESSION = "none"
UNCOMPRESSED_FROM_FORMAT = 5  # state formats stored as they are (module docstring)
ZLIB_LEVEL = 1
_MAX_CHUNK = 8 * 1024 * 1024
_CHUNK_HEADROOM = 4096  # max_payload counts headers too
_FETCH_BATCH = 16
_FETCH_TIMEOUT = 10.0
_FETCH_ATTEMPTS = 4
_PUT_WINDOW = 30.0  # seconds a put keeps trying a transient failure (module docstring)
_PUT_RETRY_MIN, _PUT_RETRY_MAX = 0.1, 2.0


class SnapshotMeta(msgspec.Struct, frozen=True):
    """What is known about one stored snapshot. ``size``/``sha256`` describe the uncompressed
    encoded state (as in ``SnapshotTaken``); ``stored_size`` is the compressed object's size."""

    snapshot_id: str
    positions: dict[str, int]
    epoch: int
    size: int
    sha256: str
    created_by: str
    trigger: str
    ts: float
    stored_size: int = 0
    compression: str = COMPRESSION
    # The state format inside (replicas/core/state.py SNAPSHOT_FORMAT), so a reader can pass over
    # a snapshot written by a newer release without fetching it. 0: not recorded (written before
    # releases recorded it; the blob's own format field decides).
    format: int = 0


class LoadedSnapshot(NamedTuple):
    """Result of :meth:`SnapshotStore.load_newest_valid`: ``loaded[0]`` is the meta and
    ``loaded[1]`` the uncompressed state bytes; ``skipped`` lists the newer snapshots that failed
    verification (or vanished) first, as ``(snapshot_id, why)``, newest first."""

    meta: SnapshotMeta
    data: bytes
    skipped: list[tuple[str, str]]


class SnapshotCorrupt(JetrouterError):
    """A stored snapshot failed verification (digest, decompression, checksum or meta)."""

    def __init__(self, snapshot_id: str, why: str) -> None:
        super().__init__(f"snapshot {snapshot_id} is corrupt: {why}")
        self.snapshot_id = snapshot_id
        self.why = why


class SnapshotNotFound(JetrouterError, KeyError):
    """No snapshot with that id (never written, pruned or deleted)."""


def new_snapshot_id(epoch: int, unix_ms: int) -> str:
    """Sortable by creation within and across epochs (epochs only grow)."""
    return f"snap-{epoch:06d}-{unix_ms:013d}-{secrets.token_hex(3)}"


def compression_for(format: int) -> str:
    """How a snapshot of this state format is stored (module docstring)."""
    return NO_COMPRESSION if format >= UNCOMPRESSED_FROM_FORMAT else COMPRESSION


def _pack(raw: bytes, compression: str) -> tuple[bytes, str]:
    """Compress and checksum (run in a thread: both release the GIL on large buffers)."""
    blob = raw if compression == NO_COMPRESSION else zlib.compress(raw, ZLIB_LEVEL)
    return blob, hashlib.sha256(raw).hexdigest()


def _encode_and_pack(state: bytes | Callable[[], bytes], compression: str
                     ) -> tuple[int, bytes, str]:
    raw = state() if callable(state) else state
    return len(raw), *_pack(raw, compression)


def _unpack(snapshot_id: str, blob: bytes, nats_digest: str | None, meta: SnapshotMeta) -> bytes:
    """Verify the object digest, inflate, verify size and sha256 of the state bytes."""
    if meta.compression not in (COMPRESSION, NO_COMPRESSION):
        raise SnapshotCorrupt(snapshot_id, f"unknown compression {meta.compression!r}")
    digest = hashlib.sha256(blob).digest()
    if nats_digest:
        want = nats_digest.split("=", 1)[1] if "=" in nats_digest else nats_digest
        have = base64.urlsafe_b64encode(digest).decode()
        if have.rstrip("=") != want.rstrip("="):
            raise SnapshotCorrupt(snapshot_id, "stored object digest does not match its chunks")
    if meta.compression == NO_COMPRESSION:
        raw = blob  # its digest is the state's sha256 too: one pass over the bytes
    else:
        try:
            raw = zlib.decompress(blob)
        except zlib.error as exc:
            raise SnapshotCorrupt(snapshot_id, f"decompression failed: {exc}") from None
        digest = hashlib.sha256(raw).digest()
    if len(raw) != meta.size:
        raise SnapshotCorrupt(snapshot_id, f"size {len(raw)} != recorded {meta.size}")
    if digest.hex() != meta.sha256:
        raise SnapshotCorrupt(snapshot_id, "sha256 of the state bytes does not match")
    return raw


def _meta_of(info: ObjectInfo) -> SnapshotMeta:
    """Our meta from an object's headers; ValueError when absent or malformed."""
    headers = info.headers or {}
    value = headers.get(META_HEADER)
    if isinstance(value, list):
        value = value[0] if value else None
    if not isinstance(value, str):
        raise ValueError(f"object {info.name!r} has no {META_HEADER} header")
    try:
        return msgspec.json.decode(value.encode(), type=SnapshotMeta)
    except msgspec.DecodeError as exc:
        raise ValueError(f"object {info.name!r} has a malformed {META_HEADER} header: {exc}"
                         ) from None


def _newest_first(metas: list[SnapshotMeta]) -> list[SnapshotMeta]:
    return sorted(metas, key=lambda m: (m.epoch, m.ts, m.snapshot_id), reverse=True)


class SnapshotStore:
    """Snapshot blobs of one namespace. Cheap to construct; the bucket is created (file storage,
    replicas following the NATS cluster size) on first use, idempotently across processes."""

    def __init__(self, js: JetStreamContext, names: Names, *, keep: int = 3) -> None:
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self.js = js
        self.names = names
        self.keep = keep
        self.bucket = names.snapshot_bucket
        self.stream = f"OBJ_{self.bucket}"
        self._obs: ObjectStore | None = None
        self._ready_lock = asyncio.Lock()

    # --- bucket -------------------------------------------------------------------------------

    def _chunk_subject(self, nuid: str) -> str:
        return f"$O.{self.bucket}.C.{nuid}"

    def _meta_subject(self, name: str) -> str:
        return f"$O.{self.bucket}.M.{base64.urlsafe_b64encode(name.encode()).decode()}"

    async def ensure(self) -> ObjectStore:
        """Open the bucket, creating it when missing (same stream layout as nats-py's
        ``create_object_store``, plus replica step-down via ``eventlog.streams``)."""
        async with self._ready_lock:
            if self._obs is None:
                try:
                    await lookup_stream(self.js, self.stream)
                except NotFoundError:
                    config = StreamConfig(
                        name=self.stream,
                        description="jetrouter snapshot blobs",
                        subjects=[f"$O.{self.bucket}.C.>", f"$O.{self.bucket}.M.>"],
                        storage=StorageType.FILE,
                        num_replicas=cluster_size_hint(self.js),
                        discard=DiscardPolicy.NEW,
                        allow_rollup_hdrs=True,
                        allow_direct=True,
                        max_bytes=-1,
                        duplicate_window=120.0,
                    )
                    await ensure_stream(self.js, config, replicas_given=False)
                self._obs = ObjectStore(name=self.bucket, stream=self.stream, js=self.js)
            return self._obs

    def reopen(self) -> None:
        """NATS lost its storage (the bucket is gone): open, and so create, it again on next
        use."""
        self._obs = None

    def _chunk_size(self) -> int:
        nc = getattr(self.js, "_nc", None)
        max_payload = int(getattr(nc, "max_payload", 0) or 1024 * 1024)
        return max(64 * 1024, min(_MAX_CHUNK, max_payload - _CHUNK_HEADROOM))

    # --- writing ------------------------------------------------------------------------------

    async def put(self, state: bytes | Callable[[], bytes], *, positions: dict[str, int],
                  epoch: int, created_by: str, trigger: str,
                  format: int = SNAPSHOT_FORMAT) -> SnapshotMeta:
        """Compress, checksum and store one snapshot, then prune to the newest ``keep``.

        ``state`` is the encoded state, or a function returning it (e.g.
        ``RouterState.encoder()``, which captured the state already): it is then called in the
        worker thread too, so encoding a large state does not hold the event loop up.
        ``format`` is the state format of those bytes (another one only for an imported
        backup's snapshot, which keeps the format it was written in); it decides how the
        bytes are stored (``compression_for``)."""
        obs = await self.ensure()
        compression = compression_for(format)
        size, blob, digest = await asyncio.to_thread(_encode_and_pack, state, compression)
        now = time.time()
        snapshot_id = new_snapshot_id(epoch, int(now * 1000))
        meta = SnapshotMeta(
            snapshot_id=snapshot_id, positions=dict(positions), epoch=epoch,
            size=size, sha256=digest, created_by=created_by, trigger=trigger,
            ts=now, stored_size=len(blob), compression=compression, format=format,
        )
        object_meta = ObjectMeta(
            name=snapshot_id,
            description=f"jetrouter snapshot epoch {epoch} ({trigger})",
            headers={META_HEADER: [msgspec.json.encode(meta).decode()]},
            options=ObjectMetaOptions(max_chunk_size=self._chunk_size()),
        )
        await self._put_object(obs, snapshot_id, blob, object_meta)
        try:
            await self.prune(protect=snapshot_id)
        except Exception:  # the snapshot is stored; a failed prune is retried on the next put
            log.warning("pruning snapshots after %s failed", snapshot_id, exc_info=True)
        return meta

    async def _put_object(self, obs: ObjectStore, snapshot_id: str, blob: bytes,
                          object_meta: ObjectMeta) -> None:
        """``obs.put``, tried again while it fails transiently (no stream leader yet, no answer
        in time), for up to ``_PUT_WINDOW`` seconds (module docstring)."""
        deadline = time.monotonic() + _PUT_WINDOW
        delay = _PUT_RETRY_MIN
        while True:
            try:
                await obs.put(snapshot_id, blob, meta=object_meta)
                return
            except Exception as exc:
                if not is_transient(exc) or time.monotonic() + delay > deadline:
                    raise
                log.warning("storing snapshot %s failed (%s); trying again in %.1f s",
                            snapshot_id, type(exc).__name__, delay)
            await asyncio.sleep(delay)  # backoff between attempts, not a synchronisation
            delay = min(delay * 2, _PUT_RETRY_MAX)

    async def prune(self, *, protect: str | None = None) -> list[str]:
        """Delete all but the newest ``keep`` snapshots (never ``protect``); returns deleted ids."""
        metas = await self.list()
        doomed = [m.snapshot_id for m in metas[self.keep:] if m.snapshot_id != protect]
        for snapshot_id in doomed:
            await self.delete(snapshot_id)
        return doomed

    # --- reading ------------------------------------------------------------------------------

    async def _fetch_all(self, subject: str, deliver: DeliverPolicy, expected: int | None = None
                         ) -> list[bytes]:
        """Every message on ``subject`` through an ephemeral pull consumer. ``expected`` guards
        against missing chunks: the consumer may sit on a follower that has not stored the
        newest chunks yet, so a short count is asked again before it is reported.

        A fresh consumer on a replicated bucket can answer its first pull with 503 while it is
        still being placed, and its creation can go unanswered within the API timeout (both seen
        on a loaded 3-node cluster); each attempt uses a new ephemeral consumer (one created
        without our hearing of it expires by its inactivity threshold), so trying again is
        safe."""
        for attempt in range(_FETCH_ATTEMPTS):
            try:
                return await self._fetch_once(subject, deliver, expected)
            except (ServiceUnavailableError, NatsTimeoutError, _ShortRead) as exc:
                if attempt == _FETCH_ATTEMPTS - 1:
                    raise
                log.info("snapshot bucket %s: %s reading it; trying again", self.bucket,
                         "pull answered 503" if isinstance(exc, ServiceUnavailableError)
                         else exc if isinstance(exc, _ShortRead) else "no answer")
                await asyncio.sleep(0.2 * (attempt + 1))
        raise AssertionError("unreachable")

    async def _fetch_once(self, subject: str, deliver: DeliverPolicy, expected: int | None
                          ) -> list[bytes]:
        config = ConsumerConfig(ack_policy=AckPolicy.NONE, deliver_policy=deliver,
                                inactive_threshold=30.0, mem_storage=True)
        sub = await self.js.pull_subscribe(subject, stream=self.stream, config=config,
                                           pending_bytes_limit=_FETCH_BATCH * _MAX_CHUNK * 2)
        try:
            info = await sub.consumer_info()
            pending = int(info.num_pending or 0)
            if expected is not None and pending != expected:
                raise _ShortRead(f"{pending} of {expected} chunks present")
            out: list[bytes] = []
            while len(out) < pending:
                msgs = await sub.fetch(min(_FETCH_BATCH, pending - len(out)),
                                       timeout=_FETCH_TIMEOUT)
                out.extend(m.data for m in msgs)
            return out
        finally:
            # Ephemeral consumers also vanish after inactive_threshold; delete now to stay tidy.
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
            with contextlib.suppress(Exception):
                await self.js.delete_consumer(self.stream, sub._consumer)

    async def _infos(self) -> list[ObjectInfo]:
        """The latest meta of every object in the bucket (deleted tombstones excluded), as the
        stream leader has them (module doc: a consumer could read a lagging follower)."""
        await self.ensure()
        stream = await self.js.stream_info(self.stream, subjects_filter=f"$O.{self.bucket}.M.>")
        infos = []
        for subject in sorted(stream.state.subjects or ()):
            try:
                data = (await self.js.get_last_msg(self.stream, subject)).data
            except NotFoundError:
                continue  # deleted since the subject list was read
            try:
                info = ObjectInfo.from_response(json.loads(data or b""))
            except (ValueError, TypeError, KeyError):
                log.error("snapshot bucket %s holds an unreadable object meta", self.bucket)
                continue
            if not info.deleted:
                infos.append(info)
        return infos

    async def list(self) -> list[SnapshotMeta]:
        """Every stored snapshot, newest first. Objects without our meta are logged and left out."""
        metas = []
        for info in await self._infos():
            try:
                metas.append(_meta_of(info))
            except ValueError as exc:
                log.error("ignoring object in %s: %s", self.bucket, exc)
        return _newest_first(metas)

    async def _info(self, snapshot_id: str) -> ObjectInfo:
        obs = await self.ensure()
        try:
            return await obs.get_info(snapshot_id)
        except NotFoundError:
            raise SnapshotNotFound(snapshot_id) from None

    async def _read(self, snapshot_id: str) -> tuple[SnapshotMeta, bytes]:
        info = await self._info(snapshot_id)
        try:
            meta = _meta_of(info)
        except ValueError as exc:
            raise SnapshotCorrupt(snapshot_id, str(exc)) from None
        if not info.nuid or not info.size:
            raise SnapshotCorrupt(snapshot_id, "object has no content")
        try:
            chunks = await self._fetch_all(self._chunk_subject(info.nuid), DeliverPolicy.ALL,
                                           expected=info.chunks)
        except _ShortRead as exc:
            raise SnapshotCorrupt(snapshot_id, str(exc)) from None
        blob = b"".join(chunks)
        del chunks
        raw = await asyncio.to_thread(_unpack, snapshot_id, blob, info.digest, meta)
        return meta, raw

    async def get(self, snapshot_id: str) -> bytes:
        """The uncompressed state bytes, verified. Raises :class:`SnapshotCorrupt` on any
        mismatch or decompression error, :class:`SnapshotNotFound` when absent."""
        return (await self._read(snapshot_id))[1]

    async def meta(self, snapshot_id: str) -> SnapshotMeta:
        """The meta of one snapshot (no content read)."""
        info = await self._info(snapshot_id)
        try:
            return _meta_of(info)
        except ValueError as exc:
            raise SnapshotCorrupt(snapshot_id, str(exc)) from None

    async def load_newest_valid(self) -> LoadedSnapshot | None:
        """The newest snapshot that verifies, falling back to older ones. Each skipped snapshot
        gets an ERROR log line and an entry in ``result.skipped``. None when none verifies."""
        skipped: list[tuple[str, str]] = []
        for candidate in await self.list():
            sid = candidate.snapshot_id
            if candidate.format > SNAPSHOT_FORMAT:
                # Written by a newer release (a rollback): the one before it is at the purge
                # point (design.md §8), so falling back to it loses nothing.
                log.error("SKIPPING SNAPSHOT %s: state format %d is newer than this release "
                          "reads (up to %d); falling back to an older one", sid,
                          candidate.format, SNAPSHOT_FORMAT)
                skipped.append((sid, f"newer format {candidate.format}"))
                continue
            try:
                meta, raw = await self._read(sid)
            except SnapshotCorrupt as exc:
                log.error("SKIPPING CORRUPT SNAPSHOT %s (epoch %d, positions %s): %s; "
                          "falling back to an older one", sid, candidate.epoch,
                          candidate.positions, exc.why)
                skipped.append((sid, exc.why))
                continue
            except SnapshotNotFound:
                log.warning("snapshot %s vanished while loading (pruned?); trying older", sid)
                skipped.append((sid, "not found"))
                continue
            if skipped:
                log.error("restoring from older snapshot %s after skipping %d newer one(s)",
                          sid, len(skipped))
            return LoadedSnapshot(meta, raw, skipped)
        if skipped:
            log.error("no valid snapshot in %s: skipped %s", self.bucket, skipped)
        return None

    # --- deleting -----------------------------------------------------------------------------

    async def delete(self, snapshot_id: str) -> bool:
        """Remove one snapshot entirely (chunks, then meta). False when it was not there."""
        try:
            info = await self._info(snapshot_id)
        except SnapshotNotFound:
            return False
        if info.nuid:
            await self.js.purge_stream(self.stream, subject=self._chunk_subject(info.nuid))
        await self.js.purge_stream(self.stream, subject=self._meta_subject(snapshot_id))
        return True

    async def delete_all(self) -> int:
        """Remove every object in the bucket (orphaned chunks included); returns how many
        objects there were."""
        count = len(await self._infos())
        await self.js.purge_stream(self.stream)
        return count

    async def status(self) -> dict[str, Any]:
        """Bucket figures for admin/metrics: objects, bytes, replicas."""
        await self.ensure()
        info = await self.js.stream_info(self.stream)
        return {"bucket": self.bucket, "bytes": info.state.bytes,
                "messages": info.state.messages, "replicas": info.config.num_replicas}


class _ShortRead(JetrouterError):
    """Fewer chunks stored than the object meta says."""
