"""Throughput of the decision ledger on SQLite (snapshots/projections.py).

Not a test (prints figures, asserts nothing about speed). Run:

    .venv/bin/python -m benchmarks.bench_projections [--decisions 20000]

Each decision is three router-stream messages (``RequestRouted`` with ``--candidates`` cost rows,
``PrefillCompleted``, ``RequestFinished``), interleaved as concurrent requests would be. Part 1
applies them straight to :class:`Projections` with ``--group`` messages per transaction; part 2
appends them to a real nats-server and times :class:`ProjectionFeeder` replaying the stream
(group commit sizes chosen by the feeder itself); part 3 publishes at ``--rate`` decisions/s
and reports how far the feeder falls behind.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from pathlib import Path

import nats
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext

from eventlog import events as ev
from eventlog.events import encode_batch
from eventlog.names import ROUTER, Names
from eventlog.streams import ensure_streams
from natsops.server import NatsServer
from snapshots.db import default_url
from snapshots.projections import ProjectionFeeder, Projections


def make_stream(decisions: int, candidates: int, rng: random.Random) -> list[list[ev.Event]]:
    """One event per message; up to 64 requests in flight, finishing in random order."""
    msgs: list[list[ev.Event]] = []
    in_flight: list[tuple[str, bool]] = []
    ts = 1.7e9
    made = 0
    while made < decisions or in_flight:
        ts += 0.001
        if made < decisions and ((len(in_flight) < 64 and rng.random() < 0.5) or not in_flight):
            rid = f"req-{made}"
            cands = [(f"w{k}", 0, rng.randint(0, 40), rng.random() * 50, rng.random() * 500,
                      rng.random() * 600, False) for k in range(candidates)]
            msgs.append([ev.RequestRouted(rid, "r1", "w0", 0, 2048, [rng.getrandbits(64)] * 128,
                                          12, 256, 0, ts, cands, "model")])
            in_flight.append((rid, False))
            made += 1
            continue
        i = rng.randrange(len(in_flight))
        rid, prefilled = in_flight[i]
        if prefilled:
            in_flight.pop(i)
            msgs.append([ev.RequestFinished(rid, "ok", 256, ts)])
        else:
            in_flight[i] = (rid, True)
            msgs.append([ev.PrefillCompleted(rid, ts)])
    return msgs


async def direct(msgs: list[list[ev.Event]], decisions: int, group: int, tmp: Path) -> None:
    projections = Projections(default_url(tmp / f"direct-{group}"))
    await projections.start()
    numbered = list(enumerate(msgs, start=1))
    t0 = time.perf_counter()
    for i in range(0, len(numbered), group):
        await projections.apply_many(ROUTER, numbered[i:i + group])
    elapsed = time.perf_counter() - t0
    rows = (await projections.stats())["ledger_rows"]
    await projections.close()
    print(f"  group {group:>5}: {elapsed:6.2f} s  {decisions / elapsed:8.0f} decisions/s  "
          f"{len(msgs) / elapsed:8.0f} messages/s  ({rows} rows)")


async def _connected(server: NatsServer) -> tuple[NatsClient, JetStreamContext, Names]:
    """A connection to ``server``, its JetStream context and the ``jr`` streams, made."""
    nc = await nats.connect(server.url)
    js = nc.jetstream()
    names = Names("jr")
    await ensure_streams(js, names)
    return nc, js, names


async def fed(msgs: list[list[ev.Event]], decisions: int, tmp: Path) -> None:
    server = NatsServer(store_dir=tmp / "nats").start()
    try:
        nc, js, names = await _connected(server)
        subject = names.router_subject("r1")
        for start in range(0, len(msgs), 500):
            acks = [js.publish(subject, encode_batch(m)) for m in msgs[start:start + 500]]
            await asyncio.gather(*acks)
        projections = Projections(default_url(tmp / "fed"))
        await projections.start()
        feeder = ProjectionFeeder(js, names, projections)
        t0 = time.perf_counter()
        await feeder.start()
        while await projections.position(ROUTER) < len(msgs):
            await asyncio.sleep(0.05)
        elapsed = time.perf_counter() - t0
        stats = feeder.stats[ROUTER]
        await feeder.stop()
        await projections.close()
        await nc.close()
        print(f"  replay of {len(msgs)} messages: {elapsed:6.2f} s  "
              f"{decisions / elapsed:8.0f} decisions/s  in {stats.transactions} transactions")
    finally:
        server.cleanup()


async def live(msgs: list[list[ev.Event]], rate: float, seconds: float, tmp: Path) -> None:
    """Publish at ``rate`` decisions/s (3 messages each) while the feeder follows; report the
    feeder's lag behind the stream and its transaction sizes."""
    server = NatsServer(store_dir=tmp / "nats-live").start()
    try:
        nc, js, names = await _connected(server)
        projections = Projections(default_url(tmp / "live"))
        await projections.start()
        feeder = ProjectionFeeder(js, names, projections)
        await feeder.start()
        stats = feeder.stats[ROUTER]
        subject = names.router_subject("r1")
        total = min(len(msgs), int(3 * rate * seconds))
        tick = 0.01
        per_tick = max(1, round(3 * rate * tick))
        published, max_lag = 0, 0
        t0 = time.perf_counter()
        while published < total:
            due = min(total, int((time.perf_counter() - t0) / tick + 1) * per_tick)
            chunk = msgs[published:due]
            if chunk:
                await asyncio.gather(*(js.publish(subject, encode_batch(m)) for m in chunk))
                published = due
            max_lag = max(max_lag, published - stats.applied)
            await asyncio.sleep(tick)
        sent = time.perf_counter() - t0
        while stats.applied < total:
            await asyncio.sleep(0.01)
        drained = time.perf_counter() - t0 - sent
        await feeder.stop()
        await projections.close()
        await nc.close()
        print(f"  {total} messages in {sent:.2f} s ({total / 3 / sent:.0f} decisions/s offered): "
              f"max lag {max_lag} messages, caught up {drained * 1000:.0f} ms after the last "
              f"publish, {stats.transactions} transactions "
              f"(mean {stats.applied / max(stats.transactions, 1):.1f} messages each)")
    finally:
        server.cleanup()


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--decisions", type=int, default=20000)
    parser.add_argument("--candidates", type=int, default=4)
    parser.add_argument("--group", type=int, nargs="*", default=[1, 10, 100, 1000])
    parser.add_argument("--rate", type=float, default=1000.0, help="live decisions/s")
    parser.add_argument("--live-seconds", type=float, default=5.0)
    args = parser.parse_args()
    msgs = make_stream(args.decisions, args.candidates, random.Random(1))
    print(f"{args.decisions} decisions, {len(msgs)} messages, {args.candidates} candidates each")
    with tempfile.TemporaryDirectory() as tmp:
        print("direct apply_many (one transaction per group):")
        for group in args.group:
            # Small groups are slow: time them on a prefix of the stream.
            part = msgs if group >= 100 else msgs[: min(len(msgs), 300 * group)]
            n = sum(isinstance(m[0], ev.RequestRouted) for m in part)
            await direct(part, n, group, Path(tmp))
        print("fed from nats-server by ProjectionFeeder:")
        await fed(msgs, args.decisions, Path(tmp))
        print("live: published at a fixed rate while the feeder follows:")
        await live(msgs, args.rate, args.live_seconds, Path(tmp))


if __name__ == "__main__":
    asyncio.run(main())
