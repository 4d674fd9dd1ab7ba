"""`jetrouter bench restart`: SIGKILL a router replica of a local cluster and time how soon it is
back, ready and routing each seeded prompt to the engine that holds its prefix.

One run starts a `LocalCluster` (``--replicas``, ``--workers`` simulated engines) per mode and
compares them side by side:

* ``cold``: the supervisor restarts a killed replica as a fresh ``python -m api.cli serve``
  (``jetrouter up --no-standby``);
* ``standby``: a pre-imported standby process takes the dead replica's place
  (launch/standby_pool.py; ``jetrouter up``'s default).

Each mode seeds ``--prefixes`` prompts (one request each, recording which engine served it),
then ``--repeats`` times: waits until the cluster is settled (replica ready, standby waiting),
SIGKILLs replica ``r0`` and polls its ``/ready`` every 5 ms. Printed per kill: kill → ``/ready``
200, kill → the first answered request (a seeded prompt, new suffix), and how many seeded
prompts the restarted replica then sends to the engine that holds their prefix. Medians over the
repeats; never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.overhead import machine

__all__ = ["add_arguments", "run", "run_restart"]

MODES = ("cold", "standby")
WORKER_HEADER = "x-jetrouter-worker"
POLL_S = 0.005


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.description = __doc__
    p.add_argument("--replicas", type=int, default=1, help="router replicas (r0 is killed)")
    p.add_argument("--workers", type=int, default=4, help="simulated engines")
    p.add_argument("--prefixes", type=int, default=32, help="seeded prompt prefixes")
    p.add_argument("--prefix-chars", type=int, default=1024,
                   help="characters per seeded prefix (byte tokens: one token per byte)")
    p.add_argument("--repeats", type=int, default=5, help="kills per mode")
    p.add_argument("--modes", default=",".join(MODES),
                   help="comma-separated, from: " + ", ".join(MODES))
    p.add_argument("--ready-timeout", type=float, default=60.0,
                   help="seconds to wait for a killed replica to be ready again")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def _prompt(i: int, suffix: str, chars: int) -> str:
    head = f"seeded prefix {i:04d}: "
    body = (f"{i:04d} the quick brown fox jumps over the lazy dog " * (chars // 40 + 1))
    return (head + body)[:chars] + suffix


async def _complete(client: httpx.AsyncClient, url: str, prompt: str) -> str | None:
    """One one-token completion; the engine that served it, or None if it failed."""
    try:
        resp = await client.post(url + "/v1/completions", json={
            "model": "jetrouter-sim", "prompt": prompt, "max_tokens": 1, "temperature": 0})
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    return resp.headers.get(WORKER_HEADER)


async def _until_ready(client: httpx.AsyncClient, url: str, deadline: float) -> float | None:
    while time.monotonic() < deadline:
        try:
            if (await client.get(url + "/ready")).status_code == 200:
                return time.monotonic()
        except httpx.HTTPError:
            pass
        await asyncio.sleep(POLL_S)
    return None


async def _one_mode(mode: str, args: argparse.Namespace,
                    log: Any) -> dict[str, Any]:
    from launch.local_cluster import LocalCluster  # lazily: `bench --help` needs none of it

    root = Path(tempfile.mkdtemp(prefix=f"jetrouter-restart-{mode}-"))
    kills: list[dict[str, Any]] = []
    # stable_after: the bench kills every few seconds; the product's 30 s would make the
    # supervisor back off as from a crash loop, which is not what is being measured.
    cluster = LocalCluster(replicas=args.replicas, workers=args.workers, base_port=None,
                           data_dir=root, namespace=f"restart{mode}",
                           standby=(mode == "standby"), stable_after=1.0,
                           ready_timeout=args.ready_timeout)
    try:
        async with cluster, httpx.AsyncClient(timeout=httpx.Timeout(10.0, connect=0.5)) as client:
            url = cluster.router_urls[0]
            owner: dict[int, str] = {}
            for i in range(args.prefixes):
                worker = await _complete(client, url, _prompt(i, " seed", args.prefix_chars))
                if worker is not None:
                    owner[i] = worker
            log(f"{mode}: seeded {len(owner)} prefixes on "
                f"{len(set(owner.values()))} engines")
            for k in range(args.repeats):
                await cluster.wait_ready(["r0"])
                if cluster.standby is not None:
                    await cluster.standby.wait_ready(args.ready_timeout)
                await asyncio.sleep(1.1)  # past stable_after: a kill, not a crash loop
                cluster.kill("r0")
                killed = time.monotonic()
                ready = await _until_ready(client, url, killed + args.ready_timeout)
                if ready is None:
                    kills.append({"ready_s": None})
                    continue
                first = await _complete(client, url, _prompt(0, f" after kill {k}",
                                                             args.prefix_chars))
                answered = time.monotonic()
                right = 0
                for i, worker in owner.items():
                    got = await _complete(client, url, _prompt(i, f" check {k}",
                                                               args.prefix_chars))
                    right += got == worker
                kills.append({"ready_s": round(ready - killed, 3),
                              "first_answer_s": round(answered - killed, 3),
                              "first_answer_right_engine": first == owner.get(0),
                              "right_engine": right, "seeded": len(owner)})
                log(f"{mode} kill {k + 1}: ready after {ready - killed:.3f} s, "
                    f"{right}/{len(owner)} prompts to their engine")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    readies = [k["ready_s"] for k in kills if k.get("ready_s") is not None]
    answers = [k["first_answer_s"] for k in kills if k.get("first_answer_s") is not None]
    return {"kills": kills,
            "ready_s_median": round(statistics.median(readies), 3) if readies else None,
            "first_answer_s_median": round(statistics.median(answers), 3) if answers else None,
            "right_engine": sum(k.get("right_engine", 0) for k in kills),
            "checked": sum(k.get("seeded", 0) for k in kills)}


async def run_restart(args: argparse.Namespace, log: Any) -> dict[str, Any]:
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ValueError(f"--modes: unknown {', '.join(unknown)} (choose from {', '.join(MODES)})")
    result: dict[str, Any] = {"machine": machine(), "replicas": args.replicas,
                              "workers": args.workers, "prefixes": args.prefixes,
                              "repeats": args.repeats, "modes": {}}
    for mode in modes:
        result["modes"][mode] = await _one_mode(mode, args, log)
    cold, warm = (result["modes"].get(m, {}).get("ready_s_median") for m in MODES)
    if cold and warm:
        result["standby_vs_cold_ready"] = round(warm / cold, 3)
    return result


def format_report(r: dict[str, Any]) -> str:
    lines = [f"SIGKILL r0 of {r['replicas']} replica(s), {r['workers']} engines, "
             f"{r['prefixes']} seeded prefixes, {r['repeats']} kills per mode "
             f"({r['machine']['cpus']} CPUs, {r['machine']['cpu_model']})",
             f"{'mode':<9} {'kill->ready p50':>16} {'kill->answer p50':>17} "
             f"{'right engine':>13}"]
    for mode, m in r["modes"].items():
        ready = "-" if m["ready_s_median"] is None else f"{m['ready_s_median']:.3f} s"
        answer = ("-" if m["first_answer_s_median"] is None
                  else f"{m['first_answer_s_median']:.3f} s")
        lines.append(f"{mode:<9} {ready:>16} {answer:>17} "
                     f"{m['right_engine']:>6}/{m['checked']:<6}")
    if "standby_vs_cold_ready" in r:
        lines.append(f"standby / cold, kill->ready: {r['standby_vs_cold_ready']:.2f}x")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    quiet = bool(args.json)
    try:
        result = asyncio.run(run_restart(args, (lambda s: None) if quiet else
                                         (lambda s: print(f"  {s}", file=sys.stderr,
                                                          flush=True))))
    except ValueError as exc:
        print(f"jetrouter bench restart: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2) if quiet else format_report(result))
    return 0
