"""ensure_streams against real nats-server: idempotent, file storage, dedup window, replicas."""

from __future__ import annotations

import asyncio

from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import StorageType
from nats.js.errors import NoStreamResponseError

from eventlog.names import STREAM_KINDS, Names
from eventlog.streams import (
    cluster_size_hint,
    ensure_streams,
    recreate_stream,
    stream_bounds,
)
from natsops.server import NatsCluster, NatsServer
from snapshots.lease import LeaderLease
from snapshots.store import SnapshotStore
from tests.waiting import until

NAMES = Names("jr")


async def test_streams_have_file_storage_dedup_window_and_r1(nats_server: NatsServer, nats_connect):
    js = (await nats_connect(nats_server.url)).jetstream()
    infos = await ensure_streams(js, NAMES, duplicate_window=90.0)
    assert sorted(infos) == sorted(NAMES.stream(k) for k in STREAM_KINDS)
    for kind in STREAM_KINDS:
        config = (await js.stream_info(NAMES.stream(kind))).config
        assert config.subjects == [NAMES.subjects(kind)]
        assert config.storage == StorageType.FILE
        assert config.duplicate_window == 90.0
        assert config.num_replicas == 1
        assert not config.max_age  # events leave only by an explicit purge


async def test_second_and_concurrent_calls_change_nothing(nats_server: NatsServer, nats_connect):
    first = (await nats_connect(nats_server.url)).jetstream()
    before = await ensure_streams(first, NAMES)
    others = [(await nats_connect(nats_server.url)).jetstream() for _ in range(3)]
    results = await asyncio.gather(*(ensure_streams(js, NAMES) for js in [first, *others]))
    for result in results:
        for name, info in result.items():
            assert info.config == before[name].config
            assert info.created == before[name].created  # same stream, not re-created


async def test_changed_duplicate_window_is_updated_in_place(nats_server, nats_connect):
    js = (await nats_connect(nats_server.url)).jetstream()
    await ensure_streams(js, NAMES)
    await js.publish(NAMES.kv_subject("w1"), b"x")
    infos = await ensure_streams(js, NAMES, duplicate_window=30.0)
    kv = infos[NAMES.stream("kv")]
    assert kv.config.duplicate_window == 30.0
    assert await stream_bounds(js, NAMES.stream("kv")) == (1, 1)  # data kept


async def test_stream_bounds_follow_appends_and_purges(js):
    _, context = js
    stream = NAMES.stream("router")
    for i in range(5):
        await context.publish(NAMES.router_subject("r1"), str(i).encode())
    assert await stream_bounds(context, stream) == (1, 5)
    await context.purge_stream(stream, seq=4)
    assert await stream_bounds(context, stream) == (4, 5)


async def test_three_node_cluster_gets_r3(nats_cluster: NatsCluster, nats_connect):
    js = (await nats_connect(nats_cluster.url)).jetstream()
    infos = await ensure_streams(js, NAMES)
    again = await ensure_streams((await nats_connect(nats_cluster.urls[2])).jetstream(), NAMES)
    for name, info in infos.items():
        assert info.config.num_replicas == 3
        assert again[name].config == info.config
        cluster = (await js.stream_info(name)).cluster
        assert cluster is not None and cluster.leader


async def test_a_member_down_at_first_start_still_gets_r3(nats_cluster: NatsCluster,
                                                          nats_connect):
    """Three members configured, one down before any stream exists: the server a client
    connects to then gossips two members, but the streams are still created R3 (JetStream
    places a replica on the member that is down; it catches up when it is back), not R2 for
    good."""
    leader = nats_cluster.meta_leader()
    down = next(s for s in nats_cluster.servers if s.server_name != leader)
    down.kill()
    live = [s for s in nats_cluster.servers if s is not down]

    def leader_sees_it_gone() -> bool:
        for s in live:
            meta = (s.jsz() or {}).get("meta_cluster") or {}
            if meta.get("leader") == s.server_name:
                peer = next((r for r in meta.get("replicas") or []
                             if r.get("name") == down.server_name), None)
                return peer is not None and not peer.get("current")
        return False

    await until(leader_sees_it_gone, timeout=60, what="meta leader sees the member gone")
    nc = await nats_connect(live[0].url)
    assert len(nc._server_info.get("connect_urls") or []) < 3  # what the old guess went by
    js = nc.jetstream()
    infos = await asyncio.wait_for(ensure_streams(js, NAMES), 90)
    assert {info.config.num_replicas for info in infos.values()} == {3}
    # Two of three replicas are a quorum: the stream takes appends once its new Raft group has
    # elected a leader (no responders until then; seconds on a loaded machine).
    ack = await until(lambda: js.publish(NAMES.kv_subject("w0"), b"x", timeout=5,
                                         headers={"Nats-Msg-Id": "one"}), timeout=60,
                      what="an append acknowledged", interval=0.2,
                      tolerate=(NoStreamResponseError, NatsTimeoutError))
    assert ack.seq == 1


async def test_a_two_member_cluster_steps_down_once(tmp_path, nats_connect):
    """Two members: R3 cannot be placed, so the first creation steps down to R2 after its
    placement wait, and the connection remembers it for the streams after it."""
    with NatsCluster(2, base_dir=tmp_path / "two").start(timeout=90) as cluster:
        js = (await nats_connect(cluster.url)).jetstream()
        assert cluster_size_hint(js) == 3  # a cluster is never guessed smaller than three
        infos = await asyncio.wait_for(ensure_streams(js, NAMES), 90)
        assert {info.config.num_replicas for info in infos.values()} == {2}
        assert cluster_size_hint(js) == 2


async def test_start_up_lookups_wait_for_a_cluster_still_electing_its_meta_leader(
        tmp_path, nats_connect, caplog):
    """A process started before its cluster has a JetStream meta leader (one member of three up:
    no quorum) gets no answer to its stream lookups: the event streams', the leader lease
    bucket's, the snapshot bucket's. It asks again instead of failing its start-up, and
    creates them R3 once the other members are up."""
    cluster = NatsCluster(3, base_dir=tmp_path / "forming")  # started one member at a time
    try:
        first, *others = cluster.servers
        first.launch()
        first.wait_ready(30, jetstream=False)
        js = (await nats_connect(first.url)).jetstream(timeout=0.5)
        with caplog.at_level("WARNING", logger="eventlog.streams"):
            tasks = [asyncio.create_task(ensure_streams(js, NAMES)),
                     asyncio.create_task(LeaderLease(js, NAMES, "r0", ttl=3.0)._bucket()),
                     asyncio.create_task(SnapshotStore(js, NAMES).ensure())]
            await until(lambda: caplog.text.count("no answer from JetStream") >= 3
                        or any(t.done() for t in tasks), timeout=30,
                        what="every lookup left unanswered")
            assert not any(t.done() for t in tasks), tasks  # waiting, not failed
            for server in others:
                server.launch()
            infos, _, _ = await asyncio.wait_for(asyncio.gather(*tasks), 90)
        replicas = {(await js.stream_info(name)).config.num_replicas
                    for name in (f"KV_{NAMES.leases_bucket}", f"OBJ_{NAMES.snapshot_bucket}")}
    finally:
        cluster.cleanup()
    assert {info.config.num_replicas for info in infos.values()} == {3}
    assert replicas == {3}


async def test_a_lost_stream_is_recreated_numbering_on_from_where_it_was(
        nats_server: NatsServer, nats_connect) -> None:
    """NATS came back empty: the stream is created again starting at the sequence after the
    last one a replica applied, so no number is reused; a second creator finds it as made."""
    js = (await nats_connect(nats_server.url)).jetstream()
    info, created = await recreate_stream(js, NAMES, "router", 42)
    assert created and info.config.subjects == [NAMES.subjects("router")]
    assert info.state.first_seq == 42 and info.state.messages == 0
    ack = await js.publish(NAMES.router_subject("r0"), b"x")
    assert ack.seq == 42
    info, created = await recreate_stream(js, NAMES, "router", 7)
    assert not created and await stream_bounds(js, NAMES.stream("router")) == (42, 42)
