"""The inference routes' short way through the ASGI stack, and a lean SSE response.

Profiled at concurrency 1 and 64 (cProfile on the replica's thread CPU time), a streamed
``/v1/completions`` spent about a sixth of the replica's Python time in Starlette, FastAPI and
anyio rather than in routing: ten middleware layers on the way in, three ``send`` wrappers
around each of the ~10 chunks of an SSE answer, and a per-request anyio task group whose only
job is to notice a client that hangs up. These two routes need none of it (they read the raw
body and build their responses themselves), so:

* :class:`HotRoutes` sits in front of the app's middleware stack and hands ``POST`` to the
  inference paths straight to their handlers, behind the guard the app gives it (the replica's
  is :class:`api.http_limits.BodySizeLimit`) and with the app's own exception handlers (an
  ``ApiError`` is the same JSON error; an unexpected exception is logged, answered 500 unless the
  response had started, and re-raised, as Starlette's error middleware does). Anything else —
  another method, another path, a trailing slash — takes the full stack as before.
* :class:`LeanStreamingResponse` streams an async iterator of bytes with one watcher task that
  cancels the stream when the client disconnects (what Starlette does through anyio for ASGI
  servers below spec 2.4, uvicorn's included); the stream then ends as a cancelled request.
  Its iterator may mark its final bytes as a :class:`LastChunk`, which ends the chunked body in
  the same socket write.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

Handler = Callable[[Request], Awaitable[Response]]
ExceptionHandler = Callable[[Request, Exception], Awaitable[Response]]
Guard = Callable[[ASGIApp], ASGIApp]  # wraps the handlers' ASGI app (e.g. a body size limit)


class HotRoutes:
    """ASGI app: ``POST`` to one of ``routes`` goes straight to its handler; the rest to
    ``app`` (the full middleware stack)."""

    def __init__(self, app: ASGIApp, routes: Mapping[str, Handler],
                 exception_handlers: Mapping[object, ExceptionHandler], guard: Guard | None = None
                 ) -> None:
        self.app = app
        self.routes = dict(routes)
        self._handlers = {k: v for k, v in exception_handlers.items()
                          if isinstance(k, type) and k is not Exception}
        self._on_unexpected = exception_handlers.get(Exception) or exception_handlers.get(500)
        self._limited = self._serve if guard is None else guard(self._serve)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" \
                or scope["path"] not in self.routes:
            await self.app(scope, receive, send)
            return
        responding = [False]
        try:
            await self._limited(scope, receive, _MarkStarted(send, responding))
        except Exception as exc:
            if self._on_unexpected is not None and not responding[0]:
                response = await self._on_unexpected(Request(scope, receive), exc)
                await response(scope, receive, send)
            raise

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        try:
            response = await self.routes[scope["path"]](request)
        except Exception as exc:
            handler = self._handler_for(exc)
            if handler is None:
                raise
            response = await handler(request, exc)
        await response(scope, receive, send)

    def _handler_for(self, exc: Exception) -> ExceptionHandler | None:
        for cls in type(exc).__mro__:
            handler = self._handlers.get(cls)
            if handler is not None:
                return handler
        return None


def install_hot_routes(app: Starlette, routes: Mapping[str, Handler],
                       guard: Guard | None = None) -> None:
    """Serve ``POST`` to each of ``routes`` (path -> handler) from ``app``: as plain Starlette
    routes (no FastAPI dependency solving; the app's error handlers apply) and, once the app
    builds its middleware stack, through a :class:`HotRoutes` in front of it."""
    for path, handler in routes.items():
        app.add_route(path, handler, methods=["POST"])
    build_stack = app.build_middleware_stack
    hot = dict(routes)

    def build_with_hot_routes() -> ASGIApp:
        return HotRoutes(build_stack(), hot, app.exception_handlers, guard)

    app.build_middleware_stack = build_with_hot_routes  # type: ignore[method-assign]


class FrontDoor:
    """The ASGI app handed to the server: the inference routes go straight to the app's
    :class:`HotRoutes` once the app has built its stack, skipping ``FastAPI.__call__`` (which
    asks OpenTelemetry, through ``os.environ``, whether to trace, on every request) and
    ``Starlette.__call__``; everything else, and everything before the first request, goes to
    the app as it would."""

    def __init__(self, app: Starlette) -> None:
        self.app = app
        self._direct = not getattr(app, "root_path", "")  # FastAPI sets that one in __call__

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        hot = self.app.middleware_stack
        if type(hot) is HotRoutes and self._direct and scope["type"] == "http" \
                and scope["method"] == "POST" and scope["path"] in hot.routes:
            scope["app"] = self.app  # what Starlette.__call__ would have set
            await hot(scope, receive, send)
        else:
            await self.app(scope, receive, send)


async def read_body(request: Request) -> bytes:
    """``await request.body()`` without the async generator Starlette reads it through (a
    measurable share of a small request's cost); the request keeps it, as ``body()`` would."""
    chunks: list[bytes] = []
    while True:
        message = await request.receive()
        if message["type"] == "http.request":
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        elif message["type"] == "http.disconnect":
            raise ClientDisconnect()
    body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    request._body = body  # Starlette's cache: a later request.body() returns it
    return body


class _MarkStarted:
    """``send`` that notes when the response has started (a 500 can no longer be sent)."""

    __slots__ = ("send", "started")

    def __init__(self, send: Send, started: list[bool]) -> None:
        self.send = send
        self.started = started

    async def __call__(self, message: Mapping[str, object]) -> None:
        if message["type"] == "http.response.start":
            self.started[0] = True
        await self.send(message)  # type: ignore[arg-type]


class LastChunk(bytes):
    """The last bytes of a :class:`LeanStreamingResponse`: they go out with the end of the
    chunked body (one socket write instead of two). Nothing may follow it."""

    __slots__ = ()


class LeanStreamingResponse(Response):
    """An SSE (or any chunked) response from an async iterator of bytes (module doc)."""

    def __init__(self, content: AsyncIterator[bytes], *, media_type: str,
                 headers: Mapping[str, str] | None = None, status_code: int = 200) -> None:
        self.body_iterator = content
        self.status_code = status_code
        self.media_type = media_type
        self.background = None
        self.init_headers(headers)

    async def stream(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        ended = False
        async for chunk in self.body_iterator:
            # A LastChunk ends the response in the same write (the iterator still runs to its
            # end, so the code after its last yield runs).
            ended = type(chunk) is LastChunk
            await send({"type": "http.response.body", "body": chunk, "more_body": not ended})
        if not ended:
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        me = asyncio.current_task()
        assert me is not None
        gone = [False]
        watcher = asyncio.get_running_loop().create_task(_watch(receive, me, gone))
        try:
            await self.stream(send)
        except asyncio.CancelledError:
            # Our watcher's cancellation is a client that hung up: the response is over. Any
            # other cancellation (server shutdown) goes on up.
            if not gone[0] or me.uncancel() > 0:
                raise
        except OSError:
            if not gone[0]:
                raise
        finally:
            watcher.cancel()


async def _watch(receive: Receive, task: asyncio.Task[object], gone: list[bool]) -> None:
    """Cancel ``task`` once the client disconnects."""
    with contextlib.suppress(asyncio.CancelledError):
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                gone[0] = True
                task.cancel()
                return
