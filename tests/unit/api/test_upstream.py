"""The upstream HTTP/1.1 client (api/upstream.py) against a real asyncio HTTP server on a free
port: bodies by content-length and chunked, keep-alive reuse, connection: close, a server that
closes mid-body, one that stalls, a refused connection, a connect that times out (an engine that
accepts nothing, or this process's loop starved), and a stale pooled connection."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

from api.forward.engine import (
    HopFailed,
    HopFailure,
    classify,
    open_upstream,
    upstream_events,
)
from api.upstream import (
    ConnectFailed,
    ConnectTimedOut,
    IdleTimeout,
    StreamBroken,
    UpstreamPool,
    parse_url,
)
from tests.full_accept_queue import FullAcceptQueue

pytestmark = [pytest.mark.timeout(30)]


@dataclass
class Engine:
    """A scripted HTTP/1.1 server: the request path picks the behaviour."""

    port: int = 0
    requests: list[tuple[int, str, bytes, dict[str, str]]] = field(default_factory=list)
    connections: int = 0
    drop_next: set[int] = field(default_factory=set)  # connection ids whose next request dies
    release: asyncio.Event = field(default_factory=asyncio.Event)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        cid = self.connections
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    return
                lines = head.decode().split("\r\n")
                path = lines[0].split(" ")[1]
                headers = {k.lower(): v.strip() for k, _, v in
                           (ln.partition(":") for ln in lines[1:] if ln)}
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                if cid in self.drop_next:
                    self.drop_next.discard(cid)
                    return  # read the request, never answer: closes in `finally`
                self.requests.append((cid, path, body, headers))
                if not await self.respond(path, body, writer, cid):
                    return
        finally:
            writer.close()

    async def respond(self, path: str, body: bytes, w: asyncio.StreamWriter, cid: int) -> bool:
        """Answer one request; False closes the connection afterwards."""
        if path == "/len":
            w.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: %d\r\n\r\n"
                    b"echo:%s" % (len(body) + 5, body))
        elif path == "/chunked":
            w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            for part in (b"data: a\n\n", b"data: bb\n\n", b"data: [DONE]\n\n"):
                w.write(b"%x\r\n%s\r\n" % (len(part), part))
                await w.drain()
                await asyncio.sleep(0)  # separate writes, so separate reads on the client
            w.write(b"0\r\nx-trailer: 1\r\n\r\n")
        elif path == "/len-then-hang-up":  # keep-alive promised, then closed (an idle timeout)
            w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            await w.drain()
            return False
        elif path == "/close":
            w.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok")
            await w.drain()
            return False
        elif path == "/until-close":
            w.write(b"HTTP/1.0 200 OK\r\n\r\nall of it")
            await w.drain()
            return False
        elif path == "/mid-body":
            w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly ten..")
            await w.drain()
            return False
        elif path == "/mid-chunk":
            w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
                    b"d\r\ndata: first\n\n\r\n20\r\ndata: torn")
            await w.drain()
            return False
        elif path == "/stall":
            w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
                    b"d\r\ndata: first\n\n\r\n")
            await w.drain()
            await self.release.wait()
            return False
        elif path == "/slow-head":  # silent until released, then a whole answer
            await self.release.wait()
            w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nlate")
        elif path == "/slow-body":  # the head at once, the body once released
            w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            await w.drain()
            await self.release.wait()
            w.write(b"d\r\ndata: first\n\n\r\n0\r\n\r\n")
        elif path == "/stall-head":
            await self.release.wait()
            return False
        elif path == "/500":
            w.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 4\r\n\r\nbusy")
        elif path == "/continue":
            w.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\ncontent-length: 0"
                    b"\r\n\r\n")
        await w.drain()
        return True


@pytest.fixture
async def engine() -> AsyncIterator[Engine]:
    e = Engine()
    server = await asyncio.start_server(e.handle, "127.0.0.1", 0)
    e.port = server.sockets[0].getsockname()[1]
    try:
        yield e
    finally:
        e.release.set()
        server.close()
        server.close_clients() if hasattr(server, "close_clients") else None
        await asyncio.wait_for(server.wait_closed(), 5)


@pytest.fixture
async def pool() -> AsyncIterator[UpstreamPool]:
    p = UpstreamPool(connect_timeout=2.0, idle_timeout=5.0)
    try:
        yield p
    finally:
        await p.aclose()


def url(e: Engine, path: str) -> str:
    return f"http://127.0.0.1:{e.port}{path}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_content_length_body_and_request_headers(engine: Engine,
                                                       pool: UpstreamPool) -> None:
    resp = await pool.post(url(engine, "/len"), b'{"x":1}', {"x-request-id": "r1"})
    assert resp.status_code == 200 and resp.headers["content-type"] == "text/plain"
    assert await resp.aread() == b'echo:{"x":1}'
    _, path, body, headers = engine.requests[0]
    assert (path, body) == ("/len", b'{"x":1}')
    assert headers["x-request-id"] == "r1" and headers["content-length"] == "7"
    assert headers["host"] == f"127.0.0.1:{engine.port}"


async def test_chunked_body_streams_piece_by_piece_and_trailers_are_skipped(
        engine: Engine, pool: UpstreamPool) -> None:
    resp = await pool.post(url(engine, "/chunked"), b"{}")
    pieces = [p async for p in resp.aiter_raw()]
    assert b"".join(pieces) == b"data: a\n\ndata: bb\n\ndata: [DONE]\n\n"
    assert resp.done
    # The connection went back to the pool with nothing left over: the next request reuses it.
    assert pool.idle_count(url(engine, "/")) == 1
    again = await pool.post(url(engine, "/len"), b"z")
    assert await again.aread() == b"echo:z" and again.reused_connection


async def test_keep_alive_reuses_one_connection(engine: Engine, pool: UpstreamPool) -> None:
    for i in range(3):
        resp = await pool.post(url(engine, "/len"), b"%d" % i)
        assert await resp.aread() == b"echo:%d" % i
        resp.close()
    assert [r[0] for r in engine.requests] == [1, 1, 1]
    assert (pool.opened, pool.reused) == (1, 2)


async def test_an_unread_body_is_not_reused(engine: Engine, pool: UpstreamPool) -> None:
    resp = await pool.post(url(engine, "/chunked"), b"")
    assert await resp.next_chunk()
    resp.close()  # abandoned half-way: its connection cannot carry another request
    assert pool.idle_count() == 0
    assert await (await pool.post(url(engine, "/len"), b"")).aread() == b"echo:"
    assert [r[0] for r in engine.requests] == [1, 2]


async def test_connection_close_is_honoured(engine: Engine, pool: UpstreamPool) -> None:
    resp = await pool.post(url(engine, "/close"), b"")
    assert await resp.aread() == b"ok"
    assert pool.idle_count() == 0
    resp = await pool.post(url(engine, "/until-close"), b"")
    assert await resp.aread() == b"all of it"
    assert pool.idle_count() == 0 and pool.opened == 2 and pool.stale_retries == 0


async def test_interim_and_error_statuses(engine: Engine, pool: UpstreamPool) -> None:
    resp = await pool.post(url(engine, "/continue"), b"")
    assert resp.status_code == 201 and await resp.aread() == b""
    with pytest.raises(HopFailed) as info:
        await open_upstream(pool, url(engine, "/500"), b"", "r2")
    assert info.value.reason == "upstream_5xx" and "busy" in info.value.detail


async def test_server_closing_mid_body_is_a_stream_error(engine: Engine,
                                                         pool: UpstreamPool) -> None:
    resp = await pool.post(url(engine, "/mid-body"), b"")
    with pytest.raises(StreamBroken):
        await resp.aread()
    assert classify(StreamBroken("x")) == HopFailure.STREAM_ERROR
    # Through the proxy layer: the whole first event comes out, the torn one never does.
    resp = await open_upstream(pool, url(engine, "/mid-chunk"), b"", "r3")
    seen: list[bytes | None] = []
    with pytest.raises(HopFailed) as info:
        async for _, payload in upstream_events(resp):
            seen.append(payload)
    assert seen == [b"first"] and info.value.reason == HopFailure.STREAM_ERROR
    assert pool.idle_count() == 0


async def test_a_stalled_server_hits_the_idle_timeout(engine: Engine,
                                                      pool: UpstreamPool) -> None:
    loop = asyncio.get_running_loop()
    resp = await pool.post(url(engine, "/stall"), b"", idle_timeout=0.3)
    assert await resp.next_chunk() == b"data: first\n\n"
    started = loop.time()
    with pytest.raises(IdleTimeout):
        await resp.next_chunk()
    assert 0.25 <= loop.time() - started < 3
    with pytest.raises(HopFailed) as info:  # silent before the head: the same reason
        await open_upstream(pool, url(engine, "/stall-head"), b"", "r4", idle_timeout=0.2)
    assert info.value.reason == HopFailure.IDLE_TIMEOUT
    assert pool.idle_count() == 0


@pytest.mark.parametrize("path", ["/slow-head", "/slow-body"])
async def test_patience_outlasts_idle_timeouts_before_the_first_body_byte(
        engine: Engine, pool: UpstreamPool, path: str) -> None:
    """A live engine silent before its answer (api/forward/first_byte.py): each idle timeout
    asks the patience, with the seconds since the request went out, and waiting goes on."""
    asked: list[float] = []

    def patience(waited: float) -> bool:
        asked.append(waited)
        if len(asked) == 3:
            engine.release.set()  # the engine answers after three idle periods
        return True

    resp = await pool.post(url(engine, path), b"", idle_timeout=0.2, patience=patience)
    assert await resp.aread() in (b"late", b"data: first\n\n")
    assert len(asked) == 3
    assert asked == sorted(asked) and asked[0] >= 0.15, asked
    assert [r[1] for r in engine.requests] == [path]  # sent once


@pytest.mark.parametrize("path", ["/slow-head", "/slow-body"])
async def test_an_impatient_answer_lets_the_idle_timeout_stand(
        engine: Engine, pool: UpstreamPool, path: str) -> None:
    asked: list[float] = []

    def patience(waited: float) -> bool:
        asked.append(waited)
        return len(asked) < 2

    with pytest.raises(HopFailed) as info:
        resp = await open_upstream(pool, url(engine, path), b"", "r5", idle_timeout=0.2,
                                   patience=patience)
        _ = [event async for event in upstream_events(resp)]
    assert info.value.reason == HopFailure.IDLE_TIMEOUT
    assert len(asked) == 2


async def test_patience_is_not_asked_once_the_body_has_begun(engine: Engine,
                                                             pool: UpstreamPool) -> None:
    """A stream that stops mid-answer is a failure, however alive its engine looks."""
    asked: list[float] = []
    resp = await pool.post(url(engine, "/stall"), b"", idle_timeout=0.2,
                           patience=lambda waited: asked.append(waited) is None)
    assert await resp.next_chunk() == b"data: first\n\n"
    with pytest.raises(IdleTimeout):
        await resp.next_chunk()
    assert asked == []


async def test_a_shorter_idle_timeout_after_a_longer_one_still_fires_on_time(
        engine: Engine, pool: UpstreamPool) -> None:
    # The per-connection timer is re-armed lazily; a later, shorter timeout must not wait for
    # the earlier, longer deadline.
    resp = await pool.post(url(engine, "/len"), b"", idle_timeout=60)
    await resp.aread()
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(IdleTimeout):
        await pool.post(url(engine, "/stall-head"), b"", idle_timeout=0.2)
    assert loop.time() - started < 3


async def test_refused_connection_is_a_connect_error(pool: UpstreamPool) -> None:
    port = free_port()
    with pytest.raises(ConnectFailed):
        await pool.post(f"http://127.0.0.1:{port}/v1/completions", b"{}")
    with pytest.raises(HopFailed) as info:
        await open_upstream(pool, f"http://127.0.0.1:{port}/v1/completions", b"{}", "r5")
    assert info.value.reason == HopFailure.CONNECT_ERROR


async def test_refused_connection_is_not_a_connect_timeout(pool: UpstreamPool) -> None:
    with pytest.raises(ConnectFailed) as info:
        await pool.post(f"http://127.0.0.1:{free_port()}/v1/completions", b"{}")
    assert not isinstance(info.value, ConnectTimedOut)


async def test_an_engine_that_accepts_nothing_times_the_connect_out_until_it_accepts() -> None:
    busy = FullAcceptQueue()
    p = UpstreamPool(connect_timeout=0.3, idle_timeout=5.0)
    try:
        with pytest.raises(ConnectTimedOut, match=r"timed out after 0\.3 s"):
            await p.post(busy.url + "/len", b"a")
        with pytest.raises(HopFailed) as info:
            await open_upstream(p, busy.url + "/len", b"a", "r6")
        assert info.value.reason == HopFailure.CONNECT_TIMEOUT
        assert classify(ConnectTimedOut("x")) == HopFailure.CONNECT_TIMEOUT
        # The engine catches up (accepts its queue): the next connect goes straight through.
        engine = Engine()
        await busy.accepting(engine.handle)
        resp = await p.post(busy.url + "/len", b"b", connect_timeout=0.3)
        assert await resp.aread() == b"echo:b"
        assert [r[2] for r in engine.requests] == [b"b"]
    finally:
        await p.aclose()
        await busy.close()


def _hold_the_loop(seconds: float) -> None:
    """The router's own loop busy (tokenizing, a long GC pause) for ``seconds``."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


async def test_a_connect_to_a_listening_engine_times_out_when_this_loop_runs_late(
        engine: Engine) -> None:
    # The kernel completes the handshake at once, but the loop reaches it only after the
    # timeout's deadline, and the timeout wins: a live engine, a timed-out connect.
    p = UpstreamPool(connect_timeout=0.1, idle_timeout=5.0)
    try:
        asyncio.get_running_loop().call_soon(_hold_the_loop, 0.3)
        with pytest.raises(ConnectTimedOut, match="event loop reached the timeout"):
            await p.post(url(engine, "/len"), b"a")
        assert engine.requests == []
        resp = await p.post(url(engine, "/len"), b"b")  # the loop on time again: connected
        assert await resp.aread() == b"echo:b"
    finally:
        await p.aclose()


async def test_stale_pooled_connection_is_retried_once_on_a_fresh_one(
        engine: Engine, pool: UpstreamPool) -> None:
    assert await (await pool.post(url(engine, "/len"), b"a")).aread() == b"echo:a"
    engine.drop_next.add(1)  # the pooled connection dies on its next request, unanswered
    resp = await pool.post(url(engine, "/len"), b"b")
    assert await resp.aread() == b"echo:b" and not resp.reused_connection
    assert pool.stale_retries == 1 and pool.opened == 2
    assert [(r[0], r[2]) for r in engine.requests] == [(1, b"a"), (2, b"b")]


async def test_a_fresh_connection_closed_without_an_answer_is_not_retried(
        engine: Engine, pool: UpstreamPool) -> None:
    engine.drop_next.add(1)
    with pytest.raises(StreamBroken):
        await pool.post(url(engine, "/len"), b"x")
    assert pool.stale_retries == 0 and engine.connections == 1


async def test_idle_connections_the_server_closed_leave_the_pool(
        engine: Engine, pool: UpstreamPool) -> None:
    resp = await pool.post(url(engine, "/len-then-hang-up"), b"")
    assert await resp.aread() == b"ok"
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 5
    while pool.idle_count() and loop.time() < deadline:  # the close reaches the parked conn
        await asyncio.sleep(0.01)
    assert pool.idle_count() == 0
    assert await (await pool.post(url(engine, "/len"), b"")).aread() == b"echo:"
    assert pool.stale_retries == 0 and pool.opened == 2


def test_parse_url() -> None:
    t = parse_url("http://127.0.0.1:8001/v1/completions")
    assert (t.host, t.port, t.path, t.host_header) == ("127.0.0.1", 8001, b"/v1/completions",
                                                       b"127.0.0.1:8001")
    assert parse_url("http://engine").port == 80 and parse_url("http://engine").path == b"/"
    assert parse_url("http://[::1]:9/x").host == "::1"
    with pytest.raises(ConnectFailed):
        parse_url("https://engine/x")


def test_the_same_client_works_on_uvloop() -> None:
    """Replicas run under uvicorn, which uses uvloop when installed (its transports differ)."""
    uvloop = pytest.importorskip("uvloop")

    async def scenario() -> tuple[bytes, bytes, int, int]:
        e = Engine()
        server = await asyncio.start_server(e.handle, "127.0.0.1", 0)
        e.port = server.sockets[0].getsockname()[1]
        p = UpstreamPool(idle_timeout=5.0)
        try:
            a = await (await p.post(url(e, "/chunked"), b"")).aread()
            b = await (await p.post(url(e, "/len"), b"q")).aread()
            with pytest.raises(IdleTimeout):
                await p.post(url(e, "/stall-head"), b"", idle_timeout=0.1)
            return a, b, p.opened, p.reused
        finally:
            e.release.set()
            await p.aclose()
            server.close()

    a, b, opened, reused = uvloop.run(scenario())
    assert a.endswith(b"data: [DONE]\n\n") and b == b"echo:q"
    assert (opened, reused) == (1, 2)
