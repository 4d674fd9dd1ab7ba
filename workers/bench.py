"""Requests/s a simulated worker serves for 1-token non-streaming completions, and the simulated
engine's achieved step time.

    python -m workers.bench [--requests 2000] [--concurrency 32] [--speedup-ratio 1000]
    python -m workers.bench --steps [--speedup-ratio 10] [--concurrency 32] [--tokens 500]

Starts a worker child process (no NATS), drives it with an async httpx loop and prints the figure.
A high speedup ratio measures the HTTP/scheduler overhead; ratio 1 shows the simulated engine's
own limit (step time) instead. ``--steps`` runs one engine in this process (on uvloop when
installed, as the worker does) with ``--concurrency`` requests decoding ``--tokens`` tokens each,
and prints the configured (simulated) mean step time beside the achieved (wall-clock) one.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Iterator

import httpx

from leanhttp.loop import run as run_loop
from workers.engine import Engine, RequestHandle
from workers.procs import WorkerProcess
from workers.scheduler import EngineConfig


async def drive(url: str, requests: int, concurrency: int) -> float:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60) as http:
        async def one_client(counter: Iterator[int]) -> None:
            for i in counter:
                resp = await http.post("/v1/completions",
                                       json={"prompt": f"request {i} says hello", "max_tokens": 1})
                resp.raise_for_status()

        warm_up = iter(range(min(requests, 200)))
        await asyncio.gather(*(one_client(warm_up) for _ in range(concurrency)))
        counter = iter(range(requests))
        start = time.perf_counter()
        await asyncio.gather(*(one_client(counter) for _ in range(concurrency)))
        return requests / (time.perf_counter() - start)


async def step_timing(speedup: float, requests: int, tokens: int) -> tuple[int, float, float]:
    """(steps, configured mean step seconds, achieved mean step seconds) of one engine."""
    engine = Engine(EngineConfig(speedup_ratio=speedup))
    engine.start()
    try:
        handles = [engine.submit(f"r{i}", [i + 1] * 64, tokens) for i in range(requests)]

        async def drain(handle: RequestHandle) -> None:
            async for _ in handle.tokens():
                pass

        await asyncio.gather(*(drain(h) for h in handles))
    finally:
        await engine.stop()
    steps = max(engine.steps, 1)
    return engine.steps, engine.busy_seconds / steps, engine.wall_seconds / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--speedup-ratio", type=float, default=None,
                   help="default 1000 (10 with --steps)")
    p.add_argument("--steps", action="store_true",
                   help="measure the engine's achieved step time instead of HTTP req/s")
    p.add_argument("--tokens", type=int, default=500, help="output tokens per request (--steps)")
    args = p.parse_args()
    if args.requests < 1 or args.concurrency < 1 or args.tokens < 1 \
            or (args.speedup_ratio is not None and args.speedup_ratio <= 0):
        p.error("--requests, --concurrency, --tokens and --speedup-ratio must be positive")
    if args.steps:
        speedup = args.speedup_ratio or 10.0
        conc = min(args.concurrency, 256)
        steps, configured, achieved = run_loop(step_timing(speedup, conc, args.tokens))
        print(f"engine step time: configured {configured * 1000:.3f} ms, achieved "
              f"{achieved * 1000:.3f} ms ({achieved / configured:.2f}x; {steps} steps, "
              f"{conc} requests x {args.tokens} tokens, speedup ratio {speedup:g})")
        return
    args.speedup_ratio = args.speedup_ratio or 1000.0
    with WorkerProcess(["--speedup-ratio", str(args.speedup_ratio)]) as proc:
        rate = asyncio.run(drive(proc.url, args.requests, args.concurrency))
    print(f"worker: {rate:.0f} req/s (1-token non-streaming completions, "
          f"{args.requests} requests, concurrency {args.concurrency}, "
          f"speedup ratio {args.speedup_ratio:g})")


if __name__ == "__main__":
    main()
