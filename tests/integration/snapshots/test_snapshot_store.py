"""SnapshotStore against a real nats-server: round trip, pruning, corruption and fallback,
delete, a 50 MB blob, and a real encoded RouterState."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import logging
import os
import random
import signal
import zlib
from collections.abc import Awaitable, Callable

import pytest
from nats.js import JetStreamContext
from nats.js.api import ObjectInfo
from nats.js.errors import NoStreamResponseError
from nats.js.kv import MSG_ROLLUP_SUBJECT

from eventlog.names import Names
from natsops.server import NatsCluster
from replicas.core.state import RouterState, StateConfig
from snapshots.store import SnapshotCorrupt, SnapshotNotFound, SnapshotStore
from tests.eventgen import worker_history

NAMES = Names("jr")
POSITIONS = {"kv": 10, "router": 4, "control": 2}

Connect = Callable[[str], Awaitable[object]]


@pytest.fixture
async def store(js: tuple[object, JetStreamContext]) -> SnapshotStore:
    return SnapshotStore(js[1], NAMES, keep=3)


async def corrupt_blob(js: JetStreamContext, names: Names, snapshot_id: str,
                       content: bytes = b"this is not a zlib stream", *,
                       fix_digest: bool = True) -> None:
    """Test-only: replace a snapshot's stored bytes with ``content``, keeping its name and its
    jetrouter meta. With ``fix_digest`` the object-store digest/size are rewritten to match the
    new content, so only jetrouter's own checks (decompression, sha256 of the state) notice;
    without it the object store's digest no longer matches the chunks."""
    store = SnapshotStore(js, names)
    obs = await store.ensure()
    info = await obs.get_info(snapshot_id)
    chunk_subject = f"$O.{store.bucket}.C.{info.nuid}"
    await js.purge_stream(store.stream, subject=chunk_subject)
    await js.publish(chunk_subject, content)
    if fix_digest:
        doc = info.as_dict()
        doc["digest"] = "SHA-256=" + base64.urlsafe_b64encode(
            hashlib.sha256(content).digest()).decode()
        doc["size"] = len(content)
        doc["chunks"] = 1
        name_token = base64.urlsafe_b64encode(snapshot_id.encode()).decode()
        await js.publish(f"$O.{store.bucket}.M.{name_token}", json.dumps(doc).encode(),
                         headers={"Nats-Rollup": MSG_ROLLUP_SUBJECT})
        assert ObjectInfo.from_response(json.loads(json.dumps(doc))).headers == info.headers


async def corrupt(store: SnapshotStore, snapshot_id: str, content: bytes, *,
                  fix_digest: bool) -> None:
    await corrupt_blob(store.js, store.names, snapshot_id, content, fix_digest=fix_digest)


async def put(store: SnapshotStore, data: bytes, epoch: int = 0, format: int = 2,
              **positions: int):
    """Store ``data`` as a state of ``format`` (2, as the reference form writes: compressed)."""
    return await store.put(data, positions={**POSITIONS, **positions}, epoch=epoch,
                           created_by="r1", trigger="test", format=format)


async def test_put_list_get_round_trip(store: SnapshotStore) -> None:
    data = b"state-" * 1000
    meta = await put(store, data, epoch=2)
    assert meta.snapshot_id.startswith("snap-000002-")
    assert meta.size == len(data)
    assert meta.sha256 == hashlib.sha256(data).hexdigest()
    assert meta.positions == POSITIONS and meta.epoch == 2
    assert (meta.created_by, meta.trigger) == ("r1", "test")
    assert 0 < meta.stored_size < len(data)  # compressed

    listed = await store.list()
    assert listed == [meta]  # the meta survives the trip through the object headers
    assert await store.get(meta.snapshot_id) == data
    assert await store.meta(meta.snapshot_id) == meta
    loaded = await store.load_newest_valid()
    assert loaded is not None
    assert loaded[0] == meta and loaded[1] == data and loaded.skipped == []


async def test_a_put_no_stream_answers_yet_is_tried_again_and_stored_once(
        store: SnapshotStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """Right after the bucket's stream is created on a cluster, the server this client talks to
    may not know the stream's leader yet: the first chunk's publish finds no responders. The put
    tries again under the same id, and the snapshot is stored once."""
    await store.ensure()
    publish = store.js.publish
    refused: list[str] = []

    async def not_yet(subject: str, payload: bytes = b"", **kwargs: object) -> object:
        if not refused:
            refused.append(subject)
            raise NoStreamResponseError
        return await publish(subject, payload, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(store.js, "publish", not_yet)
    meta = await put(store, b"stored once")
    assert refused and refused[0].startswith(f"$O.{store.bucket}.C.")
    assert [m.snapshot_id for m in await store.list()] == [meta.snapshot_id]
    assert await store.get(meta.snapshot_id) == b"stored once"
    assert (await store.status())["messages"] == 2  # one chunk and one meta: nothing left over


async def test_empty_store(store: SnapshotStore) -> None:
    assert await store.list() == []
    assert await store.load_newest_valid() is None
    with pytest.raises(SnapshotNotFound):
        await store.get("snap-000000-0000000000000-000000")
    assert await store.delete("snap-000000-0000000000000-000000") is False
    assert await store.delete_all() == 0


async def test_keep_prunes_the_oldest(store: SnapshotStore) -> None:
    metas = [await put(store, f"state {i}".encode() * 50, kv=10 + i) for i in range(5)]
    listed = await store.list()
    assert [m.snapshot_id for m in listed] == [m.snapshot_id for m in reversed(metas[2:])]
    for gone in metas[:2]:
        with pytest.raises(SnapshotNotFound):
            await store.get(gone.snapshot_id)
    assert await store.get(metas[-1].snapshot_id) == b"state 4" * 50
    # Nothing left of the pruned ones: no tombstones pile up in the bucket.
    status = await store.status()
    assert status["messages"] == 3 * 2  # one chunk + one meta per kept snapshot


async def test_newer_epoch_sorts_first(store: SnapshotStore) -> None:
    old = await put(store, b"a" * 100, epoch=1)
    new = await put(store, b"b" * 100, epoch=2)
    assert [m.snapshot_id for m in await store.list()] == [new.snapshot_id, old.snapshot_id]


@pytest.mark.parametrize("how", ["garbage_chunks", "not_zlib", "other_state"])
async def test_corrupt_newest_falls_back(store: SnapshotStore, how: str,
                                         caplog: pytest.LogCaptureFixture) -> None:
    older = await put(store, b"older state" * 100, kv=5)
    newest = await put(store, b"newest state" * 100, kv=9)
    if how == "garbage_chunks":  # chunks replaced, object digest left as it was
        await corrupt(store, newest.snapshot_id, b"\x00" * 300, fix_digest=False)
    elif how == "not_zlib":
        await corrupt_blob(store.js, store.names, newest.snapshot_id)  # as the chaos tests do
    else:  # valid zlib of the right length, different bytes: only the state sha256 catches it
        other = b"newest stat!" * 100
        await corrupt(store, newest.snapshot_id, zlib.compress(other), fix_digest=True)

    with pytest.raises(SnapshotCorrupt) as caught:
        await store.get(newest.snapshot_id)
    assert caught.value.snapshot_id == newest.snapshot_id

    caplog.set_level(logging.ERROR, logger="jetrouter.snapshots")
    loaded = await store.load_newest_valid()
    assert loaded is not None
    meta, data = loaded[0], loaded[1]
    assert meta.snapshot_id == older.snapshot_id and meta.positions["kv"] == 5
    assert data == b"older state" * 100
    assert [sid for sid, _ in loaded.skipped] == [newest.snapshot_id]
    assert any(newest.snapshot_id in r.getMessage() and r.levelno >= logging.ERROR
               for r in caplog.records)


async def test_missing_chunks_are_corrupt(store: SnapshotStore) -> None:
    meta = await put(store, random.Random(3).randbytes(300_000))
    info = await (await store.ensure()).get_info(meta.snapshot_id)
    await store.js.purge_stream(store.stream, subject=f"$O.{store.bucket}.C.{info.nuid}")
    with pytest.raises(SnapshotCorrupt, match="chunks"):
        await store.get(meta.snapshot_id)
    assert await store.load_newest_valid() is None


async def test_delete_and_delete_all(store: SnapshotStore) -> None:
    a = await put(store, b"a" * 10)
    b = await put(store, b"b" * 10)
    assert await store.delete(a.snapshot_id) is True
    assert [m.snapshot_id for m in await store.list()] == [b.snapshot_id]
    await put(store, b"c" * 10)
    assert await store.delete_all() == 2
    assert await store.list() == []
    assert (await store.status())["messages"] == 0
    # The bucket still works after a full purge.
    d = await put(store, b"d" * 10)
    assert await store.get(d.snapshot_id) == b"d" * 10


async def test_two_stores_share_the_bucket(js: tuple[object, JetStreamContext]) -> None:
    first, second = SnapshotStore(js[1], NAMES), SnapshotStore(js[1], NAMES)
    meta = await put(first, b"shared" * 10)
    assert await second.get(meta.snapshot_id) == b"shared" * 10
    other_ns = SnapshotStore(js[1], Names("other"))
    assert await other_ns.list() == []


async def test_fifty_megabyte_blob_round_trip(store: SnapshotStore) -> None:
    data = random.Random(50).randbytes(50_000_000)  # incompressible: the worst case
    meta = await put(store, data)
    assert meta.size == len(data)
    loaded = await store.load_newest_valid()
    assert loaded is not None and loaded[1] == data


async def test_real_router_state_round_trip(store: SnapshotStore) -> None:
    rng = random.Random(7)
    state = RouterState()
    seq = 0
    for w in range(4):
        for batch in worker_history(rng, f"w{w}", 200):
            seq += 1
            state.apply("kv", seq, batch)
    blob = state.encode()
    meta = await store.put(blob, positions=dict(state.positions), epoch=state.epoch,
                           created_by="r1", trigger="threshold", format=state.snapshot_format)
    loaded = await store.load_newest_valid()
    assert loaded is not None and loaded[0] == meta
    assert meta.compression == "zlib" and meta.stored_size < meta.size
    restored = RouterState.decode(loaded[1])
    assert restored.digests() == state.digests()
    assert restored.positions == state.positions == meta.positions


def compact_state(workers: int = 4) -> RouterState:
    rng = random.Random(11)
    state = RouterState(StateConfig(index_form="compact"))
    seq = 0
    for w in range(workers):
        for batch in worker_history(rng, f"w{w}", 200):
            seq += 1
            state.apply("kv", seq, batch)
    return state


async def test_the_compact_forms_format_is_stored_as_it_is(store: SnapshotStore) -> None:
    """State format 6 (the compact index's arrays, random hashes) is not compressed: the stored
    object is the state's bytes, read back with one digest pass, and restores equal."""
    state = compact_state()
    assert state.snapshot_format == 6
    meta = await store.put(state.encoder(), positions=dict(state.positions), epoch=0,
                           created_by="r1", trigger="test", format=state.snapshot_format)
    assert meta.compression == "none" and meta.stored_size == meta.size
    assert meta.format == 6
    loaded = await store.load_newest_valid()
    assert loaded is not None and loaded.meta == meta and loaded.skipped == []
    assert hashlib.sha256(loaded.data).hexdigest() == meta.sha256
    restored = RouterState.decode(loaded.data, state.config)
    assert restored.digests() == state.digests()


@pytest.mark.parametrize("how", ["garbage_chunks", "other_state", "a_flipped_bit"])
async def test_a_corrupt_uncompressed_snapshot_is_refused_and_an_older_one_loads(
        store: SnapshotStore, how: str) -> None:
    state = compact_state()
    config = state.config
    older = await store.put(state.encode(), positions=dict(state.positions), epoch=0,
                            created_by="r1", trigger="test", format=5)
    state.apply("kv", state.positions["kv"] + 1, [])  # one message later: a newer snapshot
    raw = state.encode()
    newest = await store.put(raw, positions=dict(state.positions), epoch=0,
                             created_by="r1", trigger="test", format=5)
    if how == "garbage_chunks":  # chunks replaced, object digest left as it was
        await corrupt(store, newest.snapshot_id, b"\x00" * 300, fix_digest=False)
    elif how == "other_state":  # another state's bytes, digest rewritten: sizes differ
        await corrupt(store, newest.snapshot_id, compact_state(3).encode(), fix_digest=True)
    else:  # one bit of the same length, digest rewritten: only the state's sha256 catches it
        flipped = bytearray(raw)
        flipped[len(raw) // 2] ^= 1
        await corrupt(store, newest.snapshot_id, bytes(flipped), fix_digest=True)
    with pytest.raises(SnapshotCorrupt, match=r"digest|size|sha256"):
        await store.get(newest.snapshot_id)
    loaded = await store.load_newest_valid()
    assert loaded is not None and loaded.meta.snapshot_id == older.snapshot_id
    assert [sid for sid, _ in loaded.skipped] == [newest.snapshot_id]
    assert RouterState.decode(loaded.data, config).positions == older.positions


async def test_cluster_bucket_is_replicated_and_readable_from_any_node(
        nats_cluster: NatsCluster, nats_connect: Connect) -> None:
    writer_nc = await nats_connect(nats_cluster[0].url)
    reader_nc = await nats_connect(nats_cluster[2].url)
    writer = SnapshotStore(writer_nc.jetstream(), NAMES)  # type: ignore[attr-defined]
    reader = SnapshotStore(reader_nc.jetstream(), NAMES)  # type: ignore[attr-defined]
    data = random.Random(9).randbytes(3_000_000)
    meta = await put(writer, data)
    assert (await reader.status())["replicas"] == 3
    loaded = await reader.load_newest_valid()
    assert loaded is not None and loaded[0] == meta and loaded[1] == data


async def test_listing_is_answered_by_the_stream_leader_alone(
        nats_cluster: NatsCluster, nats_connect: Connect) -> None:
    """The listing must not depend on a consumer, which the server may place on a follower
    that lacks the newest write: with both followers paused it still lists from the leader."""
    first = await nats_connect(nats_cluster[0].url)
    writer = SnapshotStore(first.jetstream(), NAMES)  # type: ignore[attr-defined]
    meta = await put(writer, b"listed")
    info = await writer.js.stream_info(writer.stream)
    leader = next(s for s in nats_cluster if s.server_name == info.cluster.leader)
    followers = [s for s in nats_cluster if s is not leader]
    nc = await nats_connect(leader.url)
    store = SnapshotStore(nc.jetstream(timeout=2.0), NAMES)  # type: ignore[attr-defined]
    await store.ensure()
    for server in followers:
        assert server.proc is not None
        os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        listed = await asyncio.wait_for(store.list(), 30)
    finally:
        for server in followers:
            assert server.proc is not None
            os.kill(server.proc.pid, signal.SIGCONT)
    assert [m.snapshot_id for m in listed] == [meta.snapshot_id]
