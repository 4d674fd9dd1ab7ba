"""`jetrouter bench scale`: routed req/s as replicas are added, and what replication costs each.

For each replica count in ``--replicas`` (default 1, 2, 4, … up to what ``os.cpu_count()`` can hold)
a fresh `launch.local_cluster.LocalCluster` starts with ``--nats-cluster`` nats-servers (default 3)
and ``--workers`` (alias ``--engines``) fast simulated engines (``--worker-speedup-ratio``); past
one engine per CPU core they share processes (``--engines-per-process``, `jetrouter worker
--engines`), so a 256-engine fleet is a few processes, each engine still a worker of its own. A
load generator of ``--load-processes`` OS processes (each an asyncio loop of keep-alive HTTP/1.1
connections, no HTTP library in the way) sends closed-loop ``/v1/completions`` requests — token-id
prompts, ``--prefixes`` shared prefixes plus a unique suffix, ``--max-tokens`` output tokens —
spread over the replicas.

Measured over ``--duration`` seconds after ``--warmup``:

* aggregate routed req/s (requests answered 200 inside the window, summed over processes);
* per replica, CPU cores used by the replica process and, apart, by its children (the projector),
  from ``/proc/<pid>/stat``, and its CPU per request routed through it (routing, forwarding and
  applying every replica's events); all replicas' CPU together per request;
* per replica, the replication share: seconds it spent decoding and applying *other* replicas'
  router-stream messages (its ``/admin/state`` ``replication`` counter) over its own CPU seconds;
* router-stream messages per request (each one is delivered to and applied by every replica);
* the CPU of the engines and of the nats-servers (all of them together), to see who saturates;
* the load generator's own CPU per process: it must not be the bottleneck. A process near 1.0
  core is saturated; raise ``--load-processes`` and check the req/s figure does not move.

After the load stops, every replica must reach the same stream positions with equal state
digests (``/admin/state``); the report says ``digests_equal`` per replica count.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.overhead import RawConnection, UnexpectedStatus, proc_cpu_seconds, split_url
from launch.children import children_of
from settings.flags import CliError

MODEL = "jetrouter-sim"
VOCAB = 30_000


def engines_per_process(engines: int, asked: int, cpus: int) -> int:
    """``asked`` when given, else as many per process as keep the engine processes to one per
    core (a few hundred fast simulated engines cost a few processes, not hundreds)."""
    return asked if asked > 0 else max(1, -(-engines // max(cpus, 1)))


def default_replica_counts(cpus: int) -> list[int]:
    """1, 2, 4, … while each replica can still have about one core (at least 1, 2, 4)."""
    top = max(4, cpus // 2)
    out, n = [], 1
    while n <= top:
        out.append(n)
        n *= 2
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    cpus = os.cpu_count() or 2
    p.add_argument("--replicas", default=",".join(map(str, default_replica_counts(cpus))),
                   help="comma-separated replica counts to run (default scales with CPUs)")
    p.add_argument("--workers", "--engines", type=int, default=max(2, cpus // 2),
                   help="simulated engines per cluster")
    p.add_argument("--engines-per-process", type=int, default=0,
                   help="simulated engines sharing one OS process (`jetrouter worker --engines`); "
                        "0: one process per CPU core at most, ceil(engines / CPUs) each")
    p.add_argument("--worker-speedup-ratio", type=float, default=1000.0,
                   help="simulated engine speed (high: the router is what is measured)")
    p.add_argument("--nats-cluster", type=int, default=3, help="nats-servers in the cluster")
    p.add_argument("--load-processes", type=int, default=max(2, cpus // 4),
                   help="OS processes generating load")
    p.add_argument("--concurrency", type=int, default=32,
                   help="connections per replica (spread over the load processes)")
    p.add_argument("--duration", type=float, default=10.0, help="measured seconds per run")
    p.add_argument("--warmup", type=float, default=3.0, help="unmeasured seconds before")
    p.add_argument("--prompt-tokens", type=int, default=80, help="prompt tokens per request")
    p.add_argument("--prefixes", type=int, default=8, help="shared prompt prefixes")
    p.add_argument("--max-tokens", type=int, default=1, help="output tokens per request")
    p.add_argument("--router-args", default="", help="extra `jetrouter serve` arguments")
    p.add_argument("--data-dir", type=Path, default=None,
                   help="keep each cluster's data and logs in DIR/r<N> (default: a temporary "
                        "dir, removed at the end)")
    p.add_argument("--json", action="store_true", help="print only the JSON object")


@dataclass(slots=True)
class LoadPlan:
    urls: list[str]
    connections: int
    start_at: float  # time.time() when the measured window opens
    end_at: float
    prompt_tokens: int
    prefixes: int
    max_tokens: int
    seed: int


def _bodies(plan: LoadPlan) -> tuple[list[list[int]], random.Random]:
    rng = random.Random(plan.seed)
    shared = random.Random(0)  # the same prefixes in every process
    prefix_len = plan.prompt_tokens * 4 // 5
    prefixes = [[shared.randrange(VOCAB) for _ in range(prefix_len)]
                for _ in range(max(plan.prefixes, 1))]
    return prefixes, rng


async def _drive(plan: LoadPlan) -> dict[str, Any]:
    prefixes, rng = _bodies(plan)
    suffix_len = plan.prompt_tokens - len(prefixes[0])
    counts: dict[str, Any] = {"ok": 0, "errors": 0, "ok_total": 0,
                              "by_url": dict.fromkeys(plan.urls, 0)}  # ok in the window

    async def connection(i: int) -> None:
        url = plan.urls[i % len(plan.urls)]
        conn = RawConnection(*split_url(url))
        try:
            while time.time() < plan.end_at:
                prompt = rng.choice(prefixes) + [rng.randrange(VOCAB) for _ in range(suffix_len)]
                body = json.dumps({"model": MODEL, "prompt": prompt,
                                   "max_tokens": plan.max_tokens, "temperature": 0}).encode()
                try:
                    status, _, _ = await conn.post("/v1/completions", body)
                except (UnexpectedStatus, OSError, asyncio.IncompleteReadError, ValueError):
                    conn.close()
                    status = 0
                    await asyncio.sleep(0.01)
                now = time.time()
                inside = plan.start_at <= now < plan.end_at
                if status == 200:
                    counts["ok_total"] += 1
                    counts["ok"] += inside
                    counts["by_url"][url] += inside
                else:
                    counts["errors"] += 1
        finally:
            conn.close()

    await asyncio.gather(*(connection(i) for i in range(plan.connections)))
    return counts


def _load_process(plan: LoadPlan, out: Any) -> None:
    """One load-generator process: drive, then report counts and its own CPU in the window."""
    cpu: dict[str, float] = {}

    async def main() -> dict[str, Any]:
        async def sample() -> None:
            await asyncio.sleep(max(plan.start_at - time.time(), 0))
            cpu["start"] = time.process_time()
            await asyncio.sleep(max(plan.end_at - time.time(), 0))
            cpu["end"] = time.process_time()

        sampler = asyncio.ensure_future(sample())
        counts = await _drive(plan)
        await sampler
        return counts

    counts = asyncio.run(main())
    counts["cpu_s"] = cpu.get("end", 0.0) - cpu.get("start", 0.0)
    out.put(counts)


def _nats_pids(cluster: Any) -> list[int]:
    nats = cluster._nats  # NatsServer, or NatsCluster with .servers; None for an external NATS
    servers = getattr(nats, "servers", [nats] if nats is not None else [])
    return [s.proc.pid for s in servers if getattr(s, "proc", None) is not None]


def _cpu(pids: Sequence[int]) -> float:
    return sum(s for p in pids if (s := proc_cpu_seconds(p)) is not None)


async def _admin_states(client: httpx.AsyncClient, urls: Sequence[str], token: str
                        ) -> list[dict[str, Any]]:
    headers = {"authorization": f"Bearer {token}"}
    return [(await client.get(u + "/admin/state", headers=headers)).json() for u in urls]


async def _until(probe: Any, ok: Any, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    value = None
    while time.monotonic() < deadline:
        try:
            value = await probe()
            if ok(value):
                return value
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.2)
    return value


async def run_one(replicas: int, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    from launch.local_cluster import LocalCluster

    data = root / f"r{replicas}"
    per_process = engines_per_process(args.workers, args.engines_per_process, os.cpu_count() or 1)
    cluster = LocalCluster(replicas=replicas, workers=args.workers, data_dir=data,
                           engines_per_process=per_process,
                           namespace=f"scale{replicas}", nats_cluster=args.nats_cluster,
                           router_args=args.router_args.split(),
                           worker_args=["--speedup-ratio", str(args.worker_speedup_ratio)],
                           ready_timeout=120.0)
    async with cluster, httpx.AsyncClient(timeout=10.0) as client:
        urls, token = cluster.router_urls, cluster.admin_token
        await _until(lambda: _admin_states(client, urls, token),
                     lambda ss: all(s["workers"] == args.workers for s in ss), 120.0)
        pids = {c.name: c.pid for c in cluster.children.values()
                if c.kind == "replica" and c.pid is not None}
        names = {c.url: c.name for c in cluster.children.values() if c.kind == "replica"}
        others = {"engines": [c.pid for c in cluster.children.values()
                              if c.kind in ("worker", "engines") and c.pid is not None],
                  "nats": _nats_pids(cluster)}
        procs = max(args.load_processes, 1)
        conns = max(args.concurrency * replicas // procs, 1)
        start_at = time.time() + args.warmup + 1.0  # +1 s: the processes' own start-up
        end_at = start_at + args.duration
        ctx = multiprocessing.get_context("spawn")
        out = ctx.Queue()
        workers = []
        for i in range(procs):
            # each process spreads its connections over every replica, starting at another one
            plan = LoadPlan(urls[i % len(urls):] + urls[:i % len(urls)], conns, start_at,
                            end_at, args.prompt_tokens, args.prefixes, args.max_tokens, 1000 + i)
            proc = ctx.Process(target=_load_process, args=(plan, out), daemon=True)
            proc.start()
            workers.append(proc)
        await asyncio.sleep(max(start_at - time.time(), 0))
        kids = {n: children_of(p) for n, p in pids.items()}
        cpu0 = {n: (_cpu([p]), _cpu(kids[n])) for n, p in pids.items()}
        other0 = {k: _cpu(v) for k, v in others.items()}
        states0 = await _admin_states(client, urls, token)
        rep0 = {s["replica_id"]: s.get("replication") or {} for s in states0}
        t0 = time.time()
        await asyncio.sleep(max(end_at - time.time(), 0))
        cpu1 = {n: (_cpu([p]), _cpu(kids[n])) for n, p in pids.items()}
        other1 = {k: _cpu(v) for k, v in others.items()}
        window = max(time.time() - t0, 1e-9)
        states1 = await _admin_states(client, urls, token)
        rep1 = {s["replica_id"]: s.get("replication") or {} for s in states1}
        # router-stream messages written in the window (every replica applies every one)
        messages = states1[0]["positions"]["router"] - states0[0]["positions"]["router"]
        results = [await asyncio.to_thread(out.get, True, args.duration + 120)
                   for _ in workers]
        for proc in workers:
            proc.join(timeout=10)
        final = await _until(
            lambda: _admin_states(client, urls, token),
            lambda ss: (len({json.dumps(s["positions"], sort_keys=True) for s in ss}) == 1
                        and all(max(s["lag"].values()) == 0 and s["active_requests"] == 0
                                for s in ss)), 60.0)
        # A replica that exited and was restarted (at start-up or under load) is a fault the
        # figures must not hide: its requests failed over and its CPU counters restarted.
        exits = {c.name: c.exits for c in cluster.children.values()
                 if c.kind == "replica" and c.exits}
        # how far the traffic spread: engines the index says hold blocks (they served requests)
        listed = (await client.get(urls[0] + "/admin/workers",
                                   headers={"authorization": f"Bearer {token}"})).json()
        holding = sum(w["cached_blocks"] > 0 for w in listed["workers"])
    routed = {n: sum(r["by_url"].get(u, 0) for r in results) for u, n in names.items()}
    per_replica = []
    for name in sorted(pids):
        own = cpu1[name][0] - cpu0[name][0]
        before, after = rep0.get(name, {}), rep1.get(name, {})
        spent = after.get("seconds", 0.0) - before.get("seconds", 0.0)
        events = after.get("events", 0) - before.get("events", 0)
        per_replica.append({
            "replica": name,
            "cpu_cores": round(own / window, 2),
            "requests": routed.get(name, 0),  # answered 200 through it inside the window
            # its own CPU (routing, forwarding, applying every replica's events) per request
            "cpu_ms_per_request": (round(own / routed[name] * 1e3, 3)
                                   if routed.get(name) else None),
            "children_cpu_cores": round((cpu1[name][1] - cpu0[name][1]) / window, 2),
            "replication_share": round(spent / own, 3) if own > 0 else None,
            # CPU per peer router event applied (decode + apply), from the replica's counter
            "replication_us_per_event": round(spent / events * 1e6, 1) if events else None,
        })
    ok = sum(r["ok"] for r in results)
    router_cpu = sum(cpu1[n][0] - cpu0[n][0] for n in pids)
    digests = {s["replica_id"]: s["digests"]["state"] for s in final or []}
    return {
        "replicas": replicas,
        "req_per_s": round(ok / args.duration, 1),
        "router_messages_per_request": round(messages / ok, 2) if ok else None,
        # every replica's CPU together per routed request: what adding replicas costs in all
        "router_cpu_ms_per_request": round(router_cpu / ok * 1e3, 3) if ok else None,
        "engines": args.workers,
        "engine_processes": len(others["engines"]),
        "engines_holding_blocks": holding,
        "engines_per_process": per_process,
        "errors": sum(r["errors"] for r in results),
        "per_replica": per_replica,
        "load_processes": procs,
        "load_cpu_cores": [round(r["cpu_s"] / args.duration, 2) for r in results],
        "engines_cpu_cores": round((other1["engines"] - other0["engines"]) / window, 2),
        "nats_cpu_cores": round((other1["nats"] - other0["nats"]) / window, 2),
        "digests_equal": bool(digests) and len(set(digests.values())) == 1
                         and len(digests) == replicas,
        "replica_exits": exits,
        **({"logs": str(data / "logs")} if args.data_dir is not None else {}),
    }


async def run_scale(args: argparse.Namespace, log: Any = None) -> dict[str, Any]:
    try:
        counts = [int(x) for x in str(args.replicas).split(",") if x.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise CliError("--replicas must list positive replica counts, e.g. 1,2,4")
    keep = args.data_dir is not None
    if keep:
        args.data_dir.mkdir(parents=True, exist_ok=True)
    root = args.data_dir if keep else Path(tempfile.mkdtemp(prefix="jetrouter-scale-"))
    runs = []
    try:
        for n in counts:
            if log is not None:
                log(f"bench scale: {n} replica(s) ...")
            runs.append(await run_one(n, args, root))
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)
    return {
        "runs": runs,
        "config": {k: getattr(args, k) for k in (
            "workers", "engines_per_process", "worker_speedup_ratio", "nats_cluster",
            "load_processes", "concurrency", "duration", "warmup", "prompt_tokens", "prefixes",
            "max_tokens", "router_args")},
        "machine": {"cpu_count": os.cpu_count(), "loadavg_1m": os.getloadavg()[0]},
    }


def format_report(result: dict[str, Any]) -> str:
    lines = ["replicas  req/s    msgs/req  errors  replica CPU (cores)   children CPU   "
             "replication share   load-gen CPU/process  engines  nats  digests equal"]
    for r in result["runs"]:
        per = r["per_replica"]
        lines.append(
            f"{r['replicas']:>8}  {r['req_per_s']:>7}  {r['router_messages_per_request']!s:>8}  "
            f"{r['errors']:>6}  "
            f"{' '.join(str(p['cpu_cores']) for p in per):<20}  "
            f"{' '.join(str(p['children_cpu_cores']) for p in per):<13}  "
            f"{' '.join(str(p['replication_share']) for p in per):<18}  "
            f"{' '.join(map(str, r['load_cpu_cores'])):<20}  "
            f"{r['engines_cpu_cores']:<7}  {r['nats_cpu_cores']:<4}  "
            f"{'yes' if r['digests_equal'] else 'NO'}")
    per_event = [f"{r['replicas']}: " + " ".join(str(p["replication_us_per_event"])
                                                  for p in r["per_replica"])
                 for r in result["runs"] if r["replicas"] > 1]
    lines.append("replication CPU per peer router event (us), per replica: "
                 + ("; ".join(per_event) or "-"))
    per_request = [f"{r['replicas']}: " + " ".join(str(p["cpu_ms_per_request"])
                                                    for p in r["per_replica"])
                   + f" (all replicas together {r['router_cpu_ms_per_request']})"
                   for r in result["runs"]]
    lines.append("replica CPU per request routed through it (ms), per replica: "
                 + "; ".join(per_request))
    lines.append("simulated engines: " + "; ".join(
        f"{r['replicas']}: {r['engines']} in {r['engine_processes']} process(es), "
        f"{r['engines_holding_blocks']} holding blocks" for r in result["runs"]))
    for r in result["runs"]:
        if r.get("replica_exits"):
            where = f" (logs: {r['logs']})" if "logs" in r else " (--data-dir keeps the logs)"
            lines.append(f"replica exits with {r['replicas']} replica(s): "
                         + ", ".join(f"{n} x{k}" for n, k in sorted(r["replica_exits"].items()))
                         + where)
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    result = asyncio.run(run_scale(args, None if args.json else
                                   (lambda m: print(m, file=sys.stderr))))
    if not args.json:
        print(format_report(result))
    print(json.dumps(result, sort_keys=True))
    return 0 if all(r["digests_equal"] and r["req_per_s"] > 0 for r in result["runs"]) else 1
