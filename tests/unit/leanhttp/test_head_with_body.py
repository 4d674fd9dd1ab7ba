"""A response's head goes out in the same socket write as its body (leanhttp.head_with_body),
as the router replica's HTTP protocol (api.http_limits) sends it; streamed chunks are not held."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from uvicorn.config import Config
from uvicorn.server import ServerState

from api.http_limits import guarded_http_protocol
from leanhttp.head_with_body import HeadWithBody

pytestmark = pytest.mark.timeout(30)


class RecordingTransport(asyncio.Transport):
    """What reached the socket, write by write."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: Any) -> None:
        assert not self.closed, "write after close"
        self.writes.append(bytes(data))

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 5555)}.get(
            name, default)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


async def _steps(n: int = 5) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def test_the_head_written_in_the_same_step_as_the_body_is_one_write() -> None:
    t = RecordingTransport()
    h = HeadWithBody(t, asyncio.get_running_loop())
    h.write(b"HEAD")
    h.write(b"BODY")
    h.write(b"MORE")
    await _steps()
    assert t.writes == [b"HEADBODY", b"MORE"]


async def test_a_head_alone_goes_out_at_the_end_of_the_step_and_keeps_its_order() -> None:
    t = RecordingTransport()
    h = HeadWithBody(t, asyncio.get_running_loop())
    h.write(b"HEAD")
    assert t.writes == []
    await _steps()
    assert t.writes == [b"HEAD"]
    h.write(b"chunk")
    assert t.writes == [b"HEAD", b"chunk"]  # later writes are not held


async def test_closing_writes_what_is_held_first() -> None:
    t = RecordingTransport()
    h = HeadWithBody(t, asyncio.get_running_loop())
    h.write(b"HEAD")
    h.close()
    await _steps()
    assert t.writes == [b"HEAD"] and t.closed


async def test_a_head_held_when_the_connection_went_is_dropped() -> None:
    t = RecordingTransport()
    h = HeadWithBody(t, asyncio.get_running_loop())
    h.write(b"HEAD")
    t.close()  # the protocol closed the socket itself (e.g. a read timeout)
    await _steps()
    assert t.writes == []


async def _answer(app: Any, request: bytes) -> RecordingTransport:
    protocol_class = guarded_http_protocol(30.0)
    assert not isinstance(protocol_class, str)
    config = Config(app, access_log=False, log_level="warning")
    protocol = protocol_class(config=config, server_state=ServerState(), app_state={},
                              _loop=asyncio.get_running_loop())
    transport = RecordingTransport()
    protocol.connection_made(transport)
    protocol.data_received(request)
    for _ in range(100):
        await asyncio.sleep(0)
        if transport.writes and transport.writes[-1].endswith((b"}", b"0\r\n\r\n")):
            break
    protocol.connection_lost(None)
    return transport


_REQUEST = b"POST /x HTTP/1.1\r\nhost: a\r\ncontent-length: 2\r\n\r\n{}"


async def test_the_replica_protocol_sends_a_json_answer_in_one_write() -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", b"12")]})
        await send({"type": "http.response.body", "body": b'{"ok": true}'})

    transport = await _answer(app, _REQUEST)
    assert len(transport.writes) == 1
    head, _, body = transport.writes[0].partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK") and body == b'{"ok": true}'


async def test_a_streamed_answer_keeps_its_chunks_apart() -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        for part in (b"data: 1\n\n", b"data: 2\n\n"):
            await send({"type": "http.response.body", "body": part, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    transport = await _answer(app, _REQUEST)
    assert transport.writes[0].startswith(b"HTTP/1.1 200 OK")
    assert transport.writes[0].endswith(b"\r\n\r\n")  # the head alone: the first chunk came later
    assert transport.writes[1:] == [b"9\r\ndata: 1\n\n\r\n", b"9\r\ndata: 2\n\n\r\n", b"0\r\n\r\n"]
