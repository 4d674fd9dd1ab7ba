"""`jetrouter bench tenants`: tenant limits and fair sharing on a local cluster of 3 replicas,
clients spreading requests round-robin over them.

(a) **Fleet-wide limit.** Tenant ``flood`` has ``--limit`` requests per minute and offers 5x
    that many (open loop, evenly spaced) within ``--duration`` seconds, shorter than the
    one-minute window, so the fleet may admit ``--limit`` in all: the report gives admitted ÷
    limit, and the
    overshoot in requests and in milliseconds of the offered traffic. For contrast the same
    flood against 3 replicas that each enforce alone (3 one-replica clusters on one NATS, each
    in its own namespace: every replica sees only its own admissions).
(c) **A replica SIGKILLed mid-flood** (fleet-wide, tenant ``flood2``): admitted ÷ limit, and the
    admissions every surviving replica counts against the 200s the client saw (an admission
    counted twice would show as more than 200s + cut requests).
(b) **Victim TTFT** p50/p99 with and without a flood under queueing (``--router-queue-threshold``):
    ``flood`` keeps ``--flood-concurrency`` streams busy (no limit), ``victim`` sends one
    request every ``--victim-interval`` s; with FCFS and with fair queueing.
(d) **Jain's index** of the tokens served to two equal-weight backlogged tenants with unequal
    concurrency (``t1`` 2x ``--flood-concurrency`` streams, ``t2`` half of it), FCFS and fair.

Figures are printed, never asserted (design.md §13).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

MODEL = "jetrouter-sim"
PARAMS = ("replicas", "workers", "limit", "duration", "flood_concurrency", "victim_interval",
          "prompt_tokens", "max_tokens", "queue_threshold", "prefill_ms_per_token",
          "tenant_headroom")
KEYS = {f"key-{t}": t for t in ("flood", "flood2", "victim", "t1", "t2")}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replicas", type=int, default=3, help="router replicas")
    p.add_argument("--workers", type=int, default=2, help="simulated engines")
    p.add_argument("--limit", type=int, default=60, help="flood's requests per minute in (a), (c)")
    p.add_argument("--duration", type=float, default=12.0, help="seconds per measured run")
    p.add_argument("--flood-concurrency", type=int, default=16, help="flood's streams in (b)")
    p.add_argument("--victim-interval", type=float, default=0.25, help="seconds between victim "
                   "requests in (b)")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--prefill-ms-per-token", type=float, default=0.5,
                   help="engines' prefill cost in (b), (d): slow enough that requests queue")
    p.add_argument("--queue-threshold", type=float, default=0.01,
                   help="--router-queue-threshold in (b), (d)")
    p.add_argument("--tenant-headroom", type=float, default=None,
                   help="--tenant-headroom of the fair replicas in (b), (d) (default: serve's)")
    p.add_argument("--skip", default="", help="comma-separated parts to skip: a,b,c,d")
    p.add_argument("--json", action="store_true", help="print only the JSON object")


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 30_000) for _ in range(n)]


class Load:
    """Requests against the replicas round-robin, one shared keep-alive client."""

    def __init__(self, urls: Sequence[str], args: argparse.Namespace) -> None:
        self.urls = list(urls)
        self.args = args
        self.rr = itertools.count()
        self.rng = random.Random(7)
        self.http = httpx.AsyncClient(timeout=60.0, limits=httpx.Limits(max_connections=512))
        # Answered requests: (tenant, request id, wall time sent, wall time of the first byte),
        # for where their time went (the decision ledger's side of it, ``breakdown``).
        self.traced: list[tuple[str, str, float, float]] = []

    async def one(self, tenant: str, *, stream: bool = False) -> tuple[int, float, int]:
        """(status or -1 for a connection error, seconds to first byte of output, tokens)."""
        url = self.urls[next(self.rr) % len(self.urls)]
        body = {"model": MODEL, "prompt": _prompt(self.rng, self.args.prompt_tokens),
                "max_tokens": self.args.max_tokens, "stream": stream}
        headers = {"authorization": f"Bearer key-{tenant}"}
        sent, t0 = time.time(), time.perf_counter()
        try:
            async with self.http.stream("POST", url + "/v1/completions", json=body,
                                        headers=headers) as r:
                ttft = -1.0
                async for _ in r.aiter_bytes():
                    if ttft < 0:
                        ttft = time.perf_counter() - t0
                rid = r.headers.get("x-jetrouter-request-id")
                if r.status_code == 200 and rid:
                    self.traced.append((tenant, rid, sent, sent + ttft))
                return r.status_code, ttft, self.args.prompt_tokens + self.args.max_tokens
        except httpx.HTTPError:
            return -1, -1.0, 0

    async def open_loop(self, tenant: str, rate: float, seconds: float,
                        kill: Any = None) -> list[tuple[int, float, int]]:
        tasks, start = [], time.monotonic()
        for i in itertools.count():
            at = start + i / rate
            if at >= start + seconds:
                break
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            if kill is not None and i == int(rate * seconds / 3):
                kill()
            tasks.append(asyncio.create_task(self.one(tenant, stream=True)))
        return list(await asyncio.gather(*tasks))

    async def closed_loop(self, tenant: str, streams: int, stop: asyncio.Event
                          ) -> list[tuple[int, float, int]]:
        out: list[tuple[int, float, int]] = []

        async def loop() -> None:
            while not stop.is_set():
                out.append(await self.one(tenant, stream=True))

        await asyncio.gather(*(loop() for _ in range(streams)))
        return out

    async def aclose(self) -> None:
        await self.http.aclose()


def _cluster(root: Path, name: str, args: argparse.Namespace, *, replicas: int, workers: int,
             router_args: Sequence[str] = (), worker_args: Sequence[str] = (),
             nats_url: str | None = None) -> Any:
    from launch.local_cluster import LocalCluster

    data = root / name
    data.mkdir(parents=True, exist_ok=True)
    keys = data / "keys.json"
    keys.write_text(json.dumps(KEYS))
    return LocalCluster(replicas=replicas, workers=workers, data_dir=data, namespace=name,
                        nats_url=nats_url, router_args=["--api-keys-file", str(keys),
                                                        *router_args],
                        worker_args=list(worker_args), ready_timeout=120.0)


async def _admin(c: Any, h: httpx.AsyncClient, url: str, method: str, path: str,
                 body: Any = None) -> Any:
    r = await h.request(method, url + path, json=body,
                        headers={"authorization": f"Bearer {c.admin_token}"})
    r.raise_for_status()
    return r.json()


async def _ready(clusters: Sequence[Any], workers: int) -> None:
    async with httpx.AsyncClient() as h:
        for c in clusters:
            for url in c.router_urls:
                for _ in range(600):
                    if len((await _admin(c, h, url, "GET", "/admin/workers"))["workers"]) \
                            == workers:
                        break
                    await asyncio.sleep(0.1)


async def _set_limit(clusters: Sequence[Any], tenant: str, limits: dict[str, Any]) -> None:
    async with httpx.AsyncClient() as h:
        for c in clusters:
            await _admin(c, h, c.router_urls[0], "PUT", f"/admin/tenants/{tenant}", limits)
            for url in c.router_urls:
                while not (await _admin(c, h, url, "GET", f"/admin/tenants/{tenant}")
                           )["configured"]:
                    await asyncio.sleep(0.05)


def _limit_row(results: list[tuple[int, float, int]], limit: int, rate: float) -> dict[str, Any]:
    ok = sum(1 for s, _, _ in results if s == 200)
    return {"offered": len(results), "admitted": ok,
            "limited": sum(1 for s, _, _ in results if s == 429),
            "other": sum(1 for s, _, _ in results if s not in (200, 429)),
            "admitted_over_limit": round(ok / limit, 3),
            "overshoot_requests": ok - limit,
            "overshoot_ms_of_traffic": round(max(ok - limit, 0) / rate * 1000, 1)}


async def part_a_c(args: argparse.Namespace, root: Path, skip: set[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    rate = 5 * args.limit / args.duration  # 5x the limit within one window
    limits = {"requests_per_minute": args.limit}
    fast = ["--speedup-ratio", "20"]
    if "a" not in skip or "c" not in skip:
        c = _cluster(root, "tfleet", args, replicas=args.replicas, workers=args.workers,
                     worker_args=fast)
        async with c:
            await _ready([c], args.workers)
            load = Load(c.router_urls, args)
            try:
                if "a" not in skip:
                    await _set_limit([c], "flood", limits)
                    res = await load.open_loop("flood", rate, args.duration)
                    out["a_fleet_wide"] = _limit_row(res, args.limit, rate)
                if "c" not in skip:
                    await _set_limit([c], "flood2", limits)
                    victim_name = f"r{args.replicas - 1}"
                    res = await load.open_loop("flood2", rate, args.duration,
                                               kill=lambda: c.kill(victim_name))
                    row = _limit_row(res, args.limit, rate)
                    await c.wait_ready()
                    async with httpx.AsyncClient() as h:
                        counted = [(await _admin(c, h, u, "GET", "/admin/tenants/flood2")
                                    )["usage"]["requests_last_minute"] for u in c.router_urls]
                    row["killed"] = victim_name
                    row["counted_by_each_replica"] = counted
                    row["cut_by_kill"] = row["other"]
                    out["c_sigkill_mid_flood"] = row
            finally:
                await load.aclose()
    if "a" not in skip:
        first = _cluster(root, "tsolo0", args, replicas=1, workers=1, worker_args=fast)
        async with first:
            rest = [_cluster(root, f"tsolo{i}", args, replicas=1, workers=1, worker_args=fast,
                             nats_url=first.nats_url) for i in range(1, args.replicas)]
            for r in rest:
                await r.start()
            try:
                everyone = [first, *rest]
                await _ready(everyone, 1)
                await _set_limit(everyone, "flood", limits)
                load = Load([c.router_urls[0] for c in everyone], args)
                try:
                    res = await load.open_loop("flood", rate, args.duration)
                finally:
                    await load.aclose()
                out["a_per_replica"] = _limit_row(res, args.limit, rate)
            finally:
                for r in rest:
                    await r.stop()
    return out


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))] * 1000, 1)


def jain(xs: Sequence[float]) -> float:
    """Jain's fairness index: 1 when all equal, 1/n when one gets everything."""
    total, squares = sum(xs), sum(x * x for x in xs)
    return round(total * total / (len(xs) * squares), 3) if squares else float("nan")


async def _ledger_rows(c: Any, ids: Sequence[str]) -> dict[str, dict[str, Any]]:
    """The decision ledger's row of each request id that has its first token recorded (the
    projection trails the stream: a row without ``prefill_ts`` is asked for again)."""
    rows: dict[str, dict[str, Any]] = {}
    async with httpx.AsyncClient() as h:
        for _ in range(50):
            for rid in ids:
                if rid in rows:
                    continue
                r = await h.get(f"{c.router_urls[0]}/admin/requests/{rid}",
                                headers={"authorization": f"Bearer {c.admin_token}"})
                if r.status_code == 200 and r.json().get("prefill_ts") is not None:
                    rows[rid] = r.json()
            if len(rows) == len(ids):
                break
            await asyncio.sleep(0.2)
    return rows


async def breakdown(c: Any, traced: Sequence[tuple[str, str, float, float]], tenant: str
                    ) -> dict[str, Any]:
    """Where ``tenant``'s TTFT went, per request, from the ledger: waiting for a decision (the
    router queue), from the decision to the engine's first token as the router saw it (the
    engine's own queue and prefill), and from there to the client; and how many prompts the
    engine had ahead of it or beside it (routed there before it, first token not yet out when
    it was routed)."""
    rows = await _ledger_rows(c, [rid for _, rid, _, _ in traced])
    queue, engine, rest, shared = [], [], [], []
    for t, rid, sent, first in traced:
        row = rows.get(rid)
        if t != tenant or row is None:
            continue
        queue.append(row["routed_ts"] - sent)
        engine.append(row["prefill_ts"] - row["routed_ts"])
        rest.append(first - row["prefill_ts"])
        shared.append(sum(1 for o in rows.values() if o["request_id"] != rid
                          and o["worker_id"] == row["worker_id"]
                          and o["routed_ts"] < row["prefill_ts"]
                          and o["prefill_ts"] > row["routed_ts"]))
    shared.sort()
    return {"n": len(queue),
            "router_queue_p50_ms": _pct(queue, 0.5), "router_queue_p99_ms": _pct(queue, 0.99),
            "engine_p50_ms": _pct(engine, 0.5), "engine_p99_ms": _pct(engine, 0.99),
            "to_client_p50_ms": _pct(rest, 0.5), "to_client_p99_ms": _pct(rest, 0.99),
            "prompts_ahead_p50": shared[len(shared) // 2] if shared else None,
            "prompts_ahead_max": shared[-1] if shared else None}


async def part_b_d(args: argparse.Namespace, root: Path, skip: set[str], fair: bool
                   ) -> dict[str, Any]:
    name = "tfair" if fair else "tfcfs"
    router_args = ["--router-queue-threshold", str(args.queue_threshold),
                   *([] if fair else ["--no-tenant-fair-queue"]),
                   *([] if args.tenant_headroom is None or not fair
                     else ["--tenant-headroom", str(args.tenant_headroom)])]
    c = _cluster(root, name, args, replicas=args.replicas, workers=args.workers,
                 router_args=router_args,
                 worker_args=["--perf-model", "linear", "--prefill-ms-per-token",
                              str(args.prefill_ms_per_token)])
    out: dict[str, Any] = {}
    async with c:
        await _ready([c], args.workers)
        load = Load(c.router_urls, args)
        try:
            if "b" not in skip:
                alone = await load.open_loop("victim", 1 / args.victim_interval, args.duration)
                out["victim_alone_breakdown"] = await breakdown(c, load.traced, "victim")
                load.traced.clear()
                stop = asyncio.Event()
                flood = asyncio.create_task(load.closed_loop("flood", args.flood_concurrency,
                                                             stop))
                await asyncio.sleep(1.0)  # let the flood's backlog form (not a sync point)
                with_flood = await load.open_loop("victim", 1 / args.victim_interval,
                                                  args.duration)
                stop.set()
                flooded = await flood
                out["victim_with_flood_breakdown"] = await breakdown(c, load.traced, "victim")
                load.traced.clear()
                for label, res in (("victim_alone", alone), ("victim_with_flood", with_flood)):
                    t = [x for s, x, _ in res if s == 200]
                    out[label] = {"n": len(t), "ttft_p50_ms": _pct(t, 0.5),
                                  "ttft_p99_ms": _pct(t, 0.99),
                                  "errors": sum(1 for s, _, _ in res if s != 200)}
                out["flood_served"] = sum(1 for s, _, _ in flooded if s == 200)
            if "d" not in skip:
                stop = asyncio.Event()
                # Equal weights, unequal demand: t1 keeps 4x t2's requests waiting, and both
                # have more waiting than their share of the engines can serve (backlogged).
                runs = [asyncio.create_task(load.closed_loop("t1", 2 * args.flood_concurrency,
                                                             stop)),
                        asyncio.create_task(load.closed_loop("t2", args.flood_concurrency // 2,
                                                             stop))]
                await asyncio.sleep(args.duration)  # the measured interval itself
                stop.set()
                served = [sum(n for s, _, n in await r if s == 200) for r in runs]
                out["jain"] = {"tokens_t1": served[0], "tokens_t2": served[1],
                               "index": jain(served)}
        finally:
            await load.aclose()
    return out


async def run_bench(args: argparse.Namespace, log: Any) -> dict[str, Any]:
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    root = Path(tempfile.mkdtemp(prefix="jetrouter-tenants-"))
    result: dict[str, Any] = {"params": {k: getattr(args, k) for k in PARAMS}}
    if not {"a", "c"} <= skip:
        log("bench tenants: (a) fleet-wide vs per-replica limits, (c) SIGKILL mid-flood ...")
        result.update(await part_a_c(args, root, skip))
    if not {"b", "d"} <= skip:
        for fair in (False, True):
            log(f"bench tenants: (b) victim TTFT, (d) Jain's index, {'fair' if fair else 'fcfs'}")
            result["fair" if fair else "fcfs"] = await part_b_d(args, root, skip, fair)
    return result


def format_report(r: dict[str, Any]) -> str:
    lines = []
    for key, title in (("a_fleet_wide", "(a) fleet-wide"), ("a_per_replica", "(a) per-replica"),
                       ("c_sigkill_mid_flood", "(c) fleet-wide, SIGKILL mid-flood")):
        if key in r:
            x = r[key]
            lines.append(f"{title:36} admitted {x['admitted']:5} of {x['offered']:5} offered: "
                         f"{x['admitted_over_limit']:.3f}x the limit, overshoot "
                         f"{x['overshoot_requests']} req ({x['overshoot_ms_of_traffic']} ms of "
                         f"traffic)" + (f"; counted by each replica {x['counted_by_each_replica']}"
                                        f", cut by the kill {x['cut_by_kill']}"
                                        if "killed" in x else ""))
    for mode in ("fcfs", "fair"):
        x = r.get(mode, {})
        for label in ("victim_alone", "victim_with_flood"):
            if label in x:
                v = x[label]
                lines.append(f"(b) {mode:4} {label:18} TTFT p50 {v['ttft_p50_ms']:8} ms  "
                             f"p99 {v['ttft_p99_ms']:8} ms  (n={v['n']}, errors {v['errors']})")
                b = x.get(label + "_breakdown")
                if b:
                    lines.append(
                        f"      of which router queue p50/p99 {b['router_queue_p50_ms']} / "
                        f"{b['router_queue_p99_ms']} ms, decision to first token "
                        f"{b['engine_p50_ms']} / {b['engine_p99_ms']} ms, prompts ahead at "
                        f"the engine median {b['prompts_ahead_p50']}, max "
                        f"{b['prompts_ahead_max']}")
        if "flood_served" in x:
            lines.append(f"(b) {mode:4} flood served {x['flood_served']} requests beside the "
                         f"victim")
        if "jain" in x:
            j = x["jain"]
            lines.append(f"(d) {mode:4} Jain's index {j['index']} (tokens t1 {j['tokens_t1']}, "
                         f"t2 {j['tokens_t2']})")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    result = asyncio.run(run_bench(args, (lambda m: None) if args.json else
                                   (lambda m: print(m, file=sys.stderr))))
    if not args.json:
        print(format_report(result))
    print(json.dumps(result, sort_keys=True, default=str))
    return 0
