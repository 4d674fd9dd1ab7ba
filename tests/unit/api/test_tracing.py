"""OpenTelemetry tracing of the request path (api/tracing.py), end to end in one process.

A replica on the in-memory event log is served by uvicorn on a loopback socket (through
``FrontDoor``, as `serve` does), in front of simulated engines on their own sockets, and exports
to an OTLP receiver on a third socket (bench/otlp_receiver.py: a real OTLP/HTTP server decoding
``ExportTraceServiceRequest``; a real gRPC ``TraceService`` for the grpc protocol). The engines
record the request headers they receive, so the ``traceparent`` sent on each hop is checked
where it arrives. Spans are read after the replica stopped: its shutdown flushes the exporter.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import uvicorn
from starlette.types import Receive, Scope, Send

from api.app import AppConfig, create_app
from api.tracing import PROTOCOL_ENV, http_traces_url
from bench.otlp_receiver import GrpcReceiver, HttpReceiver, ReceivedSpan
from eventlog.events import WorkerRegistered
from eventlog.memory import MemoryLog
from eventlog.names import KV, Names
from leanhttp.hotpath import FrontDoor
from replicas.core.state import StateConfig
from replicas.runtime.replica import Replica, ReplicaConfig
from tests.unit.api.test_app import ENGINE, MODEL
from tests.waiting import until
from workers.scheduler import EngineConfig
from workers.server import WorkerRuntime, WorkerSettings
from workers.server import create_app as create_worker_app

pytestmark = pytest.mark.timeout(90)

NAMES = Names("jr")
SERVER, CLIENT = 2, 3  # opentelemetry.proto Span.SpanKind


@dataclass
class Engine:
    worker_id: str
    url: str
    role: str
    headers: list[dict[str, str]] = field(default_factory=list)  # of each POST received


async def _serve(app: Any, what: str) -> AsyncIterator[str]:
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                           access_log=False, lifespan="on"))
    serving = asyncio.create_task(server.serve())
    try:
        await until(lambda: server.started or serving.done(), timeout=20, what=f"{what} started")
        assert server.started, f"{what} did not start"
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(serving, 20)


@contextlib.asynccontextmanager
async def engine(worker_id: str, role: str = "both", engine: EngineConfig = ENGINE,
                 hold: asyncio.Event | None = None) -> AsyncIterator[Engine]:
    """A simulated engine on a loopback socket that notes the headers of every POST; with
    ``hold``, a POST goes on to the engine only once it is set (a request the engine is still
    busy with, for as long as the test needs)."""
    runtime = WorkerRuntime(WorkerSettings(worker_id, model=MODEL, nats_url="", engine=engine,
                                           role=role))
    inner = create_worker_app(runtime)
    seen = Engine(worker_id, "", role)

    async def recording(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            seen.headers.append({k.decode(): v.decode() for k, v in scope["headers"]})
            if hold is not None:
                await asyncio.wait_for(hold.wait(), 60)
        await inner(scope, receive, send)

    async for url in _serve(recording, f"engine {worker_id}"):
        seen.url = url
        yield seen


@contextlib.asynccontextmanager
async def traced_router(endpoint: str, engines: list[tuple[str, str, str]],
                        queue_threshold: float | None = None) -> AsyncIterator[str]:
    """A replica exporting to ``endpoint``, with engines ``(worker_id, url, role)`` registered."""
    log = MemoryLog()
    replica = Replica(ReplicaConfig("r1", "", state=StateConfig(block_size=ENGINE.block_size),
                                    seed=3, durable=False, canary_interval=0,
                                    queue_threshold=queue_threshold), log=log)
    app = create_app(replica, AppConfig(ready_wait=0, otlp_traces_endpoint=endpoint))
    async for url in _serve(FrontDoor(app), "router"):
        for worker_id, worker_url, role in engines:
            seq = await log.append(NAMES.kv_subject(worker_id), [WorkerRegistered(
                worker_id, worker_url, MODEL, ENGINE.block_size, ENGINE.num_gpu_blocks,
                ENGINE.max_num_batched_tokens, time.time(), role=role)],
                f"{worker_id}.registered")
            await replica.wait_applied(KV, seq)
        yield url


def client_traceparent() -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, f"00-{trace_id}-{span_id}-01"


def parsed_traceparent(headers: dict[str, str]) -> tuple[str, str]:
    version, trace_id, parent_id, _flags = headers["traceparent"].split("-")
    assert version == "00"
    return trace_id, parent_id


def one(spans: list[ReceivedSpan], name: str, **attrs: Any) -> ReceivedSpan:
    found = [s for s in spans if s.name == name
             and all(s.attributes.get(k) == v for k, v in attrs.items())]
    assert len(found) == 1, (name, attrs, [(s.name, s.attributes) for s in spans])
    return found[0]


CHAT = {"model": MODEL, "max_tokens": 6, "stream": True,
        "messages": [{"role": "user", "content": "Follow this request through the router."}]}


async def test_a_request_continues_the_clients_trace_through_decision_and_hop() -> None:
    trace_id, client_span, traceparent = client_traceparent()
    with HttpReceiver() as receiver:
        async with engine("w1") as e1, engine("w2") as e2:
            engines = [(e.worker_id, e.url, e.role) for e in (e1, e2)]
            async with traced_router(receiver.endpoint, engines) as url, \
                    httpx.AsyncClient(base_url=url, timeout=30) as client:
                async with client.stream("POST", "/v1/chat/completions", json=CHAT,
                                         headers={"traceparent": traceparent}) as response:
                    assert response.status_code == 200
                    body = (await response.aread()).decode()
                assert body.rstrip().endswith("data: [DONE]")
                request_id = response.headers["x-jetrouter-request-id"]
                worker = response.headers["x-jetrouter-worker"]
        spans = receiver.snapshot()
    assert {s.trace_id for s in spans} == {trace_id}
    request = one(spans, "POST /v1/chat/completions")
    assert request.parent_span_id == client_span and request.kind == SERVER
    assert request.service == "jetrouter"
    assert request.attributes["jetrouter.request_id"] == request_id
    assert request.attributes["gen_ai.request.model"] == MODEL
    assert request.attributes["jetrouter.replica_id"] == "r1"
    assert request.attributes["jetrouter.worker_id"] == worker
    assert request.attributes["http.response.status_code"] == 200

    decision = one(spans, "jetrouter.route")
    assert decision.parent_span_id == request.span_id
    a = decision.attributes
    assert a["jetrouter.request_id"] == request_id and a["jetrouter.worker_id"] == worker
    assert sorted(a["jetrouter.candidates.worker_id"]) == ["w1", "w2"]
    assert a["jetrouter.candidates.considered"] == 2
    for term in ("dp_rank", "overlap_blocks", "prefill_blocks", "decode_blocks", "cost", "busy"):
        assert len(a[f"jetrouter.candidates.{term}"]) == 2, term
    assert all(isinstance(c, float) for c in a["jetrouter.candidates.cost"])
    assert a["jetrouter.overlap_blocks"] >= 0 and a["jetrouter.isl_tokens"] > 0

    hop = one(spans, "jetrouter.hop")
    assert hop.parent_span_id == request.span_id and hop.kind == CLIENT
    assert hop.attributes["jetrouter.worker_id"] == worker
    assert hop.attributes["jetrouter.outcome"] == "ok"
    assert hop.attributes["http.response.status_code"] == 200
    # The engine that served it received the hop's traceparent: vLLM's spans join this trace.
    served = e1 if worker == "w1" else e2
    assert [parsed_traceparent(h) for h in served.headers] == [(trace_id, hop.span_id)]


async def test_a_migration_is_a_span_with_its_new_decision_and_both_hops() -> None:
    """w0 refuses connections. While a long stream keeps w1 loaded, w0 is the cheaper engine,
    so the second request goes there first and moves to w1."""
    with HttpReceiver() as receiver:
        async with engine("w1") as e1:
            dead = "http://127.0.0.1:9"
            engines = [("w0", dead, "both"), ("w1", e1.url, "both")]
            async with traced_router(receiver.endpoint, engines) as url, \
                    httpx.AsyncClient(base_url=url, timeout=30) as client:
                long = {**CHAT, "max_tokens": 2000}
                async with client.stream("POST", "/v1/chat/completions", json=long) as held:
                    assert held.status_code == 200
                    short = {**CHAT, "stream": False,
                             "messages": [{"role": "user", "content": "another one"}]}
                    response = await client.post("/v1/chat/completions", json=short)
                    assert response.status_code == 200, response.text
                    # w1 carries the held stream's load: w0 was the cheaper engine.
                    assert response.headers["x-jetrouter-migrations"] == "1"
                    migrated = response.headers["x-jetrouter-request-id"]
        spans = receiver.snapshot()
    move = one(spans, "jetrouter.migrate", **{"jetrouter.request_id": migrated})
    request = one(spans, "POST /v1/chat/completions", **{"jetrouter.request_id": migrated})
    assert move.parent_span_id == request.span_id and move.trace_id == request.trace_id
    assert move.attributes["jetrouter.from_worker_id"] == "w0"
    assert move.attributes["jetrouter.reason"] == "connect_error"
    assert move.attributes["jetrouter.migrated"] is True
    rerouted = one(spans, "jetrouter.route", **{"jetrouter.request_id": f"{migrated}~1"})
    assert rerouted.parent_span_id == move.span_id
    assert rerouted.attributes["jetrouter.excluded"] == ["w0"]
    assert rerouted.attributes["jetrouter.candidates.worker_id"] == ["w1"]
    failed = one(spans, "jetrouter.hop", **{"jetrouter.request_id": migrated})
    assert failed.attributes["jetrouter.outcome"] == "migrated" and failed.status_code == 2
    assert failed.attributes["jetrouter.hop.failure"] == "connect_error"
    second = one(spans, "jetrouter.hop", **{"jetrouter.request_id": f"{migrated}~1"})
    assert second.attributes["jetrouter.outcome"] == "ok"
    assert second.attributes["jetrouter.worker_id"] == "w1"
    assert failed.parent_span_id == second.parent_span_id == request.span_id


async def test_a_disaggregated_request_has_a_prefill_hop_and_a_decode_hop() -> None:
    trace_id, _, traceparent = client_traceparent()
    with HttpReceiver() as receiver:
        async with engine("p1", "prefill") as p1, engine("d1", "decode") as d1:
            engines = [(e.worker_id, e.url, e.role) for e in (p1, d1)]
            async with traced_router(receiver.endpoint, engines) as url, \
                    httpx.AsyncClient(base_url=url, timeout=30) as client:
                response = await client.post("/v1/chat/completions", json=CHAT,
                                             headers={"traceparent": traceparent})
                assert response.status_code == 200, response.text
                request_id = response.headers["x-jetrouter-request-id"]
        spans = receiver.snapshot()
    request = one(spans, "POST /v1/chat/completions")
    prefill = one(spans, "jetrouter.hop", **{"jetrouter.request_id": f"{request_id}~prefill"})
    decode = one(spans, "jetrouter.hop", **{"jetrouter.request_id": request_id})
    assert prefill.attributes["jetrouter.phase"] == "prefill"
    assert prefill.attributes["jetrouter.worker_id"] == "p1"
    assert decode.attributes["jetrouter.phase"] == "decode"
    assert decode.attributes["jetrouter.worker_id"] == "d1"
    assert prefill.parent_span_id == decode.parent_span_id == request.span_id
    assert len([s for s in spans if s.name == "jetrouter.route"]) == 2
    assert [parsed_traceparent(h) for h in p1.headers] == [(trace_id, prefill.span_id)]
    assert [parsed_traceparent(h) for h in d1.headers] == [(trace_id, decode.span_id)]


async def queue_depth(client: httpx.AsyncClient) -> float:
    """The replica's ``jetrouter_queue_depth`` gauge, as its /metrics shows it."""
    text = (await client.get("/metrics")).text
    return next(float(line.split()[-1]) for line in text.splitlines()
                if line.startswith("jetrouter_queue_depth"))


async def test_a_request_held_in_the_router_queue_has_a_queue_span() -> None:
    """With a queue threshold, a request arriving while the only engine still prefills the
    first one waits in the router queue until that prefill is done. The engine holds the first
    request until the second is seen queued (a real-time prefill raced the second request's
    arrival on a busy machine: it could be over first)."""
    busy = asyncio.Event()
    with HttpReceiver() as receiver:
        async with engine("w1", hold=busy) as e1:
            async with traced_router(receiver.endpoint, [("w1", e1.url, "both")],
                                     queue_threshold=0.001) as url, \
                    httpx.AsyncClient(base_url=url, timeout=60) as client:
                bodies = [{"model": MODEL, "max_tokens": 2, "prompt": f"{n} " + "x" * 3000}
                          for n in range(2)]
                first = asyncio.create_task(client.post("/v1/completions", json=bodies[0]))
                await until(lambda: e1.headers, timeout=20, what="the first request at w1")
                second = asyncio.create_task(client.post("/v1/completions", json=bodies[1]))
                await until(lambda: queue_depth(client), lambda depth: depth == 1, timeout=20,
                            what="the second request in the router queue")
                busy.set()
                assert (await second).status_code == 200 and (await first).status_code == 200
                waited = (await second).headers["x-jetrouter-request-id"]
        spans = receiver.snapshot()
    decision = one(spans, "jetrouter.route", **{"jetrouter.request_id": waited})
    queue = one(spans, "jetrouter.queue")
    assert queue.parent_span_id == decision.span_id
    assert queue.attributes["jetrouter.request_id"] == waited


async def test_passthrough_hops_and_the_other_routes_are_traced_too() -> None:
    """``n > 1`` is forwarded verbatim (api/forward/passthrough.py), and so is every request of
    the routes outside the hot path (embeddings here): the same request and hop spans."""
    trace_id, _, traceparent = client_traceparent()
    with HttpReceiver() as receiver:
        async with engine("w1") as e1:
            async with traced_router(receiver.endpoint, [("w1", e1.url, "both")]) as url, \
                    httpx.AsyncClient(base_url=url, timeout=30) as client:
                response = await client.post("/v1/chat/completions", json={
                    **CHAT, "stream": False, "n": 2}, headers={"traceparent": traceparent})
                assert response.status_code == 200, response.text
                response = await client.post("/v1/embeddings", json={
                    "model": MODEL, "input": "embed me"}, headers={"traceparent": traceparent})
                assert response.status_code == 200, response.text
        spans = receiver.snapshot()
    hops = {s.span_id: s for s in spans if s.name == "jetrouter.hop"}
    for route in ("/v1/chat/completions", "/v1/embeddings"):
        request = one(spans, f"POST {route}")
        hop = next(h for h in hops.values() if h.parent_span_id == request.span_id)
        assert hop.attributes["jetrouter.outcome"] == "ok"
        assert request.attributes["jetrouter.request_id"] == hop.attributes["jetrouter.request_id"]
    assert sorted(parsed_traceparent(h) for h in e1.headers) == sorted(
        (trace_id, span_id) for span_id in hops)


async def test_the_grpc_protocol_exports_the_same_spans(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PROTOCOL_ENV, "grpc")
    with GrpcReceiver() as receiver:
        async with engine("w1") as e1:
            async with traced_router(receiver.endpoint, [("w1", e1.url, "both")]) as url, \
                    httpx.AsyncClient(base_url=url, timeout=30) as client:
                response = await client.post("/v1/completions", json={
                    "model": MODEL, "max_tokens": 3, "prompt": "over gRPC"})
                assert response.status_code == 200, response.text
        spans = receiver.snapshot()
    request = one(spans, "POST /v1/completions")
    assert request.parent_span_id == ""  # no traceparent from this client: a new trace
    assert one(spans, "jetrouter.route").parent_span_id == request.span_id
    hop = one(spans, "jetrouter.hop")
    assert [parsed_traceparent(h) for h in e1.headers] == [(request.trace_id, hop.span_id)]


def test_an_otlp_http_base_url_gets_the_traces_path() -> None:
    assert http_traces_url("http://collector:4318") == "http://collector:4318/v1/traces"
    assert http_traces_url("http://collector:4318/") == "http://collector:4318/v1/traces"
    assert http_traces_url("http://c:4318/custom/traces") == "http://c:4318/custom/traces"


_WITHOUT_EXTRA = """
import importlib.abc, sys
class Missing(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.startswith(("opentelemetry.sdk", "opentelemetry.exporter")):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Missing())
"""


def _python(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=60, cwd=root)


def test_without_the_extra_serve_refuses_the_flag_in_one_line() -> None:
    done = _python(_WITHOUT_EXTRA + "from api.cli import main\nsys.exit(main(sys.argv[1:]))",
                   "serve", "--otlp-traces-endpoint", "http://127.0.0.1:4318")
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "jetrouter[tracing]" in lines[0], done.stderr


def test_without_the_flag_nothing_of_the_sdk_is_imported() -> None:
    done = _python(_WITHOUT_EXTRA + """
from api.app import AppConfig, create_app
from eventlog.memory import MemoryLog
from replicas.runtime.replica import Replica, ReplicaConfig
replica = Replica(ReplicaConfig("r1", "", durable=False, canary_interval=0), log=MemoryLog())
create_app(replica, AppConfig())
assert replica.tracer is None
print(sorted(m for m in sys.modules if m.startswith(("opentelemetry.sdk", "opentelemetry.exp"))))
""")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_up_passes_the_endpoint_to_its_replicas() -> None:
    from api.cli import build_parser
    from cluster import up

    args = build_parser(["up"]).parse_args(["up", "--otlp-traces-endpoint", "http://c:4318"])
    router, worker = up.forwarded_args(args)
    assert router == ["--otlp-traces-endpoint=http://c:4318"] and worker == []
