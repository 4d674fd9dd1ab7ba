"""Throughput of `jetrouter bridge`: engine KV batches per second into JR_KV.

Not a test (prints figures, asserts nothing about speed). Run from the repository root:

    .venv/bin/python -m benchmarks.bench_bridge [--batches 3000] [--blocks 4]

An in-process engine stand-in (tests/kvengine.py: real ZMQ PUB + replay sockets, vLLM 0.32 frame
layout, block size 16) publishes ``--batches`` BlockStored batches of ``--blocks`` blocks each
as fast as it can to a bridge subprocess in front of a real nats-server, and the time until the
bridge has appended the last one is measured: live (bridge running throughout) and catch-up (the
bridge starts after the engine has published everything, so every batch comes from the replay
socket). Also the decode + translate cost per batch alone, in this process.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import nats
from nats.js.errors import NotFoundError

from eventlog.names import Names
from eventlog.streams import ensure_streams
from natsops.server import NatsServer
from tests.kvengine import EngineSim
from workers.bridge.decode import decode_payload
from workers.bridge.resume import H_SEQ
from workers.bridge.translate import Translator

NAMES = Names("jr")


async def appended_seq(js: object, worker: str) -> int:
    try:
        msg = await js.get_last_msg(NAMES.stream("kv"), NAMES.kv_subject(worker))  # type: ignore[attr-defined]
    except NotFoundError:
        return -1
    return int((msg.headers or {}).get(H_SEQ, -1))


def bridge_argv(engine: EngineSim, url: str, worker: str) -> list[str]:
    return [sys.executable, "-m", "api.cli", "bridge", "--engine-url", engine.url,
            "--kv-events", engine.events_endpoint, "--kv-replay", engine.replay_endpoint,
            "--kv-topic", engine.topic, "--worker-id", worker, "--nats-url", url,
            "--log-level", "warning", "--replay-timeout", "30"]


def publish_all(engine: EngineSim, batches: int, blocks: int, rng: random.Random) -> None:
    bs = engine.block_size
    for _ in range(batches):
        engine.publish([{"type": "BlockStored",
                         "block_hashes": [rng.getrandbits(64) for _ in range(blocks)],
                         "parent_block_hash": None,
                         "token_ids": [rng.randrange(30_000) for _ in range(blocks * bs)],
                         "block_size": bs, "lora_id": None, "medium": "GPU",
                         "lora_name": None}])


async def wait_for(js: object, worker: str, seq: int, timeout: float = 600) -> float:
    deadline = time.monotonic() + timeout
    while await appended_seq(js, worker) < seq:
        if time.monotonic() > deadline:
            raise SystemExit(f"bridge did not reach seq {seq} in {timeout}s")
        await asyncio.sleep(0.01)
    return time.monotonic()


async def run(args: argparse.Namespace) -> None:
    rng = random.Random(1)
    # decode + translate alone
    engine0 = EngineSim()
    payloads = []
    for _ in range(2000):
        bs = engine0.block_size
        payloads.append(msgspec.msgpack.encode([1.0, [{
            "type": "BlockStored", "block_hashes": [rng.getrandbits(64)
                                                    for _ in range(args.blocks)],
            "parent_block_hash": None,
            "token_ids": [rng.randrange(30_000) for _ in range(args.blocks * bs)],
            "block_size": bs, "medium": "GPU"}], 0]))
    translator = Translator("w", engine0.block_size)
    t0 = time.perf_counter()
    for p in payloads:
        translator.translate(decode_payload(p))
    per = (time.perf_counter() - t0) / len(payloads)
    print(f"decode+translate: {per * 1e6:.1f} us per batch of {args.blocks} blocks")

    with tempfile.TemporaryDirectory() as tmp:
        server = NatsServer(store_dir=Path(tmp) / "nats").start()
        try:
            nc = await nats.connect(server.url)
            js = nc.jetstream()
            await ensure_streams(js, NAMES)
            for mode in ("live", "catch-up"):
                engine = await EngineSim(seed=2).start()
                worker = f"bench-{mode.replace('-', '')}"
                log = open(Path(tmp) / f"{worker}.log", "wb")
                proc = None
                try:
                    if mode == "live":
                        proc = subprocess.Popen(bridge_argv(engine, server.url, worker),
                                                stdout=log, stderr=subprocess.STDOUT)
                        engine.publish([{"type": "AllBlocksCleared"}])  # warm-up batch
                        await wait_for(js, worker, 0)
                        t0 = time.monotonic()
                        publish_all(engine, args.batches, args.blocks, rng)
                    else:
                        publish_all(engine, args.batches, args.blocks, rng)
                        t0 = time.monotonic()
                        proc = subprocess.Popen(bridge_argv(engine, server.url, worker),
                                                stdout=log, stderr=subprocess.STDOUT)
                    end = await wait_for(js, worker, engine.seq - 1)
                    took = end - t0
                    print(f"{mode:9s}: {args.batches} batches x {args.blocks} blocks in "
                          f"{took:.2f} s = {args.batches / took:,.0f} batches/s, "
                          f"{args.batches * args.blocks / took:,.0f} blocks/s"
                          + (" (includes bridge start-up)" if mode == "catch-up" else ""))
                finally:
                    if proc is not None:
                        proc.kill()
                        proc.wait()
                    log.close()
                    await engine.stop()
            await nc.close()
        finally:
            server.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=3000)
    parser.add_argument("--blocks", type=int, default=4)
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
