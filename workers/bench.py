"""Requests/s a simulated worker serves for 1-token non-streaming completions.

    python -m workers.bench [--requests 2000] [--concurrency 32] [--speedup-ratio 1000]

Starts a worker child process (no NATS), drives it with an async httpx loop and prints the figure.
A high speedup ratio measures the HTTP/scheduler overhead; ratio 1 shows the simulated engine's
own limit (step time) instead.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Iterator

import httpx

from workers.procs import WorkerProcess


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--speedup-ratio", type=float, default=1000.0)
    args = p.parse_args()
    with WorkerProcess(["--speedup-ratio", str(args.speedup_ratio)]) as proc:
        rate = asyncio.run(drive(proc.url, args.requests, args.concurrency))
    print(f"worker: {rate:.0f} req/s (1-token non-streaming completions, "
          f"{args.requests} requests, concurrency {args.concurrency}, "
          f"speedup ratio {args.speedup_ratio:g})")


if __name__ == "__main__":
    main()
