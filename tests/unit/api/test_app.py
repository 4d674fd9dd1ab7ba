"""`create_app` served in-process on the in-memory event log: the router app through
httpx.ASGITransport, a simulated engine (workers.server) on a real loopback socket. No NATS, no
subprocess: what takes a cluster start in tests/integration/api/test_serving.py takes
milliseconds."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from api.app import AppConfig, create_app
from eventlog.events import PrefillCompleted, RequestFinished, RequestRouted, WorkerRegistered
from eventlog.memory import MemoryLog
from eventlog.names import KV, ROUTER, Names
from replicas.core.state import StateConfig
from replicas.runtime.replica import Replica, ReplicaConfig
from tests.waiting import until
from workers.scheduler import EngineConfig
from workers.server import WorkerRuntime, WorkerSettings
from workers.server import create_app as create_worker_app

pytestmark = pytest.mark.timeout(60)

MODEL = "jetrouter-sim"
NAMES = Names("jr")
ENGINE = EngineConfig(speedup_ratio=50.0)


@dataclass
class Router:
    app: FastAPI
    client: httpx.AsyncClient
    replica: Replica
    log: MemoryLog


@contextlib.asynccontextmanager
async def simulated_engine(worker_id: str) -> AsyncIterator[str]:
    """A worker (simulated engine, no NATS: it publishes nothing) on a free loopback port."""
    runtime = WorkerRuntime(WorkerSettings(worker_id, model=MODEL, nats_url="", engine=ENGINE))
    server = uvicorn.Server(uvicorn.Config(create_worker_app(runtime), host="127.0.0.1", port=0,
                                           log_level="warning", access_log=False,
                                           lifespan="on"))
    serving = asyncio.create_task(server.serve())
    try:
        await until(lambda: server.started or serving.done(), timeout=20, what="worker started")
        assert server.started, "the simulated engine did not start"
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(serving, 20)


@pytest.fixture
async def router() -> AsyncIterator[Router]:
    log = MemoryLog()
    replica = Replica(ReplicaConfig("r1", "", state=StateConfig(block_size=ENGINE.block_size),
                                    seed=3, durable=False, canary_interval=0), log=log)
    app = create_app(replica, AppConfig(ready_wait=0))
    async with app.router.lifespan_context(app):  # starts and stops the replica
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            yield Router(app, client, replica, log)


async def register(r: Router, worker_id: str, url: str) -> None:
    seq = await r.log.append(NAMES.kv_subject(worker_id), [WorkerRegistered(
        worker_id, url, MODEL, ENGINE.block_size, ENGINE.num_gpu_blocks,
        ENGINE.max_num_batched_tokens, time.time())], f"{worker_id}.registered")
    await r.replica.wait_applied(KV, seq)


async def test_models_lists_what_registered_workers_serve(router: Router) -> None:
    assert (await router.client.get("/v1/models")).json()["data"] == []
    await register(router, "w1", "http://127.0.0.1:9")
    body = (await router.client.get("/v1/models")).json()
    assert [m["id"] for m in body["data"]] == [MODEL]


async def test_a_chat_completion_is_routed_recorded_and_answered(router: Router) -> None:
    async with simulated_engine("w1") as url:
        await register(router, "w1", url)
        response = await router.client.post("/v1/chat/completions", json={
            "model": MODEL, "max_tokens": 4,
            "messages": [{"role": "user", "content": "Say hello to the router."}]})
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["object"] == "chat.completion"
        assert body["usage"]["completion_tokens"] == 4
        assert response.headers["x-jetrouter-worker"] == "w1"
        assert response.headers["x-jetrouter-replica"] == "r1"

        # The decision, the first token and the finish are on the router stream.
        stream = NAMES.stream(ROUTER)
        await until(lambda: router.log.bounds(stream), lambda b: b[1] == 3, timeout=10,
                    what="decision, prefill and finish recorded")
        reader = router.log.reader(stream)
        try:
            events = [e for _ in range(3) for e in (await anext(reader))[1]]
        finally:
            await reader.close()
        assert isinstance(events[0], RequestRouted) and events[0].worker_id == "w1"
        assert {type(e) for e in events[1:]} == {PrefillCompleted, RequestFinished}
        assert [e.outcome for e in events if isinstance(e, RequestFinished)] == ["ok"]
        assert router.replica.pending_decisions() == 0


async def test_an_unknown_model_is_an_openai_style_404(router: Router) -> None:
    await register(router, "w1", "http://127.0.0.1:9")
    response = await router.client.post("/v1/chat/completions", json={
        "model": "nope", "messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 404
    error = response.json()["error"]
    assert "nope" in error["message"] and error["type"]


@contextlib.asynccontextmanager
async def engine_failing_mid_read(tokens: list[str]) -> AsyncIterator[str]:
    """An engine whose whole answer arrives in one write: token events, then an error event."""
    events = b"".join(
        b'data: {"id":"cmpl-x","object":"text_completion","created":1,"model":"'
        + MODEL.encode() + b'","choices":[{"index":0,"text":"' + t.encode()
        + b'","finish_reason":null}]}\n\n' for t in tokens)
    events += b'data: {"error":{"message":"engine gave up"}}\n\n'

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:"))
            await reader.readexactly(length)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         b"transfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n"
                         % (len(events), events))
            await writer.drain()
        finally:
            writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()


async def test_tokens_read_with_an_error_event_reach_the_client_before_the_error(
        router: Router) -> None:
    # One read brings two tokens and the engine's error: the client gets both tokens (they
    # count as delivered), then, with no other engine to continue on, a clean error and [DONE].
    async with engine_failing_mid_read(["Hel", "lo"]) as url:
        await register(router, "w1", url)
        response = await router.client.post("/v1/completions", json={
            "model": MODEL, "max_tokens": 8, "stream": True, "prompt": "Say hello."})
        assert response.status_code == 200
        datas = [line.removeprefix("data: ") for line in response.text.split("\n\n") if line]
        assert ['"text":"Hel"' in datas[0], '"text":"lo"' in datas[1]] == [True, True]
        assert '"error"' in datas[2] and datas[3] == "[DONE]" and len(datas) == 4
        await until(lambda: router.replica.pending_decisions(), lambda n: n == 0, timeout=10,
                    what="the failed hop's decision settled")
