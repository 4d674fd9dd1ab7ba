"""The inference routes' short way through the ASGI stack (leanhttp/hotpath.py), over a real socket
with uvicorn's httptools protocol as the replica runs it: same answers as the full stack for
success, errors, oversized bodies and other methods; a client that hangs up mid-stream cancels
the stream."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from api.errors import ApiError, install_error_handlers
from api.http_limits import BodySizeLimit, guarded_http_protocol
from leanhttp.hotpath import (
    FrontDoor,
    LastChunk,
    LeanStreamingResponse,
    install_hot_routes,
    read_body,
)

pytestmark = pytest.mark.timeout(60)
MAX_BODY = 1024


def make_app(stream_done: asyncio.Event, stream_cancelled: asyncio.Event) -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)

    async def echo(request: Request) -> Response:
        raw = await read_body(request)
        assert await request.body() == raw  # kept for whoever reads it again
        if raw == b"api-error":
            raise ApiError(400, "no good", param="prompt")
        if raw == b"bug":
            raise RuntimeError("a bug")
        if raw == b"stream":
            return LeanStreamingResponse(events(), media_type="text/event-stream",
                                         headers={"x-kind": "sse"})
        if raw == b"last":
            return LeanStreamingResponse(ending(), media_type="text/event-stream")
        return Response(b"echo:" + raw, media_type="text/plain", headers={"x-kind": "plain"})

    async def events() -> AsyncIterator[bytes]:
        try:
            yield b"data: 1\n\n"
            yield b"data: 2\n\n"
            await asyncio.sleep(30)  # parked between chunks until the client hangs up
            yield b"data: never\n\n"
        except (asyncio.CancelledError, GeneratorExit):
            stream_cancelled.set()
            raise
        finally:
            stream_done.set()

    async def ending() -> AsyncIterator[bytes]:
        try:
            yield b"data: 1\n\n"
            yield LastChunk(b"data: [DONE]\n\n")
        finally:
            stream_done.set()  # the iterator ran to its end, not just to its last yield

    install_hot_routes(app, {"/v1/completions": echo},
                       guard=functools.partial(BodySizeLimit, max_bytes=MAX_BODY))
    return app


@contextlib.asynccontextmanager
async def serving(app: ASGIApp) -> AsyncIterator[str]:
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                            http=guarded_http_protocol(10.0),  # type: ignore[arg-type]
                            lifespan="off")
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    try:
        async with asyncio.timeout(10):
            while not server.started:
                await asyncio.sleep(0.01)  # polling the server's own flag, with a deadline
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)


async def test_hot_route_answers_like_the_full_stack() -> None:
    app = make_app(asyncio.Event(), asyncio.Event())
    async with serving(app) as url, httpx.AsyncClient(base_url=url) as http:
        r = await http.post("/v1/completions", content=b"hi")
        assert (r.status_code, r.text, r.headers["x-kind"]) == (200, "echo:hi", "plain")

        r = await http.post("/v1/completions", content=b"api-error")
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "prompt"

        r = await http.post("/v1/completions", content=b"bug")
        assert r.status_code == 500
        assert r.json()["error"]["type"] == "internal_error"
        assert "a bug" not in r.text  # the traceback goes to the log only

        r = await http.post("/v1/completions", content=b"x" * (MAX_BODY + 1))
        assert r.status_code == 413
        assert r.json()["error"]["code"] == "request_too_large"

        # Not the hot path: another method, a trailing slash. The full stack answers.
        r = await http.get("/v1/completions")
        assert r.status_code == 405 and "error" in r.json()
        r = await http.post("/v1/completions/", content=b"hi", follow_redirects=True)
        assert r.status_code == 200 and r.text == "echo:hi"


async def test_lean_stream_streams_and_a_hang_up_cancels_it() -> None:
    done, cancelled = asyncio.Event(), asyncio.Event()
    app = make_app(done, cancelled)
    async with serving(app) as url:
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 6\r\n\r\n"
                     b"stream")
        seen = b""
        async with asyncio.timeout(10):
            while b"data: 2" not in seen:
                chunk = await reader.read(4096)
                assert chunk, "the server closed the stream early"
                seen += chunk
        assert b"200 OK" in seen and b"x-kind: sse" in seen
        assert b"text/event-stream" in seen
        writer.close()  # hang up while the stream is parked
        await asyncio.wait_for(done.wait(), 10)
        assert cancelled.is_set()


async def test_a_last_chunk_ends_the_body_with_it_and_the_iterator_runs_out() -> None:
    done = asyncio.Event()
    app = make_app(done, asyncio.Event())
    async with serving(app) as url:
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 4\r\n\r\n"
                         b"last")
            async with asyncio.timeout(10):
                head = await reader.readuntil(b"\r\n\r\n")
                body = await reader.readuntil(b"0\r\n\r\n")
        finally:
            writer.close()
        assert b"transfer-encoding: chunked" in head.lower()
        # the last data chunk and the chunked body's end, back to back, nothing after
        assert body == b"9\r\ndata: 1\n\n\r\ne\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"
        assert done.is_set()


async def test_front_door_takes_the_hot_routes_past_the_app_and_the_rest_through_it() -> None:
    class CountingApp(FastAPI):
        calls = 0

        async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
            self.calls += 1
            await super().__call__(scope, receive, send)

    app = CountingApp()
    install_error_handlers(app)

    async def echo(request: Request) -> Response:
        return Response(b"echo:" + await read_body(request), media_type="text/plain")

    install_hot_routes(app, {"/v1/completions": echo},
                       guard=functools.partial(BodySizeLimit, max_bytes=MAX_BODY))

    async def pieces() -> AsyncIterator[bytes]:
        for part in (b"a" * 10, b"b" * 10):
            yield part

    async with serving(FrontDoor(app)) as url, httpx.AsyncClient(base_url=url) as http:
        r = await http.post("/v1/completions", content=b"first")  # the app builds its stack
        assert r.text == "echo:first"
        calls = app.calls
        r = await http.post("/v1/completions", content=pieces())  # a body in two messages
        assert (r.status_code, r.text) == (200, "echo:" + "a" * 10 + "b" * 10)
        r = await http.post("/v1/completions", content=b"x" * (MAX_BODY + 1))
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        assert app.calls == calls  # neither went through FastAPI.__call__
        r = await http.get("/v1/completions")
        assert r.status_code == 405 and "error" in r.json()
        assert app.calls == calls + 1
