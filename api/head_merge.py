"""A response's head goes out in the same socket write as its first body bytes.

uvicorn writes an HTTP response's status line and headers as soon as the app sends
``http.response.start``, and each body message in a write of its own. For the inference routes
the head is ready before the first body bytes (a stream starts once the engine has answered and
the decision is recorded; the first token comes a little later), so every answer cost one socket
write and one packet more than it needs, and the client woke up once for a head it cannot use
before the token behind it. On loopback a write also does the receiver's TCP work and wakes it
up, which makes it the costliest call of a request on a small machine (docs/design-notes.md,
note 53).

:class:`HeadWithFirstBody` is the ``send`` a request's app gets instead of uvicorn's own: while
the head waits for the first body message it stands in for the response's transport, keeps
what uvicorn writes, and hands it on in one write once that message is written. The head is
held at most ``HEAD_HOLD_SECONDS``: an engine still prefilling a long prompt does not keep the
client (or a proxy with a response-header timeout) from seeing the response start.

It only works with uvicorn's httptools protocol, whose response cycle writes through its
``transport`` attribute; with any other server ``for_send`` returns the ``send`` it was given.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from starlette.types import Send

try:
    from uvicorn.protocols.http.httptools_impl import RequestResponseCycle
except ImportError:  # httptools missing: uvicorn serves with h11, heads go out on their own
    RequestResponseCycle = None

# The longest a response's head waits for its first body bytes.
HEAD_HOLD_SECONDS = 0.05


class _HeldWrites:
    """Stands in for a response cycle's transport: keeps what is written until released."""

    __slots__ = ("cycle", "parts", "timer", "transport")

    def __init__(self, cycle: Any, transport: Any) -> None:
        self.cycle = cycle
        self.transport = transport
        self.parts: list[bytes] = []
        self.timer: asyncio.TimerHandle | None = None

    def write(self, data: bytes) -> None:
        self.parts.append(data)

    def is_closing(self) -> bool:
        return bool(self.transport.is_closing())

    def close(self) -> None:  # a response that ends the connection: what was held goes first
        self.release()
        self.transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)

    def release(self) -> None:
        """Give the cycle its transport back and write what was held, in one write."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.cycle.transport is self:
            self.cycle.transport = self.transport
        parts, self.parts = self.parts, []
        if parts and not self.transport.is_closing():
            self.transport.write(parts[0] if len(parts) == 1 else b"".join(parts))


class HeadWithFirstBody:
    """``send`` for one request: the head waits for the first body message (module doc)."""

    __slots__ = ("cycle", "held", "send")

    def __init__(self, send: Send, cycle: Any) -> None:
        self.send = send
        self.cycle = cycle
        self.held: _HeldWrites | None = None

    @staticmethod
    def for_send(send: Send) -> Send:
        """``send`` wrapped when it is a uvicorn httptools response cycle's, else ``send``."""
        cycle = getattr(send, "__self__", None)
        if RequestResponseCycle is None or type(cycle) is not RequestResponseCycle:
            return send
        return HeadWithFirstBody(send, cycle)

    async def __call__(self, message: Mapping[str, Any]) -> None:
        kind = message["type"]
        if kind == "http.response.start" and not self.cycle.response_started:
            held = self.held = _HeldWrites(self.cycle, self.cycle.transport)
            self.cycle.transport = held
            try:
                await self.send(message)  # type: ignore[arg-type]
            except BaseException:
                self._release()
                raise
            if held.parts:
                held.timer = asyncio.get_running_loop().call_later(HEAD_HOLD_SECONDS,
                                                                   self._release)
            else:
                self._release()
            return
        try:
            await self.send(message)  # type: ignore[arg-type]
        finally:
            if self.held is not None and kind == "http.response.body":
                self._release()

    def _release(self) -> None:
        held, self.held = self.held, None
        if held is not None:
            held.release()
