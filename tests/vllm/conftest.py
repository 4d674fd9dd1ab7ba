"""Opt-in tests against a real vLLM (``make test-vllm``).

They run only when selected with ``-m vllm`` AND the vLLM environment exists
(``.venv-vllm/`` or ``$JETROUTER_VLLM_VENV``; `deploy/vllm-venv.sh` makes it). A plain
``pytest`` / ``make test`` skips them: each engine start costs ~40 s and ~2.5 GB of memory.

One module-scoped cluster serves every test (two engines, two bridges, two replicas, NATS):
engine starts are the expensive part, so tests share them and use disjoint random prompts.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio

from tests.vllm.tiny_cluster import started, tiny_cluster
from workers.vllm import env as vllm_env


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    selected = "vllm" in (config.option.markexpr or "")
    ready = vllm_env.venv_ready()
    for item in items:
        if "vllm" not in item.keywords:
            continue
        if not selected:
            item.add_marker(pytest.mark.skip(reason="real-vLLM test: run with -m vllm "
                                                    "(make test-vllm)"))
        elif not ready:
            item.add_marker(pytest.mark.skip(
                reason=f"no vLLM environment at {vllm_env.venv_path()} (make vllm-env)"))


@pytest.fixture(scope="module")
def vllm_dir(request: pytest.FixtureRequest) -> Iterator[Path]:
    """Model and cluster logs, kept (and named on stderr) when a test failed: pytest's own
    temp dirs rotate away under parallel runs before anyone reads an engine's log."""
    root = Path(tempfile.mkdtemp(prefix="jetrouter-vllm-tests-"))
    failed_before = request.session.testsfailed
    yield root
    if request.session.testsfailed == failed_before:
        shutil.rmtree(root, ignore_errors=True)
    else:
        print(f"\nreal-vLLM test logs kept in {root / 'cluster' / 'logs'}", file=sys.stderr)


@pytest.fixture(scope="module")
def vllm_model() -> Path:
    """The small model (2 layers, hidden 128): the tests need real caching, not speed-ups."""
    return vllm_env.cached_model(layers=2, hidden=128)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def vllm_cluster(vllm_model: Path, vllm_dir: Path) -> AsyncIterator[object]:
    async with started(tiny_cluster(
            vllm_model, vllm_dir / "cluster", engines=2, replicas=2,
            # Fast retirement so the engine-kill test does not wait the default 10 s.
            bridge_args=["--unhealthy-after", "3", "--health-interval", "0.5"])) as cluster:
        yield cluster
