"""`python -m bench.tail_read`: what reading a KV tail costs, apart from applying it.

Starts a ``nats-server``, publishes ``--messages`` KV messages shaped like `bench durability`'s
tail (one event of 4 blocks each, half stores extending a chain, half removals, each with the
``Nats-Msg-Id`` header an append carries unless ``--bare``), then reads them ``--repeats`` times
from the start with a :class:`eventlog.reader.StreamReader` as a catching-up follower drives it
(one ``__anext__``, then ``take_received`` of what the pull brought), nothing applied — or
``--apply-us`` of busy CPU per message in its place. Prints wall and process CPU time per run
and per message, with the 1-minute load average; ``--profile`` profiles the last run.
Printed, never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import pstats
import resource
import shutil
import tempfile
import time
from pathlib import Path

import nats

from bench.durability import PUBLISH_WINDOW, Workload
from eventlog import events as ev
from eventlog.names import KV, Names
from eventlog.reader import StreamReader
from eventlog.streams import ensure_streams, stream_bounds
from natsops.server import NatsServer

_SLICE = 2048  # the follower's KV slice


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _publish(js: nats.js.JetStreamContext, names: Names, messages: int, bare: bool
                   ) -> int:
    wl = Workload(64, 0)
    ts = time.time()
    batches: list[tuple[str, ev.Event]] = []
    for i in range(messages):
        worker = wl.workers[i % len(wl.workers)]
        event = (wl.extend(worker, 4, ts) if wl.event_ids[worker] % 2
                 else wl.evict(worker, 4, ts))
        batches.append((names.kv_subject(worker), event))
    for start in range(0, len(batches), PUBLISH_WINDOW):
        chunk = batches[start:start + PUBLISH_WINDOW]
        await asyncio.gather(*(
            js.publish(subject, ev.encode_batch([event]),
                       headers=None if bare else {"Nats-Msg-Id": f"tail-{start + k}"})
            for k, (subject, event) in enumerate(chunk)))
    return (await stream_bounds(js, names.stream(KV)))[1]


async def _read_once(js: nats.js.JetStreamContext, names: Names, end: int, apply_us: float
                     ) -> tuple[int, int, int]:
    reader = StreamReader(js, names.stream(KV), start_seq=1, time_decode=False)
    count = events = 0
    try:
        async for first in reader:
            taken = [first, *reader.take_received(_SLICE - 1)]
            count += len(taken)
            events += sum(len(batch) for _, batch in taken)
            if apply_us:
                until = time.perf_counter() + apply_us * 1e-6 * len(taken)
                while time.perf_counter() < until:
                    pass
            if taken[-1][0] >= end:
                break
    finally:
        await reader.close()
    return count, events, reader.malformed


async def measure(args: argparse.Namespace) -> None:
    root = Path(tempfile.mkdtemp(prefix="jetrouter-tailread-"))
    server = NatsServer(store_dir=root / "nats").start()
    try:
        nc = await nats.connect(server.url)
        try:
            js = nc.jetstream()
            names = Names("tailread")
            await ensure_streams(js, names)
            start = time.perf_counter()
            end = await _publish(js, names, args.messages, args.bare)
            print(f"published {end} messages in {time.perf_counter() - start:.1f} s "
                  f"(load {os.getloadavg()[0]:.2f})", flush=True)
            for run in range(args.repeats):
                profile = cProfile.Profile() if args.profile and run == args.repeats - 1 else None
                wall, cpu = time.perf_counter(), _cpu()
                if profile is not None:
                    profile.enable()
                count, events, malformed = await _read_once(js, names, end, args.apply_us)
                if profile is not None:
                    profile.disable()
                wall, cpu = time.perf_counter() - wall, _cpu() - cpu
                print(f"run {run}: {count} messages, {events} events, {malformed} malformed: "
                      f"wall {wall:.3f} s, CPU {cpu:.3f} s ({cpu / count * 1e6:.2f} us a "
                      f"message){' [profiled]' if profile else ''} "
                      f"(load {os.getloadavg()[0]:.2f})", flush=True)
                if profile is not None:
                    pstats.Stats(profile).sort_stats("tottime").print_stats(20)
        finally:
            await nc.close()
    finally:
        server.cleanup()
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.tail_read", description=__doc__)
    p.add_argument("--messages", type=int, default=100_000, help="KV messages in the tail")
    p.add_argument("--repeats", type=int, default=3, help="reads of the whole tail")
    p.add_argument("--apply-us", type=float, default=0.0,
                   help="busy CPU per message after each take, standing in for applying")
    p.add_argument("--profile", action="store_true", help="cProfile the last run")
    p.add_argument("--bare", action="store_true",
                   help="publish without the Nats-Msg-Id header (as bench durability's tail)")
    asyncio.run(measure(p.parse_args()))


if __name__ == "__main__":
    main()
