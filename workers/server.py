"""HTTP face of the simulated worker: OpenAI endpoints, health, metrics, fault injection.

:class:`WorkerRuntime` owns the engines (one per dp rank), the fault switches, the metrics and
the KV publisher; :func:`create_app` exposes it over FastAPI; :func:`serve` runs it under uvicorn
with a graceful SIGTERM: announce ``WorkerRetired`` first (so routers stop sending), refuse new
requests, let in-flight ones finish (bounded by ``shutdown_timeout``), flush events, exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import socket
import sys
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from eventlog.connect import NatsOptions
from eventlog.events import Role, WorkerRegistered
from eventlog.names import Names, check_token
from leanhttp.hotpath import (
    FrontDoor,
    LastChunk,
    LeanStreamingResponse,
    install_hot_routes,
    read_body,
)
from tokenization.model_tokenizer import load_codec
from tokenization.tokens import decode
from workers.choices import MAX_CHOICES, serve_choices
from workers.engine import Engine, RequestHandle
from workers.faults import FaultState, crash_now
from workers.handoff import add_prefill_route, transferred_tokens
from workers.messages_routes import add_messages_routes
from workers.metrics import WorkerMetrics
from workers.openai_shapes import (
    BadRequest,
    ResponseShaper,
    decode_body,
    error_body,
    parse_request,
    usage,
)
from workers.pooling_routes import add_pooling_routes
from workers.publisher import KvPublisher
from workers.responses_routes import add_responses_route
from workers.scheduler import EngineConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerSettings:
    worker_id: str
    model: str = "jetrouter-sim"
    host: str = "127.0.0.1"
    port: int = 8000
    nats_url: str = ""
    namespace: str = "jr"
    engine: EngineConfig = field(default_factory=EngineConfig)
    dp_size: int = 1
    advertise_url: str | None = None
    default_max_tokens: int = 256  # chat requests without max_tokens
    shutdown_timeout: float = 30.0
    load_interval: float = 0.5
    model_path: str | None = None  # a model folder: tokenize like the engine that serves it
    nats: NatsOptions = field(default_factory=NatsOptions)  # credentials and TLS
    role: str = "both"  # disaggregated serving: "prefill" | "decode" | "both"


class WorkerRuntime:
    def __init__(self, settings: WorkerSettings) -> None:
        check_token(settings.worker_id, "worker id")
        if settings.dp_size < 1:
            raise ValueError("dp_size must be at least 1")
        self.settings = settings
        # Prompts become token ids exactly as the router computes them (same module, same
        # folder), so the blocks this engine caches are the blocks the router predicts.
        self.codec = load_codec(settings.model_path)
        self.incarnation = uuid.uuid4().hex[:12]
        self.faults = FaultState()
        self.publisher = KvPublisher(
            settings.nats_url, Names(settings.namespace), settings.worker_id, self.incarnation,
            dump=self._dump, load=self._loads, load_interval=settings.load_interval,
            nats=settings.nats)
        rng = random.SystemRandom()
        self.engines = [
            Engine(settings.engine, dp_rank=rank, salt=rng.getrandbits(64), faults=self.faults,
                   on_kv_changes=self.publisher.emit)
            for rank in range(settings.dp_size)
        ]
        self.metrics = WorkerMetrics(self.engines, settings.worker_id)
        self.url: str | None = None
        self.draining = False
        # SGLang-style streaming sessions the router opened here: id -> {opened_ts, turns}.
        self.sessions: dict[str, dict[str, float]] = {}

    def _dump(self) -> list[tuple[int, list[Any]]]:
        return [(engine.dp_rank, list(engine.dump())) for engine in self.engines]

    def _loads(self) -> list[dict[str, Any]]:
        return [{"dp_rank": e.dp_rank, **e.load()} for e in self.engines]

    async def start(self) -> None:
        for engine in self.engines:
            engine.start()
        await self.publisher.start()

    def announce(self, url: str) -> None:
        """Called once the HTTP port is bound: the first event of this incarnation."""
        self.url = self.settings.advertise_url or url
        s = self.settings
        self.publisher.register(WorkerRegistered(
            s.worker_id, self.url, s.model, s.engine.block_size, s.engine.num_gpu_blocks,
            s.engine.max_num_batched_tokens, time.time(), dp_size=s.dp_size,
            role=Role(s.role)))

    def begin_shutdown(self) -> None:
        if not self.draining:
            self.draining = True
            self.publisher.retire("shutdown")

    async def stop(self) -> None:
        self.begin_shutdown()
        await self.publisher.close(flush_timeout=5.0)
        for engine in self.engines:
            await engine.stop()

    def pick_engine(self, dp_rank: int | None) -> Engine:
        if dp_rank is not None and 0 <= dp_rank < len(self.engines):
            return self.engines[dp_rank]
        return min(self.engines, key=lambda e: len(e.core.running) + len(e.core.waiting))


def _error(status: int, message: str, kind: str = "invalid_request_error",
           param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, kind, param, status), status_code=status)


_encode = msgspec.json.Encoder().encode
_DONE = b"data: [DONE]\n\n"


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + _encode(payload) + b"\n\n"


async def _wait_disconnect(request: Request) -> None:
    """Returns when the client goes away (the body has been read: only disconnect can come)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _session_id(raw: bytes) -> str | None:
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    sid = body.get("session_id") if isinstance(body, dict) else None
    return sid if isinstance(sid, str) and sid else None


def _count_session_turn(runtime: WorkerRuntime, body: dict[str, Any]) -> None:
    nvext = body.get("nvext")
    control = nvext.get("session_control") if isinstance(nvext, dict) else None
    sid = control.get("session_id") if isinstance(control, dict) else None
    if isinstance(sid, str) and sid in runtime.sessions:
        runtime.sessions[sid]["turns"] += 1


def create_app(runtime: WorkerRuntime) -> FastAPI:
    settings = runtime.settings

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await runtime.start()
        try:
            yield
        finally:
            await runtime.stop()

    app = FastAPI(title=f"jetrouter worker {settings.worker_id}", lifespan=lifespan)
    app.state.runtime = runtime

    async def inference(request: Request, chat: bool) -> Response:
        endpoint = "chat" if chat else "completions"
        if runtime.draining:
            runtime.metrics.count(endpoint, "rejected")
            return _error(503, "worker is shutting down", "service_unavailable")
        try:
            body = decode_body(await read_body(request))
            parsed = parse_request(body, chat=chat, default_max_tokens=settings.default_max_tokens,
                                   header_request_id=request.headers.get("x-request-id"),
                                   codec=runtime.codec)
        except BadRequest as exc:
            runtime.metrics.count(endpoint, "bad_request")
            return _error(400, str(exc), param=exc.param)
        if parsed.model is not None and parsed.model != settings.model:
            return _error(404, f"The model `{parsed.model}` does not exist.", "NotFoundError",
                          "model")
        _count_session_turn(runtime, body)
        ext = body.get("jetrouter") if isinstance(body.get("jetrouter"), dict) else {}
        rank = ext.get("dp_rank")
        engine = runtime.pick_engine(rank if isinstance(rank, int) else None)
        request_id = parsed.request_id or uuid.uuid4().hex
        n = body.get("n")
        if n is not None and n != 1:  # several choices: workers/choices.py
            if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_CHOICES:
                return _error(400, f"n must be an integer in [1, {MAX_CHOICES}]", param="n")
            runtime.metrics.count(endpoint, "ok")
            return await serve_choices(
                engine, request_id, parsed, n,
                ResponseShaper(("chatcmpl-" if chat else "cmpl-") + request_id, settings.model,
                               chat),
                {"x-request-id": request_id, "x-jetrouter-worker": settings.worker_id})
        transferred = transferred_tokens(ext, parsed.prompt_ids, settings.engine.block_size)
        try:
            handle = engine.submit(request_id, parsed.prompt_ids, parsed.max_tokens,
                                   transferred_tokens=transferred, cache_salt=parsed.cache_salt)
        except ValueError as exc:
            runtime.metrics.count(endpoint, "bad_request")
            return _error(400, str(exc), param="max_tokens")
        crash_budget = runtime.faults.claim_crash_budget()
        if crash_budget == 0:
            crash_now()
        shaper = ResponseShaper(("chatcmpl-" if chat else "cmpl-") + request_id,
                                settings.model, chat)
        headers = {"x-request-id": request_id, "x-jetrouter-worker": settings.worker_id,
                   "x-jetrouter-dp-rank": str(engine.dp_rank)}
        if body.get("return_token_ids") is True:  # vLLM's request field: echo the prompt ids
            shaper.prompt_token_ids = parsed.prompt_ids
        if parsed.stream:
            stream = _stream(runtime, handle, shaper, parsed.include_usage, crash_budget, endpoint)
            return LeanStreamingResponse(stream, media_type="text/event-stream", headers=headers)
        return await _complete(runtime, request, handle, shaper, crash_budget, endpoint, headers)

    async def completions(request: Request) -> Response:
        return await inference(request, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await inference(request, chat=True)

    # The engine's share of a routed request's CPU is part of what a router benchmark on one
    # machine measures: these two skip FastAPI's dependency solving and middleware layers, and
    # stream without Starlette's per-chunk wrappers (leanhttp/hotpath.py), as the replica does.
    install_hot_routes(app, {"/v1/completions": completions,
                             "/v1/chat/completions": chat_completions})

    add_prefill_route(app, runtime)
    add_pooling_routes(app, runtime)
    add_responses_route(app, runtime)
    add_messages_routes(app, runtime)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": settings.model, "object": "model",
                                            "created": 0, "owned_by": "jetrouter"}]}

    @app.get("/health")
    async def health() -> Response:
        status = 503 if runtime.draining else 200
        return JSONResponse({"status": "draining" if runtime.draining else "ok",
                             "worker_id": settings.worker_id, "url": runtime.url,
                             "incarnation": runtime.incarnation,
                             "nats_connected": runtime.publisher.connected,
                             "load": runtime._loads()}, status_code=status)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(runtime.metrics.render(), media_type="text/plain; version=0.0.4")

    # SGLang's session endpoints (its --enable-streaming-session): the router opens a session on
    # the engine it pins the session to and closes it after the last turn.
    @app.post("/open_session")
    async def open_session(request: Request) -> Response:
        sid = _session_id(await request.body())
        if sid is None:
            return _error(400, "session_id must be a non-empty string", param="session_id")
        runtime.sessions.setdefault(sid, {"opened_ts": time.time(), "turns": 0})
        return JSONResponse(sid)

    @app.post("/close_session")
    async def close_session(request: Request) -> Response:
        sid = _session_id(await request.body())
        if sid is None:
            return _error(400, "session_id must be a non-empty string", param="session_id")
        if runtime.sessions.pop(sid, None) is None:
            return _error(404, f"session {sid!r} is not open here", param="session_id")
        return JSONResponse({"closed": sid})

    @app.get("/sessions")
    async def sessions() -> Response:
        return JSONResponse({"worker_id": settings.worker_id, "sessions": runtime.sessions})

    @app.post("/fault")
    async def fault(request: Request) -> Response:
        try:
            body = json.loads(await request.body())
            if not isinstance(body, dict):
                raise ValueError("body must be a JSON object")
            return JSONResponse(runtime.faults.apply(body))
        except ValueError as exc:
            return _error(400, str(exc))

    return app


async def _stream(runtime: WorkerRuntime, handle: RequestHandle, shaper: ResponseShaper,
                  include_usage: bool, crash_budget: int | None, endpoint: str
                  ) -> AsyncIterator[bytes]:
    outcome = "cancelled"
    runtime.metrics.in_flight.inc()
    try:
        if shaper.chat:
            yield _sse(shaper.chunk("", first=True))
        sent = 0
        last = b""  # the tokens that came with the end: written with the stream's end
        async for run in handle.token_runs():
            if crash_budget is not None:  # one chunk a token, so that the Nth is on the socket
                for token in run:
                    yield _sse(shaper.chunk(decode([token])))
                    sent += 1
                    if sent >= crash_budget:
                        crash_now()  # the Nth chunk has been handed to the socket by now
                continue
            chunks = b"".join([_sse(shaper.chunk(decode([token]))) for token in run])
            if handle.finished:
                last = chunks  # (the runs end here)
                continue
            yield chunks
        end = [last, _sse(shaper.chunk(None if shaper.chat else "", "length"))]
        if include_usage:
            end.append(_sse(shaper.usage_chunk(usage(handle.prompt_tokens, len(handle.output),
                                                     handle.cached_tokens))))
        end.append(_DONE)
        yield LastChunk(b"".join(end))  # one write: the last tokens, the end, the chunked end
        outcome = "ok"  # (the response asks for more after its last chunk: this still runs)
    finally:
        runtime.metrics.in_flight.dec()
        runtime.metrics.count(endpoint, outcome)
        if not handle.finished:
            handle.abort()  # client went away (or we were cancelled): free its blocks


async def _complete(runtime: WorkerRuntime, request: Request, handle: RequestHandle,
                    shaper: ResponseShaper, crash_budget: int | None, endpoint: str,
                    headers: dict[str, str]) -> Response:
    async def collect() -> None:
        count = 0
        async for _token in handle.tokens():
            count += 1
            if crash_budget is not None and count >= crash_budget:
                crash_now()

    runtime.metrics.in_flight.inc()
    done = asyncio.create_task(collect())
    gone = asyncio.create_task(_wait_disconnect(request))
    try:
        await asyncio.wait({done, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        runtime.metrics.in_flight.dec()
        gone.cancel()
        if not done.done():
            done.cancel()
            handle.abort()
    if not handle.finished:
        runtime.metrics.count(endpoint, "cancelled")
        return Response(status_code=499)
    runtime.metrics.count(endpoint, "ok")
    body = shaper.full(handle.output, "length",
                       usage(handle.prompt_tokens, len(handle.output), handle.cached_tokens))
    return JSONResponse(body, headers=headers)


class WorkerServer(uvicorn.Server):
    """uvicorn with the worker's start-up announcement and graceful SIGTERM."""

    def __init__(self, config: uvicorn.Config, runtime: WorkerRuntime) -> None:
        super().__init__(config)
        self.runtime = runtime

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.should_exit or not self.servers:
            return
        port = self.servers[0].sockets[0].getsockname()[1]
        host = self.config.host
        if host in ("0.0.0.0", "::", ""):
            host = socket.gethostname()
        url = f"http://{host}:{port}"
        self.runtime.announce(url)
        print(f"jetrouter worker {self.runtime.settings.worker_id} listening on {url}",
              flush=True)

    def handle_exit(self, sig: int, frame: Any) -> None:
        # Runs in a signal handler: hop onto the loop before touching asyncio objects.
        with contextlib.suppress(RuntimeError):
            asyncio.get_running_loop().call_soon_threadsafe(self.runtime.begin_shutdown)
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await super().shutdown(sockets)
        # A SIGTERM we handled is a clean stop: do not let uvicorn re-raise it (exit status 0).
        self._captured_signals.clear()


def build_server(settings: WorkerSettings, kind: type[WorkerServer] = WorkerServer
                 ) -> WorkerServer:
    """One engine's runtime, app and uvicorn server, not yet started."""
    runtime = WorkerRuntime(settings)
    config = uvicorn.Config(
        FrontDoor(create_app(runtime)), host=settings.host, port=settings.port, log_level="warning",
        timeout_graceful_shutdown=max(1, int(settings.shutdown_timeout)), access_log=False)
    return kind(config, runtime)


def serve(settings: WorkerSettings) -> int:
    server = build_server(settings)
    server.run()
    if server.started:
        return 0
    print("jetrouter worker: failed to start", file=sys.stderr)
    return 1
