"""Replay throughput of :class:`eventlog.reader.StreamReader` against a real nats-server.

Not a test (prints figures, asserts nothing about speed). Run:

    .venv/bin/python -m benchmarks.bench_eventlog_replay [--messages 20000] [--blocks 64]

It fills ``JR_KV`` with ``--messages`` messages, each one batch holding ``--events`` BlocksStored
events of ``--blocks`` blocks in total, then times a reader replaying all of them from seq 1
(decode included) for each ``--batch`` size, next to a decode-only baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

import nats

from eventlog.events import BlocksStored, decode_batch, encode_batch
from eventlog.names import Names
from eventlog.reader import StreamReader
from eventlog.streams import ensure_streams, stream_bounds
from natsops.server import NatsServer


def make_payloads(messages: int, blocks: int, events: int, rng: random.Random) -> list[bytes]:
    per_event = max(1, blocks // events)
    payloads = []
    for m in range(messages):
        batch = [
            BlocksStored(
                worker_id=f"w{m % 16}",
                event_id=m * events + e,
                dp_rank=0,
                parent_hash=rng.getrandbits(64),
                blocks=[(rng.getrandbits(64), rng.getrandbits(64)) for _ in range(per_event)],
                ts=1.7e9 + m,
            )
            for e in range(events)
        ]
        payloads.append(encode_batch(batch))
    return payloads


async def fill(js: nats.js.JetStreamContext, names: Names, payloads: list[bytes]) -> None:
    window = 512  # async publishes in flight
    futures = []
    for i, payload in enumerate(payloads):
        headers = {"Nats-Msg-Id": f"bench-{i}"}
        futures.append(await js.publish_async(names.kv_subject(f"w{i % 16}"), payload,
                                              headers=headers))  # fmt: skip
        if len(futures) >= window:
            await asyncio.gather(*futures)
            futures.clear()
    await asyncio.gather(*futures)


async def replay(js: nats.js.JetStreamContext, stream: str, last: int, batch: int) -> int:
    blocks = 0
    async with StreamReader(js, stream, batch=batch) as reader:
        async for seq, events in reader:
            for event in events:
                blocks += len(event.blocks)  # type: ignore[union-attr]
            if seq == last:
                break
    return blocks


async def main(args: argparse.Namespace) -> None:
    rng = random.Random(7)
    payloads = make_payloads(args.messages, args.blocks, args.events, rng)
    size = sum(map(len, payloads)) / len(payloads)
    t0 = time.perf_counter()
    total_blocks = sum(len(e.blocks) for p in payloads for e in decode_batch(p))  # type: ignore[union-attr]
    decode_s = time.perf_counter() - t0
    print(f"{args.messages} messages x {args.events} event(s), {args.blocks} blocks each, "
          f"{size:.0f} B/message")  # fmt: skip
    print(f"decode only      : {args.messages / decode_s:>9,.0f} msg/s "
          f"{total_blocks / decode_s:>11,.0f} blocks/s")  # fmt: skip
    with NatsServer() as server:
        nc = await nats.connect(server.url)
        js = nc.jetstream()
        names = Names("jr")
        await ensure_streams(js, names)
        await fill(js, names, payloads)
        stream = names.stream("kv")
        _, last = await stream_bounds(js, stream)
        assert last == args.messages, last
        for batch in args.batch:
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                blocks = await replay(js, stream, last, batch)
                took = time.perf_counter() - t0
                assert blocks == total_blocks
                print(f"replay batch={batch:<5}: {last / took:>9,.0f} msg/s "
                      f"{blocks / took:>11,.0f} blocks/s  ({took:.2f} s)")  # fmt: skip
        await nc.close()
        server.cleanup()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--blocks", type=int, default=64, help="blocks per message")
    parser.add_argument("--events", type=int, default=1, help="BlocksStored events per message")
    parser.add_argument("--batch", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--repeat", type=int, default=2)
    asyncio.run(main(parser.parse_args()))
