"""A minimal HTTP/1.1 keep-alive client for the router's proxy path (router -> engine).

The router only ever POSTs JSON to an engine and reads back a (usually chunked, SSE) body, so this
does exactly that on a raw :class:`asyncio.Protocol` and nothing more: no redirects, cookies,
proxies, TLS or HTTP/2. What it buys over httpx is per-request cost: a pool that is a LIFO list per
(host, port) instead of a scan over every pooled connection, one buffer per connection, and an idle
timeout that costs one clock read per wait instead of a timer (or a task) per read. Reading the
bytes as HTTP/1.1 (heads, chunked or length-framed bodies) is :mod:`api.http1_parser`'s, which
does no I/O; this module owns the sockets, the pool and the waiting.

Failure is reported as one of three exceptions, which :func:`api.forward.engine.classify` maps
to the migration reasons: :class:`ConnectFailed` (connect_error; its subclass
:class:`ConnectTimedOut` is connect_timeout), :class:`StreamBroken` (stream_error) and
:class:`IdleTimeout` (idle_timeout). A pooled connection that the engine closed while it sat idle
is only found out when it is used; if it fails before the first response byte, the request was
never processed, so it is sent once more on a fresh connection.

What the connect timeout covers: the TCP handshake only (the host's name lookup first, which for
an IP address is no lookup at all). There is no TLS, and no wait for a pool slot (busy
connections are not limited). The kernel completes a handshake without the engine's process
running, so a connect to a live engine times out only when (a) its listening socket's accept
queue is full (the engine's loop is too busy to accept, and the kernel then drops SYNs,
which the client resends after 1 s, 3 s, 7 s ...), or (b) this process's own event loop ran
late: the handshake completed, but the loop got to it only after the timeout fired, which then
wins (a starved router on an overloaded host; the error then says how late the loop was). Neither
says the engine is gone; a refused connection (nothing listening) does.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import cast

from api.http1_parser import END, Head, ParseError, ResponseParser
from errors.root import JetrouterError

READ_HIGH_WATER = 1024 * 1024       # stop reading the socket while this much is unconsumed
DEFAULT_MAX_IDLE_PER_HOST = 256
# uvicorn (the engines' server) drops a keep-alive connection after 5 s of silence; not reusing
# ours past 4 s keeps the race with that close (and the retry it costs) rare.
DEFAULT_MAX_IDLE_AGE = 4.0
_SMALL_BODY = 64 * 1024             # bodies up to this go out in the same write as the head
LATE_LOOP = 0.1                     # a connect timeout that ran this late says the loop was late


class UpstreamError(JetrouterError):
    """Any failure talking to an engine (:func:`api.forward.engine.classify` names its
    migration reason)."""


class ConnectFailed(UpstreamError):
    """No connection: refused, unreachable, or not established within the connect timeout."""


class ConnectTimedOut(ConnectFailed):
    """The TCP handshake did not complete within the connect timeout (see the module docstring:
    a busy engine or a late event loop, unlike a refusal)."""


class StreamBroken(UpstreamError):
    """The connection broke, or the engine spoke something that is not HTTP/1.1."""


class IdleTimeout(UpstreamError):
    """No byte from the engine for the idle timeout."""


# Asked when the idle timeout fires before the response's first body byte, with the seconds since
# the request went out: True keeps waiting one more idle period (the engine is busy, not dead:
# api/forward/first_byte.py), False lets the timeout stand.
Patience = Callable[[float], bool]


class _Stale(JetrouterError):
    """Internal: the connection ended before the first response byte (see module docstring)."""


@dataclass(frozen=True, slots=True)
class Target:
    """Where a URL points: the pool key, the request path and the Host header."""

    host: str
    port: int
    path: bytes
    host_header: bytes


def parse_url(url: str) -> Target:
    """``http://host[:port]/path`` -> :class:`Target` (only plain http is spoken here)."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() != "http":
        raise ConnectFailed(f"unsupported URL (only http:// is): {url!r}")
    authority, slash, path = rest.partition("/")
    host, port = authority, 80
    if authority.startswith("["):  # [v6]:port
        end = authority.find("]")
        host = authority[1:end]
        if authority[end + 1:end + 2] == ":":
            port = int(authority[end + 2:])
    elif ":" in authority:
        host, _, p = authority.rpartition(":")
        port = int(p)
    if not host:
        raise ConnectFailed(f"no host in URL {url!r}")
    return Target(host, port, (slash + path or "/").encode(), authority.encode())


class _Connection(asyncio.Protocol):
    """One TCP connection to an engine: a receive buffer, and a single pending reader."""

    def __init__(self, loop: asyncio.AbstractEventLoop, key: tuple[str, int]) -> None:
        self.loop = loop
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.parser = ResponseParser()  # the bytes received and not yet read, as HTTP/1.1
        self.closed = False             # EOF, reset or closed by us: never usable again
        self.error: BaseException | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.deadline = 0.0
        self.timer: asyncio.TimerHandle | None = None
        self.paused = False
        self.parked_at = 0.0
        self.home: list[_Connection] | None = None  # the idle list holding it, if parked
        self.requests = 0

    # --- protocol callbacks --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have the same methods.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        parser = self.parser
        parser.feed(data)
        if parser.buffered > READ_HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self.closed = True
        self.parser.feed_eof()
        self._wake()
        return False  # let the transport close itself

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.parser.feed_eof()
        self.error = exc
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.home is not None:  # an idle connection the engine closed: forget it now
            try:
                self.home.remove(self)
            except ValueError:
                pass
            self.home = None
        self._wake()

    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    # --- reading -------------------------------------------------------------------------------

    def consumed(self) -> None:
        """Call after taking bytes out of the parser: resumes a socket paused for back-pressure."""
        if self.paused and self.parser.buffered <= READ_HIGH_WATER // 4 \
                and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()

    async def wait(self, idle: float) -> None:
        """Wait for more bytes. Raises :class:`_Stale` at EOF (the caller decides what that
        means), :class:`IdleTimeout` when nothing arrives for ``idle`` seconds."""
        if self.closed:
            raise _Stale(self.error)
        loop = self.loop
        self.deadline = loop.time() + idle
        # One lazily re-armed timer per connection instead of one per read: it fires at most
        # once per idle period and only then looks at how long the current wait has been going.
        if self.timer is None or self.timer.when() > self.deadline:
            if self.timer is not None:
                self.timer.cancel()
            self.timer = loop.call_at(self.deadline, self._on_timer)
        waiter = self.waiter = loop.create_future()
        try:
            await waiter
        finally:
            self.waiter = None
        if self.closed and not self.parser.buffered:
            raise _Stale(self.error)

    async def wait_patiently(self, idle: float, patience: Patience | None,
                             since: float) -> None:
        """:meth:`wait`, where an idle timeout stands only once ``patience`` (asked with the
        seconds since ``since``) says so."""
        while True:
            try:
                await self.wait(idle)
                return
            except IdleTimeout:
                if patience is None or not patience(self.loop.time() - since):
                    raise

    def _on_timer(self) -> None:
        self.timer = None
        waiter = self.waiter
        if waiter is None or waiter.done():
            return  # not waiting: the next wait arms a new timer
        if self.loop.time() >= self.deadline:
            waiter.set_exception(IdleTimeout("no byte from the engine within the idle timeout"))
        else:
            self.timer = self.loop.call_at(self.deadline, self._on_timer)

    def close(self) -> None:
        self.closed = True
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.transport is not None:
            self.transport.close()


class UpstreamResponse:
    """An engine's response once its head is in; the body is read with :meth:`next_chunk`,
    :meth:`aiter_raw` or :meth:`aread`. Close it (:meth:`aclose`) whatever happens: a body read
    to its end puts the connection back in the pool, anything else closes it."""

    def __init__(self, pool: UpstreamPool, conn: _Connection, head: Head, idle: float,
                 patience: Patience | None = None, sent_at: float = 0.0) -> None:
        self.status_code = head.status
        self.reason_phrase = head.reason
        self.headers = head.headers
        self._pool = pool
        self._conn: _Connection | None = conn
        self._keep_alive = head.keep_alive
        self._idle = idle
        self._patience = patience  # until the first body bytes (see Patience)
        self._sent_at = sent_at
        self.conn_requests = conn.requests  # requests sent on this connection, this one included
        self.done = False
        if conn.parser.body_complete:  # no body at all
            conn.parser.next_event()  # its END
            self._finish()

    @property
    def reused_connection(self) -> bool:
        """Whether the request went out on a connection that had served one before."""
        return self.conn_requests > 1

    def _finish(self) -> None:
        self.done = True
        self._release()

    def _release(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self._keep_alive and not conn.parser.buffered:
            self._pool._park(conn)
        else:
            conn.close()

    async def _wait(self, conn: _Connection) -> None:
        try:
            await conn.wait_patiently(self._idle, self._patience, self._sent_at)
        except _Stale as exc:
            if conn.parser.close_delimited:
                return  # the parser was told of the end: the body is complete
            cause = f": {exc.args[0]}" if exc.args and exc.args[0] else ""
            raise StreamBroken(f"the engine closed the connection mid-body{cause}") from None

    async def next_chunk(self) -> bytes:
        """The next body bytes as they arrive (everything buffered, never empty), or b"" once
        the body is complete."""
        if self.done:
            return b""
        conn = self._conn
        if conn is None:
            raise StreamBroken("the response was closed")
        parser = conn.parser
        try:
            while True:
                try:
                    event = parser.next_event()
                except ParseError as exc:
                    raise StreamBroken(str(exc)) from None
                if event.__class__ is bytes:
                    self._patience = None  # the engine has begun to answer
                    if parser.body_complete:  # the last bytes: the connection is free now
                        parser.next_event()
                        self._finish()
                    else:
                        conn.consumed()
                    return event  # type: ignore[return-value]
                if event is END:
                    self._finish()
                    return b""
                await self._wait(conn)  # NEED_DATA
        except BaseException:
            if not self.done:
                self._abort()
            raise

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        while True:
            chunk = await self.next_chunk()
            if not chunk:
                return
            yield chunk

    async def aread(self) -> bytes:
        parts = []
        while chunk := await self.next_chunk():
            parts.append(chunk)
        return b"".join(parts)

    def _abort(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def close(self) -> None:
        """Give the connection back if the body was read to its end, else close it."""
        if self.done:
            self._release()
        else:
            self._abort()

    async def aclose(self) -> None:
        self.close()


class UpstreamPool:
    """Keep-alive connections to engines, per (host, port), most recently used first.

    ``connect_timeout`` bounds establishing a connection; ``idle_timeout`` (overridable per
    request) bounds every wait for bytes — for the response head and for each piece of body.
    At most ``max_idle_per_host`` idle connections are kept per engine; busy ones are not
    limited (the engines' own admission decides how many requests they take).
    """

    def __init__(self, *, connect_timeout: float = 5.0, idle_timeout: float = 30.0,
                 max_idle_per_host: int = DEFAULT_MAX_IDLE_PER_HOST,
                 max_idle_age: float = DEFAULT_MAX_IDLE_AGE) -> None:
        self.connect_timeout = connect_timeout
        self.idle_timeout = idle_timeout
        self.max_idle_per_host = max_idle_per_host
        self.max_idle_age = max_idle_age
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._targets: dict[str, Target] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        # Counters for tests and the curious: how many connections were opened / reused, and
        # how many requests were re-sent after a stale pooled connection.
        self.opened = 0
        self.reused = 0
        self.stale_retries = 0

    def target(self, url: str) -> Target:
        t = self._targets.get(url)
        if t is None:
            t = parse_url(url)
            if len(self._targets) >= 4096:  # engines' URLs are few; never grow without bound
                self._targets.clear()
            self._targets[url] = t
        return t

    def idle_count(self, url: str | None = None) -> int:
        if url is None:
            return sum(len(v) for v in self._idle.values())
        t = self.target(url)
        return len(self._idle.get((t.host, t.port), ()))

    # --- connections ---------------------------------------------------------------------------

    def _check_loop(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            # Connections belong to the loop that opened them (tests run several loops).
            for conns in self._idle.values():
                for c in conns:
                    c.home = None
                    try:
                        c.close()
                    except RuntimeError:  # its loop is closed already; nothing to tidy
                        pass
            self._idle.clear()
            self._loop = loop
        return loop

    def _take(self, key: tuple[str, int], loop: asyncio.AbstractEventLoop) -> _Connection | None:
        conns = self._idle.get(key)
        if not conns:
            return None
        oldest_ok = loop.time() - self.max_idle_age
        while conns:
            conn = conns.pop()
            conn.home = None
            if conn.closed or conn.parser.buffered or conn.parked_at < oldest_ok \
                    or conn.transport is None or conn.transport.is_closing():
                conn.close()
                continue
            return conn
        return None

    def _park(self, conn: _Connection) -> None:
        if self._closed or conn.closed or conn.loop is not self._loop:
            conn.close()
            return
        conns = self._idle.setdefault(conn.key, [])
        if len(conns) >= self.max_idle_per_host:
            conn.close()
            return
        conn.parked_at = conn.loop.time()
        conn.home = conns
        conns.append(conn)

    async def _connect(self, t: Target, loop: asyncio.AbstractEventLoop,
                       timeout: float) -> _Connection:
        key = (t.host, t.port)
        deadline = asyncio.timeout(timeout)
        try:
            async with deadline:
                _, proto = await loop.create_connection(lambda: _Connection(loop, key),
                                                        t.host, t.port)
        except TimeoutError:
            # How late the timeout itself ran tells the two causes apart, at no cost to a
            # connect that succeeds: a busy engine's full queue leaves it on time.
            when = deadline.when()
            late = loop.time() - when if when is not None else 0.0
            raise ConnectTimedOut(
                f"connecting to {t.host}:{t.port} timed out after {timeout:g} s" + (
                    f" (this process's event loop reached the timeout {late:.1f} s late)"
                    if late >= LATE_LOOP else "")) from None
        except OSError as exc:
            raise ConnectFailed(f"cannot connect to {t.host}:{t.port}: {exc}") from None
        self.opened += 1
        return proto

    # --- requests ------------------------------------------------------------------------------

    async def post(self, url: str, body: bytes, headers: Mapping[str, str] | None = None, *,
                   idle_timeout: float | None = None,
                   connect_timeout: float | None = None,
                   patience: Patience | None = None) -> UpstreamResponse:
        """POST ``body`` (with ``content-length``) and return once the response head is in.
        ``patience``: asked before an idle timeout stands, until the first body bytes come.

        Raises :class:`ConnectFailed`, :class:`StreamBroken` or :class:`IdleTimeout`."""
        if self._closed:
            raise ConnectFailed("the upstream pool is closed")
        loop = self._check_loop()
        t = self.target(url)
        idle = self.idle_timeout if idle_timeout is None else idle_timeout
        head = _request_head(t, len(body), headers)
        conn = self._take((t.host, t.port), loop)
        if conn is not None:
            self.reused += 1
            try:
                return await self._exchange(conn, head, body, idle, patience)
            except _Stale:
                self.stale_retries += 1  # never answered, so never processed: send it again
        conn = await self._connect(
            t, loop, self.connect_timeout if connect_timeout is None else connect_timeout)
        try:
            return await self._exchange(conn, head, body, idle, patience)
        except _Stale as exc:
            cause = f": {exc.args[0]}" if exc.args and exc.args[0] else ""
            raise StreamBroken(f"the engine closed the connection without a response{cause}") \
                from None

    async def _exchange(self, conn: _Connection, head: bytes, body: bytes,
                        idle: float, patience: Patience | None) -> UpstreamResponse:
        try:
            transport = conn.transport
            if transport is None or conn.closed or transport.is_closing():
                raise _Stale(None)
            conn.requests += 1
            if len(body) <= _SMALL_BODY:
                transport.write(head + body)
            else:
                transport.write(head)
                transport.write(body)
            return await self._read_head(conn, idle, patience, conn.loop.time())
        except BaseException:
            conn.close()
            raise

    async def _read_head(self, conn: _Connection, idle: float, patience: Patience | None,
                         sent_at: float) -> UpstreamResponse:
        """The response head (interim 1xx heads are skipped by the parser)."""
        parser = conn.parser
        while True:
            try:
                event = parser.next_event()
            except ParseError as exc:
                raise StreamBroken(str(exc)) from None
            if isinstance(event, Head):
                return UpstreamResponse(self, conn, event, idle, patience, sent_at)
            if parser.buffered:
                # Bytes of a response came: from here on a broken connection is a broken
                # stream, not a stale one (the engine saw the request).
                try:
                    await conn.wait_patiently(idle, patience, sent_at)
                except _Stale:
                    raise StreamBroken("the engine closed the connection mid-head") from None
            else:
                await conn.wait_patiently(idle, patience, sent_at)

    async def aclose(self) -> None:
        """Close every idle connection; responses still being read close when they end."""
        self._closed = True
        for conns in self._idle.values():
            for c in conns:
                c.home = None
                c.close()
        self._idle.clear()


def _request_head(t: Target, length: int, headers: Mapping[str, str] | None) -> bytes:
    extra = b"".join(b"%s: %s\r\n" % (k.encode("latin-1"), v.encode("latin-1"))
                     for k, v in headers.items()) if headers else b""
    return b"POST %s HTTP/1.1\r\nhost: %s\r\ncontent-length: %d\r\n%s\r\n" % (
        t.path, t.host_header, length, extra)
