"""A request that reaches an idle keep-alive connection while the replica's event loop is stalled
(CPU starvation on a busy host, a long step of the loop) is answered, not reset.

uvloop (libuv) runs the timers that fell due during a stall before it reads the sockets, so the
keep-alive timer would close the connection with the client's request unread in it: the client
sees a reset (``ReadError``). The replica's protocol (``api.http_limits``) leaves the connection
open when bytes are waiting. Real sockets, uvicorn with that protocol on a uvloop loop in a
thread of its own; the stall is a blocking call scheduled on that loop."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn
import uvloop

from api.http_limits import guarded_http_protocol

pytestmark = pytest.mark.timeout(60)
KEEP_ALIVE = 1
REQUEST = b"GET / HTTP/1.1\r\nhost: x\r\n\r\n"


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    assert scope["type"] == "http"
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


class ServerThread:
    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(app, http=guarded_http_protocol(30.0),  # type: ignore[arg-type]
                                timeout_keep_alive=KEEP_ALIVE, lifespan="off", loop="none",
                                log_level="warning")
        self.server = uvicorn.Server(config)
        self.loop = uvloop.new_event_loop()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self.server.serve(sockets=[self.sock]))

    def stall(self, seconds: float) -> None:
        """Block the server's loop for ``seconds`` in an I/O callback (where a loop spends a
        busy step: reading a burst of messages, say), after which libuv runs due timers before
        it polls the sockets again; returns once the stall has begun."""
        begun = threading.Event()
        ours, theirs = socket.socketpair()

        def blocking() -> None:
            self.loop.remove_reader(ours.fileno())
            begun.set()
            time.sleep(seconds)  # the stall itself
            ours.close()
            theirs.close()

        self.loop.call_soon_threadsafe(self.loop.add_reader, ours.fileno(), blocking)
        theirs.send(b"x")
        assert begun.wait(10), "the server's loop did not take the stall"


@pytest.fixture
def server() -> Iterator[ServerThread]:
    s = ServerThread()
    s.thread.start()
    deadline = time.monotonic() + 10
    while not s.server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)  # polling the server thread's flag, with a deadline
    yield s
    s.server.should_exit = True
    s.thread.join(10)


def exchange(conn: socket.socket) -> bytes:
    """One request on the kept-alive connection; the response, or what ended it."""
    conn.sendall(REQUEST)
    data = b""
    try:
        while not data.endswith(b"ok"):
            chunk = conn.recv(4096)
            if not chunk:
                return data + b"<closed>"
            data += chunk
    except ConnectionResetError:
        return data + b"<reset>"
    return data


def test_a_request_sent_during_a_stall_past_the_keep_alive_timeout_is_answered(
        server: ServerThread) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=20) as conn:
        assert exchange(conn).startswith(b"HTTP/1.1 200")
        server.stall(KEEP_ALIVE + 1.0)  # the keep-alive timer falls due during the stall
        assert exchange(conn).startswith(b"HTTP/1.1 200")


def test_an_idle_connection_is_still_closed_after_the_keep_alive_timeout(
        server: ServerThread) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=20) as conn:
        assert exchange(conn).startswith(b"HTTP/1.1 200")
        assert conn.recv(4096) == b""  # closed by the server once idle for KEEP_ALIVE
