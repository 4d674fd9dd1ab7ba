"""`jetrouter bench faults`: what a client sees while engines and replicas fail.

A fresh local cluster (default 2 replicas, 4 simulated engines) takes steady open-loop load:
Poisson arrivals of streaming completions, token-id prompts that share a few system prefixes,
spread round-robin over the replicas. Then, one after the other, each fault gets a *baseline*
window (no fault) followed by a *fault* window:

    crash      an engine dies after a few tokens of its next request (``crash_after_tokens``)
    hang       an engine stops producing tokens (``hang``) for the window
    slow       an engine runs 10x slower (``slow``, factor 10) for the window
    wrong      an engine answers wrong tokens (``wrong_output``) for the window
    sigterm    a router replica gets SIGTERM (graceful drain); the cluster restarts it
    sigkill    a router replica gets SIGKILL; the cluster restarts it

Between faults the bench waits until the cluster is whole again (every child ready, every engine
healthy on every replica). A request counts in the window it started in, except that one still in
flight when the fault is injected counts in the fault window. Per window:

* failed  — the client did not get a whole answer: non-200 after the client's one retry, an error
  event in the stream, a broken or truncated stream, a timeout;
* wrong   — a whole answer whose text differs from what a healthy engine produces for the prompt
  (the simulated engine is deterministic: ``workers.generation.expected_tokens``);
* retried — the first replica refused the connection (or said it is shutting down) and the
  client sent the request to the next replica, as a load balancer that checks ``/ready`` would;
  the answer itself may be fine;
* TTFT and end-to-end latency p50 / p99 of the answered requests, baseline vs fault window.

Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.report import percentile
from errors.root import JetrouterError
from tokenization import tokens
from workers.generation import expected_tokens

MODEL = "jetrouter-sim"
FAULTS = ("crash", "hang", "slow", "wrong", "sigterm", "sigkill")
FAULT_LABELS = {"crash": "engine crash mid-stream", "hang": "engine hang",
                "slow": "engine slow x10", "wrong": "engine wrong output",
                "sigterm": "replica SIGTERM", "sigkill": "replica SIGKILL"}
PREFIXES = 8          # shared "system prompts" the requests start with
PREFIX_TOKENS = 64
BASE, FAULT = "baseline", "fault"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replicas", type=int, default=2, help="router replicas (default 2)")
    p.add_argument("--workers", type=int, default=4, help="simulated engines (default 4)")
    p.add_argument("--faults", default=",".join(FAULTS),
                   help=f"comma-separated, in order (default {','.join(FAULTS)})")
    p.add_argument("--rate", type=float, default=10.0, help="requests per second (default 10)")
    p.add_argument("--max-tokens", type=int, default=32, help="output tokens per request")
    p.add_argument("--baseline", type=float, default=5.0, help="baseline window, seconds")
    p.add_argument("--window", type=float, default=8.0, help="fault window, seconds")
    p.add_argument("--stream-idle-timeout", type=float, default=2.0,
                   help="replicas' --stream-idle-timeout (default 2)")
    p.add_argument("--canary-interval", type=float, default=1.0,
                   help="replicas' --canary-interval (default 1)")
    p.add_argument("--canary-recovery-timeout", type=float, default=3.0,
                   help="replicas' --canary-recovery-timeout (default 3)")
    p.add_argument("--request-timeout", type=float, default=30.0, help="seconds per request")
    p.add_argument("--seed", type=int, default=0, help="arrivals and prompts")
    p.add_argument("--data-dir", type=Path, default=None,
                   help="cluster data/logs here (default: a temporary dir, removed after)")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")


# --- one request -------------------------------------------------------------------------------


@dataclass(slots=True)
class Sample:
    index: int
    started: float                # monotonic
    ended: float | None = None    # monotonic; None while in flight
    ttft: float | None = None
    e2e: float | None = None
    outcome: str = "failed"       # "ok" | "wrong" | "failed"
    retried: bool = False
    error: str | None = None
    replica: str | None = None
    worker: str | None = None


class _Retry(JetrouterError):
    """The replica took no part in the request: send it to the next one."""


def prompt_for(index: int, rng_seed: int) -> list[int]:
    """A shared system prefix (one of ``PREFIXES``) plus a short unique tail."""
    k = index % PREFIXES
    prefix = [1000 + 100 * k + i for i in range(PREFIX_TOKENS)]
    r = random.Random(rng_seed * 1_000_003 + index)
    return [*prefix, *(r.randrange(256, 20_000) for _ in range(8 + index % 9))]


class LoadGen:
    """Open-loop Poisson arrivals of streaming completions over ``urls``, round-robin."""

    def __init__(self, client: httpx.AsyncClient, urls: Callable[[], Sequence[str]], *,
                 rate: float, max_tokens: int, timeout: float, seed: int) -> None:
        self.client = client
        self.urls = urls
        self.rate = rate
        self.max_tokens = max_tokens
        self.timeout = timeout
        self.seed = seed
        self.samples: list[Sample] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._stop = asyncio.Event()

    async def run(self) -> None:
        rng = random.Random(self.seed)
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        index = 0
        while not self._stop.is_set():
            sample = Sample(index, time.monotonic())
            self.samples.append(sample)
            task = asyncio.create_task(self._one(sample))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            index += 1
            next_at += rng.expovariate(self.rate)
            with contextlib.suppress(TimeoutError):  # pacing, not synchronisation
                await asyncio.wait_for(self._stop.wait(), max(0.0, next_at - loop.time()))

    async def stop(self) -> None:
        self._stop.set()
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=self.timeout + 5)

    async def _one(self, s: Sample) -> None:
        try:
            await self._attempts(s)
        finally:
            s.ended = time.monotonic()

    async def _attempts(self, s: Sample) -> None:
        prompt = prompt_for(s.index, self.seed)
        want = tokens.decode(expected_tokens(prompt, self.max_tokens))
        urls = list(self.urls())
        first = s.index % len(urls)
        order = urls[first:] + urls[:first]
        for attempt, url in enumerate(order[:2]):
            try:
                text = await self._stream(url, prompt, s)
            except _Retry as exc:
                s.error = str(exc)
                if attempt == 0 and len(order) > 1:
                    s.retried = True
                    continue
                return
            except (httpx.HTTPError, ValueError) as exc:
                s.error = type(exc).__name__
                return
            s.e2e = time.monotonic() - s.started
            if text == want:
                s.outcome = "ok"
            elif len(text) < len(want):
                s.error = "truncated answer"  # a clean end before every token came
            else:
                s.outcome, s.error = "wrong", "wrong tokens"
            return

    async def _stream(self, url: str, prompt: list[int], s: Sample) -> str:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": self.max_tokens, "stream": True}
        try:
            async with self.client.stream("POST", url + "/v1/completions", json=body,
                                          timeout=self.timeout) as r:
                s.replica = r.headers.get("x-jetrouter-replica")
                s.worker = r.headers.get("x-jetrouter-worker")
                if r.status_code != 200:
                    detail = (await r.aread()).decode(errors="replace")
                    if r.status_code == 503 and "shutting down" in detail:
                        raise _Retry("draining replica")
                    raise ValueError(f"HTTP {r.status_code}")
                text = ""
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    doc = json.loads(line[6:])
                    if "error" in doc:
                        raise ValueError("error event in the stream")
                    for choice in doc.get("choices", []):
                        piece = choice.get("text") or ""
                        if piece and s.ttft is None:
                            s.ttft = time.monotonic() - s.started
                        text += piece
                return text
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            raise _Retry(type(exc).__name__) from None


# --- windows and the table ---------------------------------------------------------------------


@dataclass
class Phase:
    fault: str
    target: str
    base_start: float
    fault_start: float = 0.0
    fault_end: float = 0.0
    note: str = ""


@dataclass
class WindowStats:
    requests: int = 0
    ok: int = 0
    failed: int = 0
    wrong: int = 0
    retried: int = 0
    ttft_p50: float | None = None
    ttft_p99: float | None = None
    e2e_p50: float | None = None
    e2e_p99: float | None = None
    errors: dict[str, int] = field(default_factory=dict)


def window_stats(samples: Sequence[Sample]) -> WindowStats:
    w = WindowStats(requests=len(samples))
    for s in samples:
        w.ok += s.outcome == "ok"
        w.failed += s.outcome == "failed"
        w.wrong += s.outcome == "wrong"
        w.retried += s.retried
        if s.outcome != "ok" and s.error:
            w.errors[s.error] = w.errors.get(s.error, 0) + 1
    answered = [s for s in samples if s.outcome != "failed"]
    ttft = [s.ttft for s in answered if s.ttft is not None]
    e2e = [s.e2e for s in answered if s.e2e is not None]
    w.ttft_p50, w.ttft_p99 = percentile(ttft, 50), percentile(ttft, 99)
    w.e2e_p50, w.e2e_p99 = percentile(e2e, 50), percentile(e2e, 99)
    return w


def split(samples: Sequence[Sample], phase: Phase) -> tuple[list[Sample], list[Sample]]:
    """(baseline, fault) samples of one phase. The baseline holds the requests that started
    and ended before the fault; the fault window those that started during it *and* those the
    fault caught in flight (a stream already running when an engine starts lying counts)."""
    def before_fault(s: Sample) -> bool:
        return s.ended is not None and s.ended < phase.fault_start

    base = [s for s in samples
            if phase.base_start <= s.started < phase.fault_start and before_fault(s)]
    fault = [s for s in samples
             if (phase.fault_start <= s.started < phase.fault_end)
             or (phase.base_start <= s.started < phase.fault_start and not before_fault(s))]
    return base, fault


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def _pair(base: float | None, fault: float | None) -> str:
    if base is None or fault is None:
        return f"{_ms(base)} -> {_ms(fault)}"
    return f"{_ms(base)} -> {_ms(fault)} ({(fault - base) * 1000:+.0f})"


def format_table(rows: Sequence[tuple[Phase, WindowStats, WindowStats]]) -> str:
    header = ["fault", "target", "reqs base/fault", "failed", "wrong", "retried",
              "TTFT p50 ms", "TTFT p99 ms", "e2e p50 ms", "e2e p99 ms"]
    body = []
    for phase, base, fault in rows:
        body.append([FAULT_LABELS.get(phase.fault, phase.fault), phase.target,
                     f"{base.requests}/{fault.requests}", _count(base.failed, fault.failed),
                     _count(base.wrong, fault.wrong), _count(base.retried, fault.retried),
                     _pair(base.ttft_p50, fault.ttft_p50), _pair(base.ttft_p99, fault.ttft_p99),
                     _pair(base.e2e_p50, fault.e2e_p50), _pair(base.e2e_p99, fault.e2e_p99)])
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(widths[i]) for i, c in enumerate(r)).rstrip()
             for r in [header, *body]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _count(base: int, fault: int) -> str:
    """The fault window's count; the baseline's too when it was not zero (it should be)."""
    return str(fault) if base == 0 else f"{fault} (base {base})"


# --- the run -----------------------------------------------------------------------------------


async def _until(probe: Callable[[], Awaitable[bool]], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if await probe():
                return
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        await asyncio.sleep(0.2)
    raise RuntimeError(f"{what} not reached within {timeout:.0f} s")


class FaultBench:
    def __init__(self, cluster: Any, client: httpx.AsyncClient, args: argparse.Namespace
                 ) -> None:
        self.c = cluster
        self.h = client
        self.args = args
        self.auth = {"authorization": f"Bearer {cluster.admin_token}"}
        self.replicas = [n for n, ch in cluster.children.items() if ch.kind == "replica"]
        self.workers = [n for n, ch in cluster.children.items() if ch.kind == "worker"]

    async def whole(self, timeout: float = 90.0) -> None:
        """Every child ready and every replica seeing every engine healthy."""
        await self.c.wait_ready(timeout=timeout)

        async def healthy() -> bool:
            for name in self.replicas:
                r = await self.h.get(self.c.children[name].url + "/admin/workers",
                                     headers=self.auth, timeout=5)
                ws = {w["worker_id"]: w["health"] for w in r.json()["workers"]}
                if ws != {w: "healthy" for w in self.workers}:
                    return False
            return True

        await _until(healthy, timeout, "every engine healthy on every replica")

    async def fault_post(self, worker: str, body: dict[str, Any]) -> None:
        with contextlib.suppress(httpx.HTTPError):  # "crash" never answers
            await self.h.post(self.c.children[worker].url + "/fault", json=body, timeout=5)

    async def inject(self, fault: str, target: str) -> None:
        if fault == "crash":
            await self.fault_post(target, {"action": "crash_after_tokens", "n": 8})
        elif fault == "hang":
            await self.fault_post(target, {"action": "hang"})
        elif fault == "slow":
            await self.fault_post(target, {"action": "slow", "factor": 10})
        elif fault == "wrong":
            await self.fault_post(target, {"action": "wrong_output"})
        elif fault == "sigterm":
            self.c.kill(target, signal.SIGTERM)
        elif fault == "sigkill":
            self.c.kill(target, signal.SIGKILL)
        else:
            raise ValueError(f"unknown fault {fault!r}")

    async def clear(self, fault: str, target: str) -> None:
        if fault in ("hang", "slow", "wrong", "crash"):
            child = self.c.children[target]
            if child.running:  # a crashed engine comes back fault-free
                await self.fault_post(target, {"action": "clear"})

    def target_of(self, fault: str, k: int) -> str:
        if fault in ("sigterm", "sigkill"):
            return self.replicas[0]
        return self.workers[k % len(self.workers)]

    async def run(self, faults: Sequence[str]) -> list[Phase]:
        load = LoadGen(self.h, lambda: self.c.router_urls, rate=self.args.rate,
                       max_tokens=self.args.max_tokens, timeout=self.args.request_timeout,
                       seed=self.args.seed)
        phases: list[Phase] = []
        await self.whole()
        runner = asyncio.create_task(load.run())
        try:
            for k, fault in enumerate(faults):
                target = self.target_of(fault, k)
                phase = Phase(fault, target, time.monotonic())
                print(f"[{fault}] baseline {self.args.baseline:.0f} s ...", file=sys.stderr)
                await asyncio.sleep(self.args.baseline)  # a measuring window, by design
                phase.fault_start = time.monotonic()
                await self.inject(fault, target)
                print(f"[{fault}] {FAULT_LABELS[fault]} on {target} for "
                      f"{self.args.window:.0f} s ...", file=sys.stderr)
                await asyncio.sleep(self.args.window)
                phase.fault_end = time.monotonic()
                await self.clear(fault, target)
                phases.append(phase)
                t0 = time.monotonic()
                await self.whole()
                phase.note = f"whole again {time.monotonic() - t0:.1f} s after the window"
        finally:
            await load.stop()
            runner.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await runner
        self.samples = load.samples
        return phases


async def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    from launch.local_cluster import LocalCluster  # lazily: the cluster machinery is heavy

    faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    unknown = [f for f in faults if f not in FAULTS]
    if unknown:
        raise SystemExit(f"jetrouter bench faults: unknown fault(s) {unknown}; "
                         f"choose from {', '.join(FAULTS)}")
    owned = args.data_dir is None
    root = args.data_dir or Path(tempfile.mkdtemp(prefix="jetrouter-faults-"))
    router_args = ["--stream-idle-timeout", str(args.stream_idle_timeout),
                   "--canary-interval", str(args.canary_interval),
                   "--canary-recovery-timeout", str(args.canary_recovery_timeout),
                   "--canary-timeout", "1", "--lease-ttl", "3"]
    config = {"replicas": args.replicas, "workers": args.workers, "rate_rps": args.rate,
              "max_tokens": args.max_tokens, "baseline_s": args.baseline, "window_s": args.window,
              "router_args": router_args, "prompt": f"{PREFIXES} shared {PREFIX_TOKENS}-token "
              "prefixes + 8..16 unique tokens, streaming /v1/completions",
              "client_retry": "once, on the next replica, if refused or draining"}
    print("config: " + json.dumps(config), file=sys.stderr)
    async with LocalCluster(replicas=args.replicas, workers=args.workers,
                            data_dir=Path(root), namespace="faults",
                            router_args=router_args) as cluster:
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=512)) as h:
            bench = FaultBench(cluster, h, args)
            phases = await bench.run(faults)
            samples = bench.samples
    if owned:
        shutil.rmtree(root, ignore_errors=True)
    rows = []
    for phase in phases:
        base, fault = split(samples, phase)
        rows.append((phase, window_stats(base), window_stats(fault)))
    return {"config": config, "rows": rows}


def run(args: argparse.Namespace) -> int:
    result = asyncio.run(run_bench(args))
    rows = result["rows"]
    print(format_table(rows))
    for phase, _, fault in rows:
        errs = ", ".join(f"{k} x{v}" for k, v in sorted(fault.errors.items()))
        print(f"  {FAULT_LABELS[phase.fault]}: {phase.note}" + (f"; errors: {errs}" if errs
                                                               else ""))
    if args.json is not None:
        doc = {"config": result["config"],
               "rows": [{"fault": p.fault, "target": p.target, "baseline": asdict(b),
                         "fault_window": asdict(f)} for p, b, f in rows]}
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    return 0
