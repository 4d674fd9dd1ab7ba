"""What the real-vLLM tests share: a cluster of vLLM engines serving the tiny model, started with
KV-aware routing and stopped after, and prompts of random ids."""

from __future__ import annotations

import random
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from workers.vllm import env as vllm_env


def token_ids(seed: int, n: int) -> list[int]:
    """Random ids clear of the tiny tokenizer's special ids (0..2): prompts no test shares."""
    rng = random.Random(seed)
    return [rng.randrange(3, 2000) for _ in range(n)]


def tiny_cluster(model: Path, data_dir: Path, *, router_args: Sequence[str] = (),
                 **options: Any) -> Any:
    """A ``VllmCluster`` of ``model`` in ``data_dir``, not started: 256 KV blocks an engine, the
    shared compile cache, the routers given the model's folder and then ``router_args``;
    ``options`` as ``VllmCluster``'s own (engines, replicas, roles, bridge arguments, ...)."""
    from launch.vllm_cluster import VllmCluster, router_model_args

    return VllmCluster(python=vllm_env.venv_python(), model_dir=model, data_dir=data_dir,
                       num_gpu_blocks=256, cache_root=vllm_env.CACHE_ROOT,
                       router_args=[*router_model_args(model), *router_args],
                       progress=sys.stderr, **options)


@asynccontextmanager
async def started(cluster: Any) -> AsyncIterator[Any]:
    """``cluster`` started with KV-aware routing (``kv``), stopped on the way out however the
    block ends."""
    try:
        await cluster.start("kv")
        yield cluster
    finally:
        await cluster.stop()
