"""`Replica` built directly on the in-memory event log: no server, no subprocess, milliseconds.

What a replica does with the log (replay, route, record, converge with a peer) is the same on
JetStream; the contract suite (tests/contracts/) holds the two logs to that."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from eventlog import kv_decode
from eventlog.events import (
    BlocksStored,
    RequestFinished,
    RequestRouted,
    WorkerRegistered,
    decode_batch,
)
from eventlog.hashing import tokens_hashes
from eventlog.memory import MemoryLog
from eventlog.names import KV, ROUTER, Names
from replicas.core import index_kernel
from replicas.core.state import StateConfig
from replicas.runtime.replica import DecisionNotRecorded, Replica, ReplicaConfig, RouteRequest
from tests.waiting import until

pytestmark = pytest.mark.timeout(30)

BS = 16
NAMES = Names("jr")
PROMPT = list(range(1000, 1000 + 6 * BS))
MODEL = "tiny"

StartReplica = Callable[[str], Awaitable[Replica]]


def config(replica_id: str) -> ReplicaConfig:
    return ReplicaConfig(replica_id, "", state=StateConfig(block_size=BS), seed=7,
                         durable=False, canary_interval=0)


async def register(log: MemoryLog, worker_id: str, cached_blocks: int) -> int:
    """A worker that caches the first ``cached_blocks`` blocks of PROMPT; the KV sequence."""
    subject = NAMES.kv_subject(worker_id)
    await log.append(subject, [WorkerRegistered(worker_id, f"http://{worker_id}", MODEL, BS,
                                                1000, 8192, 1.0)], f"{worker_id}.reg")
    hashes = tokens_hashes(PROMPT[:cached_blocks * BS], BS)
    stored = BlocksStored(worker_id, 1, 0, None, [(9000 + i, h) for i, h in enumerate(hashes)],
                          1.0)
    return await log.append(subject, [stored], f"{worker_id}.1")


@pytest.fixture
async def log() -> MemoryLog:
    memory = MemoryLog()
    await memory.ensure_streams(NAMES)
    return memory


@pytest.fixture
async def start_replica(log: MemoryLog) -> AsyncIterator[StartReplica]:
    started: list[Replica] = []

    async def start(replica_id: str) -> Replica:
        replica = Replica(config(replica_id), log=log)
        started.append(replica)
        await replica.start()
        await replica.wait_ready(10)
        return replica

    yield start
    for replica in started:
        with contextlib.suppress(Exception):
            await replica.stop()


async def router_events(log: MemoryLog, n: int) -> list[object]:
    reader = log.reader(NAMES.stream(ROUTER))
    out: list[object] = []
    try:
        async with asyncio.timeout(10):
            async for _, events in reader:
                out.extend(events)
                if len(out) >= n:
                    return out
    finally:
        await reader.close()
    return out


async def test_replays_the_log_then_routes_to_the_worker_with_the_longest_prefix(
        log: MemoryLog, start_replica: StartReplica) -> None:
    await register(log, "short", cached_blocks=1)
    await register(log, "long", cached_blocks=4)
    replica = await start_replica("r1")
    assert set(replica.state.workers) == {"short", "long"}  # replayed before ready

    routed = await replica.route(RouteRequest("q1", MODEL, PROMPT))

    assert (routed.worker_id, routed.worker_url, routed.overlap_blocks) == (
        "long", "http://long", 4)
    recorded = await router_events(log, 1)
    assert isinstance(recorded[0], RequestRouted)
    assert (recorded[0].request_id, recorded[0].worker_id, recorded[0].replica_id) == (
        "q1", "long", "r1")


async def test_a_compact_replica_reads_long_kv_messages_as_packed_words(log: MemoryLog) -> None:
    """With the compact index's kernel, the replica's KV reader leaves a long message's blocks as
    u64 words (eventlog/kv_decode.py), and routes by them as by tuples."""
    prompt = list(range(5000, 5000 + 30 * BS))
    hashes = tokens_hashes(prompt, BS)
    await log.append(NAMES.kv_subject("w"), [
        WorkerRegistered("w", "http://w", MODEL, BS, 1000, 8192, 1.0),
        BlocksStored("w", 1, 0, None, [(9000 + i, h) for i, h in enumerate(hashes)], 1.0)], "w.1")
    replica = Replica(ReplicaConfig("r1", "", state=StateConfig(block_size=BS,
                                                                index_form="compact"),
                                    seed=7, durable=False, canary_interval=0), log=log)
    await replica.start()
    try:
        await replica.wait_ready(10)
        packs = index_kernel.active() is not None and kv_decode.AVAILABLE
        reader = replica.follower._readers[KV]
        assert reader.decode is (kv_decode.decode_kv_batch if packs  # type: ignore[attr-defined]
                                 else decode_batch)
        routed = await replica.route(RouteRequest("q1", MODEL, prompt))
        assert (routed.worker_id, routed.overlap_blocks) == ("w", 30)
    finally:
        await replica.stop()


async def test_a_decision_counts_at_once_and_leaves_the_overlay_once_applied(
        log: MemoryLog, start_replica: StartReplica) -> None:
    seq = await register(log, "w1", cached_blocks=0)
    replica = await start_replica("r1")
    await replica.wait_applied(KV, seq)
    await replica.route(RouteRequest("q1", MODEL, PROMPT))
    await replica.wait_applied(ROUTER, 1)
    assert replica.pending_decisions() == 0  # reconciled: the log's copy counts now
    assert replica.state.load.active_prefill_tokens(("w1", 0)) == len(PROMPT)

    replica.finished("q1", "ok", output_tokens=5)
    await replica.wait_applied(ROUTER, 2)
    assert replica.state.load.active_prefill_tokens(("w1", 0)) == 0
    finished = (await router_events(log, 2))[1]
    assert isinstance(finished, RequestFinished) and finished.outcome == "ok"


async def test_two_replicas_on_one_log_converge_to_equal_digests(
        log: MemoryLog, start_replica: StartReplica) -> None:
    await register(log, "w1", cached_blocks=2)
    await register(log, "w2", cached_blocks=3)
    first = await start_replica("r1")
    for i in range(6):
        await first.route(RouteRequest(f"a{i}", MODEL, PROMPT[: (i + 1) * BS]))
    second = await start_replica("r2")  # joins late: replays what r1 recorded
    for i in range(6):
        await second.route(RouteRequest(f"b{i}", MODEL, PROMPT))
        first.finished(f"a{i}", "ok", output_tokens=i)
    for i in range(3):
        second.finished(f"b{i}", "ok", output_tokens=i)

    # Every decision and finish above is appended (the finishes in the background): wait until
    # the router stream holds all 6 + 6 + 6 + 3 and both replicas applied it.
    await until(lambda: log.bounds(NAMES.stream(ROUTER)), lambda b: b[1] == 21, timeout=10,
                what="every decision and finish on the router stream")
    for replica in (first, second):
        await replica.wait_applied(ROUTER, 21)
    assert first.state.positions == second.state.positions
    assert first.state.digests() == second.state.digests()
    assert first.state.load.replicas() == second.state.load.replicas() == {"r2"}


async def test_a_decision_the_log_refuses_is_not_served_and_does_not_count(
        log: MemoryLog, start_replica: StartReplica) -> None:
    await register(log, "w1", cached_blocks=1)
    replica = await start_replica("r1")
    await log.ensure_streams(NAMES, max_bytes=0, kinds=(ROUTER,))  # the router stream is full

    routed = await replica.route(RouteRequest("q1", MODEL, PROMPT))
    with pytest.raises(DecisionNotRecorded):
        await replica.recorded(routed)

    assert replica.pending_decisions() == 0
    assert replica.decision_log.failures == 1
    assert await log.bounds(NAMES.stream(ROUTER)) == (0, 0)


async def test_a_malformed_message_is_counted_and_skipped(
        log: MemoryLog, start_replica: StartReplica) -> None:
    await log.append_raw(NAMES.kv_subject("w1"), b"\x93 not a batch", "junk")
    seq = await register(log, "w1", cached_blocks=1)
    replica = await start_replica("r1")
    await replica.wait_applied(KV, seq)
    assert replica.malformed_counts()[KV] == 1
    assert set(replica.state.workers) == {"w1"}


def test_durability_needs_jetstream() -> None:
    with pytest.raises(ValueError, match="durab"):
        Replica(ReplicaConfig("r1", ""), log=MemoryLog())
