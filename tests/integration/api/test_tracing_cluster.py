"""`jetrouter up --otlp-traces-endpoint`: real replica processes (on a real nats-server) export
each request's spans to an OTLP/HTTP receiver in this process: the flag travels from `up` to
`serve` to the app, and the client's trace is continued."""

from __future__ import annotations

import secrets
from pathlib import Path

import httpx
import pytest

from bench.otlp_receiver import HttpReceiver
from cluster.up import forwarded_args
from launch.local_cluster import LocalCluster
from tests.waiting import until

pytestmark = [pytest.mark.timeout(120)]
MODEL = "jetrouter-sim"


async def test_replicas_started_by_up_export_the_clients_trace(tmp_path: Path) -> None:
    from api.cli import build_parser

    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    with HttpReceiver() as receiver:
        args = build_parser(["up"]).parse_args(
            ["up", "--otlp-traces-endpoint", receiver.endpoint])
        router_args, worker_args = forwarded_args(args)  # what `up` hands its replicas
        async with LocalCluster(replicas=1, workers=1, data_dir=tmp_path, namespace="trc",
                                router_args=router_args, worker_args=worker_args) as cluster:
            async with httpx.AsyncClient(timeout=30) as client:
                await until(lambda: client.get(cluster.router_urls[0] + "/v1/models"),
                            lambda r: bool(r.json()["data"]), timeout=30, what="a worker",
                            tolerate=(httpx.HTTPError,))
                response = await client.post(
                    cluster.router_urls[0] + "/v1/completions",
                    json={"model": MODEL, "prompt": "traced", "max_tokens": 3},
                    headers={"traceparent": f"00-{trace_id}-{client_span}-01"})
                assert response.status_code == 200, response.text
            # Exported in batches every few seconds; the replica also flushes when it stops.
            await until(lambda: {s.name for s in receiver.snapshot()},
                        lambda names: {"jetrouter.route", "jetrouter.hop"} <= names,
                        timeout=30, what="the request's spans exported")
        spans = [s for s in receiver.snapshot() if s.trace_id == trace_id]
    request = next(s for s in spans if s.name == "POST /v1/completions")
    assert request.parent_span_id == client_span
    assert request.attributes["jetrouter.request_id"] == response.headers[
        "x-jetrouter-request-id"]
    hop = next(s for s in spans if s.name == "jetrouter.hop")
    assert hop.parent_span_id == request.span_id
    assert hop.attributes["jetrouter.outcome"] == "ok"
