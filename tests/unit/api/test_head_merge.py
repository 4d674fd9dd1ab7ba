"""A response's head goes out with its first body bytes (api/head_merge.py), over a real socket
with uvicorn's httptools protocol as the replica runs it: the bytes are those of a head and a
body sent apart, a head whose body is late still goes out, and an app that fails after the
head still ends the connection."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.types import ASGIApp

from api.errors import install_error_handlers
from api.head_merge import HEAD_HOLD_SECONDS, HeadWithFirstBody
from api.hotpath import FrontDoor, HotRoutes, LastChunk, LeanStreamingResponse, read_body
from api.http_limits import guarded_http_protocol
from tests.waiting import until

pytestmark = pytest.mark.timeout(60)


def make_app(release: asyncio.Event) -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)

    async def answer(request: Request) -> Response:
        raw = await read_body(request)
        if raw == b"stream":
            return LeanStreamingResponse(chunks(False), media_type="text/event-stream")
        if raw == b"late":
            return LeanStreamingResponse(chunks(True), media_type="text/event-stream")
        if raw == b"broken":
            return LeanStreamingResponse(broken(), media_type="text/event-stream")
        return Response(b"plain:" + raw, media_type="text/plain")

    async def chunks(late: bool) -> AsyncIterator[bytes]:
        if late:
            await release.wait()  # the test sets it once it has seen the head
        for _ in range(3):  # a client in this loop could read a head sent on its own meanwhile
            await asyncio.sleep(0)
        yield b"data: 1\n\n"
        yield LastChunk(b"data: [DONE]\n\n")

    async def broken() -> AsyncIterator[bytes]:
        await release.wait()
        raise RuntimeError("the stream broke before its first bytes")
        yield b""  # an async generator

    app.add_route("/v1/completions", answer, methods=["POST"])
    build = app.build_middleware_stack
    app.build_middleware_stack = (  # type: ignore[method-assign]
        lambda: HotRoutes(build(), {"/v1/completions": answer}, app.exception_handlers, 1024))
    return app


@contextlib.asynccontextmanager
async def serving(app: ASGIApp) -> AsyncIterator[int]:
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="critical",
                            http=guarded_http_protocol(10.0),  # type: ignore[arg-type]
                            lifespan="off")
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    try:
        await until(lambda: server.started, timeout=10, what="server started", interval=0.01)
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)


async def post(port: int, body: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-length: %d\r\n\r\n%s"
                 % (len(body), body))
    return reader, writer


async def read_all(reader: asyncio.StreamReader, end: bytes, data: bytes = b"") -> bytes:
    while not data.endswith(end):
        more = await asyncio.wait_for(reader.read(65536), 10)
        if not more:
            break
        data += more
    return data


async def test_the_head_and_the_first_body_bytes_leave_in_one_write() -> None:
    async with serving(FrontDoor(make_app(asyncio.Event()))) as port:
        reader, writer = await post(port, b"warm")
        await read_all(reader, b"plain:warm")  # the app has built its stack
        writer.close()
        reader, writer = await post(port, b"stream")
        first = await asyncio.wait_for(reader.read(65536), 10)  # what the first packet held
        assert first.startswith(b"HTTP/1.1 200 OK\r\n")
        assert b"\r\n\r\n9\r\ndata: 1\n\n\r\n" in first
        whole = await read_all(reader, b"0\r\n\r\n", first)
        assert whole.endswith(b"\r\n\r\n9\r\ndata: 1\n\n\r\ne\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")
        writer.close()
        reader, writer = await post(port, b"x")  # a complete body: head and body together
        first = await asyncio.wait_for(reader.read(65536), 10)
        assert first.startswith(b"HTTP/1.1 200 OK\r\n") and first.endswith(b"\r\n\r\nplain:x")
        writer.close()


async def test_a_head_whose_body_is_late_goes_out_alone() -> None:
    release = asyncio.Event()
    async with serving(FrontDoor(make_app(release))) as port:
        reader, writer = await post(port, b"late")
        # The body waits for `release`, which is set only once the head is here: the head
        # went out after HEAD_HOLD_SECONDS without it.
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"),
                                      10 + HEAD_HOLD_SECONDS)
        assert head.startswith(b"HTTP/1.1 200 OK\r\n") and b"transfer-encoding: chunked" in head
        release.set()
        body = await read_all(reader, b"0\r\n\r\n")
        assert body == b"9\r\ndata: 1\n\n\r\ne\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"
        writer.close()


async def test_a_stream_that_fails_after_its_head_was_held_still_ends_the_connection() -> None:
    release = asyncio.Event()
    release.set()
    async with serving(FrontDoor(make_app(release))) as port:
        reader, writer = await post(port, b"broken")
        data = await read_all(reader, b"never")  # read to the close
        assert data.startswith(b"HTTP/1.1 200 OK\r\n") and data.endswith(b"\r\n\r\n")
        writer.close()


async def test_another_server_s_send_is_left_alone() -> None:
    async def send(message: object) -> None:
        pass

    assert HeadWithFirstBody.for_send(send) is send
