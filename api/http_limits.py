"""Limits on what one HTTP client may make a router replica hold: body size and read time.

Two guards, both below the application so that nothing is parsed or routed before they pass:

* :class:`BodySizeLimit` (ASGI middleware) answers 413 in OpenAI's error shape when a request body
  is larger than ``max_bytes``: at once from ``Content-Length``, and for a chunked body (no length
  announced) as soon as the bytes received pass the limit. The body is never buffered beyond the
  limit (uvicorn pauses reading until the app asks for more, see its ``HIGH_WATER_LIMIT``).
  The 413 does not close the connection: uvicorn reads and drops the rest of the body, so a
  client still uploading gets to read the answer instead of a reset (the read deadline below
  bounds how long that may take).
* :class:`RequestReadTimeoutProtocol` (uvicorn protocol) closes a connection whose request —
  headers and body — has not fully arrived ``request_read_timeout`` seconds after it began (or
  after the connection opened). uvicorn itself has no such bound: any byte received cancels its
  keep-alive timer, so a client trickling one header byte every few seconds (slowloris) would
  hold a connection, and with it a file descriptor, forever. Once the request is complete the
  timer stops: generation may stream for minutes and is bounded elsewhere.

  The same protocol keeps uvicorn's idle keep-alive timeout from cutting a request that has
  already arrived: uvloop (libuv) runs the timers that fell due while a step of the loop ran
  long (a burst of stream messages, a busy host's CPU) before it reads the sockets again, so
  the timer would close a connection with the client's next request waiting unread in it, and
  the client would see a reset. When bytes are waiting the connection stays open; they are
  read in the same turn of the loop.
"""

from __future__ import annotations

import array
import asyncio
import fcntl
import logging
import termios
from typing import Any

from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import encoded_error_body
from errors.root import JetrouterError
from leanhttp.head_with_body import hold_heads

log = logging.getLogger("jetrouter.http")

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
DEFAULT_REQUEST_READ_TIMEOUT = 30.0
DEFAULT_KEEP_ALIVE_TIMEOUT = 15.0


class _BodyTooLarge(JetrouterError):
    pass


def _error_body(status: int, message: str, code: str) -> bytes:
    return encoded_error_body(status, message, type="invalid_request_error", code=code)


def too_large_message(max_bytes: int) -> str:
    return (f"The request body is larger than this router accepts ({max_bytes} bytes); "
            "send a smaller request.")


class BodySizeLimit:
    """ASGI middleware: 413 for HTTP request bodies over ``max_bytes`` (see module doc)."""

    def __init__(self, app: ASGIApp, max_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        if max_bytes < 1:
            raise ValueError("max_bytes must be >= 1")
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    announced = int(value)
                except ValueError:  # uvicorn's parser rejects these first; be safe anyway
                    announced = self.max_bytes + 1
                if announced > self.max_bytes:
                    await self._reject(send)
                    return
                break
        received = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _BodyTooLarge()
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _BodyTooLarge:
            if not started:
                await self._reject(send)
        except ClientDisconnect:
            # The client went away (or its request read timed out) before its body arrived:
            # nobody is left to answer, and it is not a server error.
            log.info("client disconnected before sending its whole request body")

    async def _reject(self, send: Send) -> None:
        body = _error_body(413, too_large_message(self.max_bytes), "request_too_large")
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def bytes_waiting(transport: asyncio.BaseTransport) -> bool:
    """Whether the transport's socket has received bytes the loop has not read yet."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return False
    waiting = array.array("i", [0])
    try:
        fcntl.ioctl(sock.fileno(), termios.FIONREAD, waiting, True)
    except OSError:  # closed meanwhile, or not a socket that can tell
        return False
    return waiting[0] > 0


def _read_timeout_protocol(base: type[Any]) -> type[Any]:
    class RequestReadTimeoutProtocol(base):  # type: ignore[misc, valid-type]
        """uvicorn's HTTP protocol plus a deadline for reading each request (module doc);
        a response's head goes out with its body (leanhttp.head_with_body)."""

        request_read_timeout = DEFAULT_REQUEST_READ_TIMEOUT

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            self._read_timer: asyncio.TimerHandle | None = None
            self._headers_done = False
            super().connection_made(transport)
            self._arm_read_timer()

        def _arm_read_timer(self) -> None:
            if self._read_timer is None:
                self._read_timer = self.loop.call_later(self.request_read_timeout,
                                                        self._read_timed_out)

        def _disarm_read_timer(self) -> None:
            if self._read_timer is not None:
                self._read_timer.cancel()
                self._read_timer = None

        def on_message_begin(self) -> None:
            self._headers_done = False
            super().on_message_begin()
            self._arm_read_timer()  # a kept-alive connection's next request

        def on_headers_complete(self) -> None:
            self._headers_done = True
            super().on_headers_complete()
            hold_heads(self.cycle, self.loop)  # the head goes out with the body

        def on_message_complete(self) -> None:
            self._disarm_read_timer()
            super().on_message_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_read_timer()
            super().connection_lost(exc)

        def timeout_keep_alive_handler(self) -> None:
            if not bytes_waiting(self.transport):  # else: a request arrived (module doc)
                super().timeout_keep_alive_handler()

        def send_400_response(self, msg: str) -> None:
            # uvicorn's answer to bytes that are not HTTP (bad header characters, a broken
            # request line) is plain text; clients of this API expect OpenAI's error JSON.
            body = _error_body(400, f"{msg} The request is not valid HTTP/1.1.",
                               "invalid_http_request")
            self.transport.write(b"HTTP/1.1 400 Bad Request\r\n"
                                 b"content-type: application/json\r\n"
                                 b"content-length: " + str(len(body)).encode() + b"\r\n"
                                 b"connection: close\r\n\r\n" + body)
            self.transport.close()

        def _read_timed_out(self) -> None:
            self._read_timer = None
            if self.transport.is_closing():
                return
            cycle = self.cycle
            headers_done = self._headers_done
            if headers_done and cycle is not None and cycle.response_started:
                if not cycle.response_complete:
                    return  # the app answers without waiting for the body: let it finish
                # Answered already (e.g. 413) while the unwanted body kept coming: stop here.
                self.transport.close()
                return
            log.info("closing a connection whose request did not arrive within %.0f s (%s)",
                     self.request_read_timeout, "body" if headers_done else "headers")
            body = _error_body(408, f"The request was not received within "
                                    f"{self.request_read_timeout:g} seconds.", "request_timeout")
            self.transport.write(b"HTTP/1.1 408 Request Timeout\r\n"
                                 b"content-type: application/json\r\n"
                                 b"content-length: " + str(len(body)).encode() + b"\r\n"
                                 b"connection: close\r\n\r\n" + body)
            self.transport.close()

    return RequestReadTimeoutProtocol


def guarded_http_protocol(request_read_timeout: float) -> type[Any] | str:
    """The protocol class to pass as ``uvicorn.Config(http=...)``: uvicorn's httptools protocol
    with a request read deadline; uvicorn's default ("auto") when httptools is missing."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # httptools comes with uvicorn[standard]; without it, no guard
        log.warning("httptools is not installed: no request read timeout (slowloris guard)")
        return "auto"
    cls = _read_timeout_protocol(HttpToolsProtocol)
    cls.request_read_timeout = request_read_timeout
    return cls
