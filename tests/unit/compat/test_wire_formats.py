"""The format marking of stream messages and snapshots (eventlog/wire.py)."""

from __future__ import annotations

import msgspec
import pytest

from eventlog import events as ev
from eventlog import wire
from eventlog.memory import MemoryLog
from eventlog.names import CONTROL, KV, Names
from replicas.core.state import RouterState, StateConfig
from replicas.core.state_codec import SNAPSHOT_FORMAT
from replicas.runtime.replica import Replica, ReplicaConfig
from tests.waiting import until

pytestmark = pytest.mark.timeout(30)
NAMES = Names("jr")


def test_unmarked_and_current_messages_are_read_and_newer_ones_refused() -> None:
    assert wire.check_message(None, "S", 1) == 1
    assert wire.check_message({}, "S", 1) == 1
    assert wire.check_message({wire.FORMAT_HEADER: str(wire.EVENT_FORMAT)}, "S", 1) == \
        wire.EVENT_FORMAT
    with pytest.raises(wire.NewerFormat, match="newer jetrouter release"):
        wire.check_message({wire.FORMAT_HEADER: str(wire.EVENT_FORMAT + 1)}, "S", 1)
    for bad in ("x", "", "0"):
        with pytest.raises(wire.UnknownFormat):
            wire.check_message({wire.FORMAT_HEADER: bad}, "S", 1)


def test_a_message_is_marked_with_the_oldest_format_that_carries_it() -> None:
    e = ev.ReplicaLost("r", 1.0)
    assert wire.format_headers([e]) is None  # format 1 is never marked: no header to parse
    wire.INTRODUCED_IN[ev.ReplicaLost] = 7  # as a later release registers a new type
    try:
        assert wire.message_format([ev.PrefillCompleted("q", 1.0), e]) == 7
        assert wire.message_format([ev.PrefillCompleted("q", 1.0)]) == 1
        assert wire.format_headers([e]) == {wire.FORMAT_HEADER: "7"}
    finally:
        del wire.INTRODUCED_IN[ev.ReplicaLost]


def test_a_newer_snapshot_is_refused_not_guessed() -> None:
    doc = msgspec.msgpack.decode(RouterState().encode())
    doc["format"] = SNAPSHOT_FORMAT + 1
    with pytest.raises(wire.NewerFormat):
        RouterState.decode(msgspec.msgpack.encode(doc))


async def test_memory_log_marks_messages_and_its_reader_stops_before_a_newer_one() -> None:
    log = MemoryLog()
    await log.ensure_streams(NAMES)
    subject = NAMES.control_subject("threshold")
    await log.append(subject, [ev.SnapshotThresholdSet(10, 1.0)], "a")
    newer = {wire.FORMAT_HEADER: str(wire.EVENT_FORMAT + 1)}
    await log.append_raw(subject, ev.encode_batch([ev.SnapshotThresholdSet(20, 2.0)]), "b", newer)
    last = await log.last_message(NAMES.stream(CONTROL), subject)
    assert last is not None and last.headers is not None
    reader = log.reader(NAMES.stream(CONTROL))
    first = await reader.__anext__()
    assert first[0] == 1
    with pytest.raises(wire.NewerFormat):
        await reader.__anext__()
    assert reader.last_seq == 1 and reader.malformed == 0
    with pytest.raises(wire.NewerFormat):  # and it stays there
        await reader.__anext__()


async def test_a_replica_blocks_the_stream_and_turns_not_ready_instead_of_diverging() -> None:
    log = MemoryLog()
    await log.ensure_streams(NAMES)
    cfg = ReplicaConfig("r0", "", state=StateConfig(block_size=16), seed=7, durable=False,
                        canary_interval=0)
    replica = Replica(cfg, log=log)
    await replica.start()
    try:
        await replica.wait_ready(10)
        control = NAMES.control_subject("threshold")
        await log.append(control, [ev.SnapshotThresholdSet(10, 1.0)], "a")
        newer = {wire.FORMAT_HEADER: str(wire.EVENT_FORMAT + 1)}
        await log.append_raw(control, ev.encode_batch([ev.SnapshotThresholdSet(20, 2.0)]), "b",
                             newer)
        await log.append(control, [ev.SnapshotThresholdSet(30, 3.0)], "c")
        await until(replica.blocked_streams, what="control blocked", timeout=10)
        assert set(replica.blocked_streams()) == {CONTROL}
        assert "newer jetrouter release" in replica.blocked_streams()[CONTROL]
        assert not replica.ready
        assert replica.state.positions[CONTROL] == 1 and replica.state.snapshot_threshold == 10
        # The other streams go on.
        reg = ev.WorkerRegistered("w", "http://w", "m", 16, 100, 100, 4.0)
        seq = await log.append(NAMES.kv_subject("w"), [reg], "w.reg")
        await replica.wait_applied(KV, seq, timeout=10)
        assert replica.state.positions[CONTROL] == 1
    finally:
        await replica.stop()
