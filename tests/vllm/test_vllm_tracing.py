"""One trace from the client through a jetrouter replica into a real vLLM (opt-in, ``-m vllm``).

The replica (``--otlp-traces-endpoint``) and the engine (vLLM's own ``--otlp-traces-endpoint``)
export to the same OTLP/HTTP receiver in this process (bench/otlp_receiver.py). vLLM continues
the ``traceparent`` the router sends on the hop, so its ``llm_request`` span must be a child of
the router's ``jetrouter.hop`` span, in the client's trace. vLLM traces only when its
environment has the OpenTelemetry packages; without them the test is skipped, not failed.

Its own cluster (one engine, one replica): tracing is a start-up flag of both processes, so the
shared cluster of test_real_vllm.py cannot be reused.
"""

from __future__ import annotations

import os
import secrets
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio

from bench.otlp_receiver import HttpReceiver
from tests.vllm.tiny_cluster import started, tiny_cluster
from tests.waiting import until
from workers.vllm import env as vllm_env

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900),
              pytest.mark.asyncio(loop_scope="module")]

PROTOCOL = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"


def _vllm_can_trace() -> bool:
    python = vllm_env.venv_python()
    if not Path(python).exists():
        return False
    # What vLLM's own tracing module imports before it will trace, and the HTTP exporter.
    done = subprocess.run([str(python), "-c", "import opentelemetry.sdk, opentelemetry.semconv_ai, "
                           "opentelemetry.exporter.otlp.proto.http.trace_exporter"],
                          capture_output=True, timeout=120)
    return done.returncode == 0


@pytest.fixture(scope="module")
def receiver() -> Any:
    with HttpReceiver() as r:
        yield r


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def traced_cluster(vllm_model: Path, vllm_dir: Path, receiver: HttpReceiver
                         ) -> AsyncIterator[Any]:
    if not _vllm_can_trace():
        pytest.skip("the vLLM environment has no OpenTelemetry SDK/exporter: vLLM cannot trace")
    saved = os.environ.get(PROTOCOL)
    # Both processes inherit it: vLLM's default is grpc, the receiver speaks OTLP/HTTP.
    os.environ[PROTOCOL] = "http/protobuf"
    cluster = tiny_cluster(vllm_model, vllm_dir / "traced", engines=1, replicas=1,
                           router_args=["--otlp-traces-endpoint", receiver.endpoint])
    for engine in cluster.engines:
        engine.extra_args = [*engine.extra_args, "--otlp-traces-endpoint", receiver.endpoint]
    try:
        async with started(cluster):
            yield cluster
    finally:
        if saved is None:
            os.environ.pop(PROTOCOL, None)
        else:
            os.environ[PROTOCOL] = saved


async def test_vllms_spans_join_the_clients_trace_under_the_routers_hop(
        traced_cluster: Any, receiver: HttpReceiver) -> None:
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    async with httpx.AsyncClient(timeout=120.0) as client:
        response = await client.post(
            traced_cluster.router_urls[0] + "/v1/completions",
            json={"model": "tiny", "prompt": [5, 6, 7, 8, 9, 10], "max_tokens": 3},
            headers={"traceparent": f"00-{trace_id}-{client_span}-01"})
    assert response.status_code == 200, response.text
    # Both processes export in batches (every few seconds): wait for the engine's span and
    # the router's hop span.
    await until(lambda: {s.service == "jetrouter" for s in receiver.snapshot()
                         if s.trace_id == trace_id and s.name != "POST /v1/completions"},
                lambda kinds: kinds == {True, False}, timeout=60,
                what="vLLM's and the router's spans in the client's trace")
    spans = [s for s in receiver.snapshot() if s.trace_id == trace_id]
    request = next(s for s in spans if s.name == "POST /v1/completions")
    assert request.parent_span_id == client_span
    hop = next(s for s in spans if s.name == "jetrouter.hop")
    assert hop.parent_span_id == request.span_id
    engine_spans = [s for s in spans if s.service != "jetrouter"]
    assert any(s.parent_span_id == hop.span_id for s in engine_spans), \
        [(s.name, s.service, s.parent_span_id) for s in engine_spans]
