"""SQL projections (snapshot catalog, decision ledger) on real SQLite files, plus one feed from a
real nats-server stream. Events are built directly; no mocks."""

from __future__ import annotations

import asyncio
import random
import sqlite3
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection

from eventlog import events as ev
from eventlog.appender import Appender
from eventlog.names import CONTROL, KV, ROUTER, Names, split_hop
from eventlog.streams import ensure_streams
from snapshots.db import Tracking, default_url
from snapshots.projections import ProjectionFeeder, Projections
from tests.waiting import until

Message = tuple[int, Sequence[ev.Event]]


def routed(rid: str, ts: float, *, replica: str = "r1", worker: str = "w1",
           candidates: list[ev.CandidateRow] | None = None, overlap: int = 2) -> ev.RequestRouted:
    return ev.RequestRouted(
        request_id=rid, replica_id=replica, worker_id=worker, dp_rank=0, isl_tokens=100,
        block_seq_hashes=[1, 2, 3], overlap_blocks=overlap, expected_osl=32, priority=0, ts=ts,
        candidates=candidates if candidates is not None else [
            (worker, 0, overlap, 4.25, 7.0, 11.25, False), ("w9", 0, 0, 6.5, 3.0, 9.5, True),
        ],
        model="m",
    )


def taken(sid: str, ts: float, size: int = 1000) -> ev.SnapshotTaken:
    return ev.SnapshotTaken(snapshot_id=sid, positions={"kv": 10, "router": 20, "control": 3},
                            size=size, sha256="ab" * 32, created_by="r1", trigger="threshold",
                            ts=ts)


async def opened(path: Path, **kwargs: Any) -> Projections:
    projections = Projections(default_url(path), **kwargs)
    await projections.start()
    return projections


def dump(db_file: Path) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every table, ordered: what 'identical' means for a rebuild."""
    with sqlite3.connect(db_file) as conn:
        tables = [r[0] for r in conn.execute(
            "SELECT name FROM sqlite_master WHERE type='table' ORDER BY name")]
        return {t: conn.execute(f"SELECT * FROM {t} ORDER BY 1").fetchall() for t in tables}




# --- exactly once, resume, crash consistency ---------------------------------------------------


async def test_same_seq_twice_gives_one_row(tmp_path: Path) -> None:
    p = await opened(tmp_path)
    try:
        assert await p.apply(ROUTER, 1, [routed("a", 10.0)]) is True
        assert await p.apply(ROUTER, 1, [routed("a", 10.0)]) is False
        # A lower seq is a duplicate too, even carrying a different event.
        assert await p.apply(ROUTER, 0, [routed("b", 11.0)]) is False
        assert await p.apply_many(ROUTER, [(1, [routed("a", 10.0)]), (2, [routed("c", 12.0)])]) == 1
        assert (await p.stats())["ledger_rows"] == 2
        assert await p.request("b") is None
        assert await p.position(ROUTER) == 2
        assert await p.position(CONTROL) == 0
        with pytest.raises(ValueError, match="no projection"):
            await p.apply(KV, 1, [])
    finally:
        await p.close()


async def test_resumes_from_tracking_position_after_reopen(tmp_path: Path) -> None:
    p = await opened(tmp_path)
    await p.apply_many(ROUTER, [(1, [routed("a", 1.0)]), (2, [routed("b", 2.0)])])
    await p.apply(CONTROL, 7, [taken("s1", 3.0)])
    await p.close()

    p = await opened(tmp_path)
    try:
        assert await p.position(ROUTER) == 2
        assert await p.position(CONTROL) == 7
        assert await p.apply(ROUTER, 2, [ev.RequestFinished("b", "ok", 5, 4.0)]) is False
        assert (await p.request("b"))["finished_ts"] is None  # type: ignore[index]
        assert await p.apply(ROUTER, 3, [ev.RequestFinished("b", "ok", 5, 4.0)]) is True
        assert (await p.request("b"))["outcome"] == "ok"  # type: ignore[index]
        assert [s["snapshot_id"] for s in await p.snapshots()] == ["s1"]
    finally:
        await p.close()


async def test_reached_follows_another_processs_writes_or_gives_up(tmp_path: Path) -> None:
    """The admin listing's wait: positions written through another connection to the same
    database (the projector child's) are seen; past ``within`` the answer is False."""
    writer = await opened(tmp_path)
    reader = await opened(tmp_path)
    try:
        assert await reader.reached(CONTROL, 0, 0.0) is True
        assert await reader.reached(CONTROL, 7, 0.05) is False
        waiting = asyncio.create_task(reader.reached(CONTROL, 7, 60.0))
        await writer.apply(CONTROL, 7, [taken("s1", 3.0)])
        assert await waiting is True
        assert [s["snapshot_id"] for s in await reader.snapshots()] == ["s1"]
    finally:
        await reader.close()
        await writer.close()


class FailsBeforeCommit(Projections):
    """Views written, then a failure before the tracking row and the commit."""

    async def _write_tracking(self, conn: AsyncConnection, track: Tracking) -> None:
        raise RuntimeError("injected crash between view write and commit")


async def test_failure_inside_transaction_keeps_neither_rows_nor_position(tmp_path: Path) -> None:
    p = await opened(tmp_path)
    await p.apply(ROUTER, 1, [routed("old", 1.0)])
    await p.close()

    broken = FailsBeforeCommit(default_url(tmp_path))
    await broken.start()
    try:
        with pytest.raises(RuntimeError, match="injected"):
            await broken.apply_many(ROUTER, [(2, [routed("a", 2.0)]),
                                             (3, [ev.RequestFinished("old", "ok", 3, 3.0)])])
        with pytest.raises(RuntimeError, match="injected"):
            await broken.apply(CONTROL, 1, [taken("s1", 2.0)])
    finally:
        await broken.close()

    p = await opened(tmp_path)
    try:
        # Database-level failures: a NOT NULL column violated by the second event of the batch,
        # after the first event's row was written in the same transaction.
        bad_routed = ev.RequestRouted("bad", "r1", None, 0, 1, [], 0, 1, 0, 5.0)  # type: ignore[arg-type]
        with pytest.raises(IntegrityError):
            await p.apply_many(ROUTER, [(2, [routed("a", 2.0)]), (3, [bad_routed])])
        with pytest.raises(IntegrityError):
            await p.apply(CONTROL, 1, [taken("s1", 2.0), taken("s2", 2.5, size=None)])  # type: ignore[arg-type]

        assert await p.position(ROUTER) == 1
        assert await p.position(CONTROL) == 0
        assert await p.request("a") is None
        assert (await p.request("old"))["finished_ts"] is None  # type: ignore[index]
        assert await p.snapshots() == []
        # And the same messages, well-formed, apply afterwards.
        assert await p.apply_many(ROUTER, [(2, [routed("a", 2.0)]),
                                           (3, [ev.RequestFinished("old", "ok", 3, 3.0)])]) == 2
        assert (await p.request("old"))["outcome"] == "ok"  # type: ignore[index]
    finally:
        await p.close()


# --- rebuild by replay ---------------------------------------------------------------------------


def history(rng: random.Random, n: int) -> list[Message]:
    """A router stream with hops, duplicates, out-of-order updates, lost replicas and a clock
    that runs past the retention bound."""
    msgs: list[Message] = []
    open_ids: list[str] = []
    early: list[str] = []
    ts = 1000.0
    seq = 0
    for i in range(n):
        ts += rng.uniform(0.0, 2.0)
        batch: list[ev.Event] = []
        for _ in range(rng.randint(1, 4)):
            roll = rng.random()
            if roll < 0.4 or not open_ids:
                # Sometimes an id whose update reached the stream before its decision.
                rid = early.pop() if early and rng.random() < 0.5 else f"q{i}-{len(batch)}"
                replica = rng.choice(["r1", "r2", "r3"])
                cands = [(f"w{k}", 0, rng.randint(0, 5), rng.random() * 9, rng.random() * 9,
                          rng.random() * 20, rng.random() < 0.2) for k in range(rng.randint(1, 4))]
                batch.append(routed(rid, ts - rng.uniform(0, 3), replica=replica,
                                    worker=cands[0][0], candidates=cands))
                open_ids.append(rid)
            elif roll < 0.6:
                batch.append(ev.PrefillCompleted(rng.choice(open_ids), ts))
            elif roll < 0.8:
                rid = open_ids.pop(rng.randrange(len(open_ids)))
                outcome = rng.choice(["ok", "ok", "error", "migrated"])
                batch.append(ev.RequestFinished(rid, outcome, rng.randint(0, 99), ts))
                if outcome == "migrated":
                    base, hop = split_hop(rid)
                    batch.append(routed(f"{base}~{hop + 1}", ts, replica="r2"))
                    open_ids.append(f"{base}~{hop + 1}")
            elif roll < 0.85:
                batch.append(ev.ReplicaLost(rng.choice(["r1", "r2", "r3"]), ts))
            elif roll < 0.9:
                early.append(f"early{i}")
                batch.append(ev.RequestFinished(early[-1], "ok", 1, ts))
            else:  # a decision delivered again (a retry outside the dedup window)
                dup = next((e for _, b in msgs[-5:] for e in b
                            if isinstance(e, ev.RequestRouted)), None)
                if dup is not None:
                    batch.append(dup)
        seq += rng.randint(1, 2)  # gaps: other messages (or purges) in the stream
        msgs.append((seq, batch))
    return msgs


def chunked(rng: random.Random, msgs: list[Message]) -> list[list[Message]]:
    out: list[list[Message]] = []
    i = 0
    while i < len(msgs):
        k = rng.choice([1, 1, 2, 7, 50])
        out.append(msgs[i:i + k])
        i += k
    return out


async def test_rebuild_after_deleting_database_is_identical(tmp_path: Path) -> None:
    rng = random.Random(7)
    router = history(rng, 600)
    control: list[Message] = [(1, [taken("s1", 1001.0)]), (2, [taken("s2", 1000.5)]),
                              (4, [ev.StateReset(2, "test", 1002.0)]), (5, [taken("s3", 1003.0)])]
    retention = 400.0  # the history spans ~600 s of event time: the oldest rows age out
    first = tmp_path / "a"
    p = await opened(first, ledger_retention=retention)
    for seq, batch in router:  # one message per transaction, re-applying some of them
        await p.apply(ROUTER, seq, batch)
        if rng.random() < 0.1:
            assert await p.apply(ROUTER, seq, batch) is False
    for seq, batch in control:
        await p.apply(CONTROL, seq, batch)
    stats = await p.stats()
    await p.close()
    before = dump(first / "jetrouter.db")
    assert 0 < stats["ledger_rows"] < sum(
        isinstance(e, ev.RequestRouted) for _, b in router for e in b)
    assert any(row[2] > 0 for row in before["decision_ledger"])  # hops recorded

    for attempt in range(2):
        for f in first.iterdir():
            f.unlink()
        p = await opened(first, ledger_retention=retention)
        for group in chunked(random.Random(attempt), router):
            await p.apply_many(ROUTER, group)
        await p.apply_many(CONTROL, control)
        await p.close()
        assert dump(first / "jetrouter.db") == before


# --- retention, catalog, lookups -----------------------------------------------------------------


async def test_retention_runs_in_event_time(tmp_path: Path) -> None:
    p = await opened(tmp_path, ledger_retention=100.0)
    try:
        # Event time near the epoch: a wall-clock retention would delete every row at once.
        await p.apply_many(ROUTER, [(1, [routed("t0", 0.0)]), (2, [routed("t50", 50.0)]),
                                    (3, [routed("t90", 90.0)])])
        assert (await p.stats())["ledger_rows"] == 3
        await p.apply(ROUTER, 4, [ev.PrefillCompleted("t90", 160.0)])  # cutoff 60
        assert [await p.request(r) is not None for r in ("t0", "t50", "t90")] == [
            False, False, True]
        # A late decision older than the cutoff does not linger.
        await p.apply(ROUTER, 5, [routed("late", 30.0), routed("fresh", 161.0)])
        assert await p.request("late") is None
        assert await p.request("fresh") is not None
        # An older ts never moves the cutoff back; the bound resumes after reopening.
        await p.close()
        p = await opened(tmp_path, ledger_retention=100.0)
        await p.apply(ROUTER, 6, [routed("t40", 40.0)])
        assert await p.request("t40") is None
        assert (await p.stats())["ledger_rows"] == 2
    finally:
        await p.close()

    keep_all = await opened(tmp_path / "keep", ledger_retention=0)  # 0: no retention
    try:
        await keep_all.apply_many(ROUTER, [(1, [routed("t0", 0.0)]), (2, [routed("t", 1e9)])])
        assert (await keep_all.stats())["ledger_rows"] == 2
    finally:
        await keep_all.close()


async def test_catalog_lists_newest_first_and_marks_reset(tmp_path: Path) -> None:
    p = await opened(tmp_path)
    try:
        # A later leader with a slower clock: stream order decides "newest", not ts.
        await p.apply_many(CONTROL, [(3, [taken("s1", 100.0)]), (5, [taken("s2", 90.0)]),
                                     (6, [ev.SnapshotThresholdSet(50, 91.0)])])
        await p.apply(CONTROL, 9, [taken("s3", 95.0, size=42), taken("s1", 96.0)])  # s1 repeated
        listed = await p.snapshots()
        assert [s["snapshot_id"] for s in listed] == ["s3", "s2", "s1"]
        assert listed[0] == {
            "snapshot_id": "s3", "seq": 9, "positions": {"kv": 10, "router": 20, "control": 3},
            "size": 42, "sha256": "ab" * 32, "created_by": "r1", "trigger": "threshold",
            "ts": 95.0, "discarded": False,
        }
        assert listed[2]["ts"] == 100.0  # the first SnapshotTaken for an id wins
        assert [s["snapshot_id"] for s in await p.snapshots(limit=2)] == ["s3", "s2"]
        await p.apply_many(CONTROL, [(10, [ev.StateReset(1, "admin", 97.0)]),
                                     (11, [taken("s4", 98.0)])])
        assert [(s["snapshot_id"], s["discarded"]) for s in await p.snapshots()] == [
            ("s4", False), ("s3", True), ("s2", True), ("s1", True)]
    finally:
        await p.close()


async def test_request_lookup_returns_candidates_timings_and_hops(tmp_path: Path) -> None:
    p = await opened(tmp_path)
    try:
        await p.apply_many(ROUTER, [
            (1, [routed("abc", 10.0, worker="w1")]),
            (2, [ev.PrefillCompleted("abc", 10.5)]),
            (3, [ev.RequestFinished("abc", "migrated", 7, 11.0),
                 routed("abc~1", 11.1, replica="r2", worker="w9", overlap=0,
                        candidates=[("w9", 0, 0, 6.5, 3.0, 9.5, False)])]),
        ])
        await p.apply(ROUTER, 4, [routed("other", 11.2, replica="r2"), ev.ReplicaLost("r2", 12.0),
                                  ev.RequestFinished("abc~1", "ok", 20, 13.0)])
        got = await p.request("abc")
        assert got is not None
        assert {k: got[k] for k in ("request_id", "worker_id", "overlap_blocks", "routed_ts",
                                    "prefill_ts", "finished_ts", "outcome", "output_tokens",
                                    "lost", "model", "isl_tokens", "hop")} == {
            "request_id": "abc", "worker_id": "w1", "overlap_blocks": 2, "routed_ts": 10.0,
            "prefill_ts": 10.5, "finished_ts": 11.0, "outcome": "migrated", "output_tokens": 7,
            "lost": False, "model": "m", "isl_tokens": 100, "hop": 0}
        assert got["candidates"] == [
            {"worker": "w1", "dp_rank": 0, "overlap_blocks": 2, "prefill_blocks": 4.25,
             "decode_blocks": 7.0, "cost": 11.25, "busy": False},
            {"worker": "w9", "dp_rank": 0, "overlap_blocks": 0, "prefill_blocks": 6.5,
             "decode_blocks": 3.0, "cost": 9.5, "busy": True}]
        assert [(h["request_id"], h["worker_id"], h["outcome"]) for h in got["hops"]] == [
            ("abc", "w1", "migrated"), ("abc~1", "w9", "ok")]
        # The open hop on the lost replica was marked lost, and its later finish still recorded.
        hop1 = await p.request("abc~1")
        assert hop1 is not None and hop1["request_id"] == "abc~1"
        assert (hop1["lost"], hop1["lost_ts"], hop1["finished_ts"]) == (True, 12.0, 13.0)
        assert len(hop1["hops"]) == 2
        other = await p.request("other")
        assert other is not None and other["lost"] is True and other["finished_ts"] is None
        assert await p.request("abc~2") is None
        assert await p.request("nope") is None
    finally:
        await p.close()


# --- fed from a real stream ----------------------------------------------------------------------


async def test_feeder_follows_real_streams_and_steps_over_purges(
    tmp_path: Path, js: tuple[NATS, JetStreamContext]
) -> None:
    _, context = js
    names = Names("jr")
    appender = Appender(context)
    for i in range(40):
        batch: list[ev.Event] = [routed(f"n{i}", float(i))]
        if i % 2:
            batch.append(ev.RequestFinished(f"n{i - 1}", "ok", i, float(i)))
        await appender.append(names.router_subject("r1"), batch, f"m{i}")
    snap_seq = await appender.append(names.control_subject("snapshot"), [taken("s1", 5.0)], "c1")

    p = await opened(tmp_path / "a")
    feeder = ProjectionFeeder(context, names, p)
    await feeder.start()
    try:
        await until(lambda: p.position(ROUTER), lambda v: v == 40)
        await until(lambda: p.position(CONTROL), lambda v: v == snap_seq)
        # Live tail after catching up.
        await appender.append(names.router_subject("r2"), [routed("live", 50.0, replica="r2")],
                              "m-live")
        await until(lambda: p.request("live"), lambda v: v is not None)
        assert (await p.request("n2"))["outcome"] == "ok"  # type: ignore[index]
        assert [s["snapshot_id"] for s in await p.snapshots()] == ["s1"]
        assert feeder.stats[ROUTER].transactions < 41  # grouped, not one per message
    finally:
        await feeder.stop()
        await p.close()

    # A fresh database while the stream was purged: the feeder starts after the purge point.
    await context.purge_stream(names.stream(ROUTER))
    await appender.append(names.router_subject("r1"), [routed("after", 60.0)], "m-after")
    fresh = await opened(tmp_path / "b")
    feeder = ProjectionFeeder(context, names, fresh)
    await feeder.start()
    try:
        await until(lambda: fresh.position(ROUTER), lambda v: v == 42)
        assert await fresh.request("after") is not None
        assert await fresh.request("n1") is None
        assert feeder.stats[ROUTER].purged_gaps == 1
        # A message the views cannot take is stepped over alone; its neighbours are applied.
        bad = ev.RequestRouted("bad", "r1", None, 0, 1, [], 0, 1, 0, 61.0)  # type: ignore[arg-type]
        await feeder._commit(ROUTER, [(43, [routed("x", 61.0)]), (44, [bad]),
                                      (45, [routed("y", 62.0)])])
        assert feeder.stats[ROUTER].skipped == 1
        assert await fresh.position(ROUTER) == 45
        assert await fresh.request("x") is not None and await fresh.request("y") is not None
    finally:
        await feeder.stop()
        await fresh.close()


# --- prediction vs reality ---------------------------------------------------------------------


async def test_ledger_row_has_predicted_and_engine_reported_reuse(tmp_path: Path) -> None:
    p = await opened(tmp_path)
    try:
        with_size = ev.RequestRouted(**{**_fields(routed("a", 10.0, overlap=3)),
                                        "block_size": 16})
        await p.apply(ROUTER, 1, [with_size, routed("old", 10.0)])
        await p.apply(ROUTER, 2, [ev.RequestFinished("a", "ok", 4, 11.0, cached_tokens=40),
                                  ev.RequestFinished("old", "ok", 4, 11.0)])
        a, old = await p.request("a"), await p.request("old")
        assert a is not None and old is not None
        assert (a["predicted_tokens"], a["cached_tokens"]) == (48, 40)
        # A decision without its block size, a finish without the engine's figure: unknown.
        assert (old["predicted_tokens"], old["cached_tokens"]) == (None, None)
    finally:
        await p.close()


async def test_a_prefill_folded_into_the_finish_still_fills_prefill_ts(tmp_path: Path) -> None:
    p = await opened(tmp_path)
    try:
        await p.apply(ROUTER, 1, [routed("f", 10.0), routed("s", 10.0)])
        await p.apply(ROUTER, 2, [ev.RequestFinished("f", "ok", 1, 12.0, prefill_ts=11.5),
                                  ev.PrefillCompleted("s", 11.0),
                                  ev.RequestFinished("s", "ok", 1, 12.0)])
        folded, separate = await p.request("f"), await p.request("s")
        assert folded is not None and separate is not None
        assert (folded["prefill_ts"], folded["finished_ts"]) == (11.5, 12.0)
        assert (separate["prefill_ts"], separate["finished_ts"]) == (11.0, 12.0)
    finally:
        await p.close()


async def test_an_older_database_gains_the_new_columns(tmp_path: Path) -> None:
    db_file = tmp_path / "jetrouter.db"
    p = await opened(tmp_path)
    await p.apply(ROUTER, 1, [routed("a", 10.0)])
    await p.close()
    with sqlite3.connect(db_file) as conn:  # as the previous release left it
        conn.execute("ALTER TABLE decision_ledger DROP COLUMN predicted_tokens")
        conn.execute("ALTER TABLE decision_ledger DROP COLUMN cached_tokens")
        conn.execute("ALTER TABLE decision_ledger DROP COLUMN transfer_blocks")
    p = await opened(tmp_path)
    try:
        await p.apply(ROUTER, 2, [ev.RequestFinished("a", "ok", 4, 11.0, cached_tokens=16)])
        row = await p.request("a")
        assert row is not None and (row["predicted_tokens"], row["cached_tokens"]) == (None, 16)
        assert row["transfer_blocks"] is None
    finally:
        await p.close()


def _fields(e: ev.RequestRouted) -> dict[str, Any]:
    return {f: getattr(e, f) for f in e.__struct_fields__}


async def test_feeder_started_while_nats_is_away_reads_once_it_is_back(
    tmp_path: Path, nats_server: Any, nats_connect: Any
) -> None:
    """The ledger keeps following after JetStream was unreachable when its reader (re)started:
    a NATS server lost makes stream info and consumer creation time out for seconds, and the
    projector child must go on after it rather than stop for good."""
    names = Names("jr")
    nc = await nats_connect(nats_server.url)
    context = nc.jetstream(timeout=1.0)
    await ensure_streams(context, names)
    appender = Appender(context)
    await appender.append(names.router_subject("r1"), [routed("before", 1.0)], "m-before")

    nats_server.kill()
    p = await opened(tmp_path / "a")
    feeder = ProjectionFeeder(context, names, p, retry_delay=0.05)
    await feeder.start()
    try:
        await until(lambda: feeder.stats[ROUTER].failures, bool, what="a failed read")
        nats_server.restart(timeout=60, graceful=False)
        await until(lambda: p.request("before"), lambda v: v is not None, timeout=60)
        await appender.append(names.router_subject("r1"), [routed("after", 2.0)], "m-after")
        await until(lambda: p.request("after"), lambda v: v is not None, timeout=60)
    finally:
        await feeder.stop()
        await p.close()
