"""A response's head written with its body: one socket write instead of two.

uvicorn's request cycle writes the status line and headers as soon as the application sends
``http.response.start``, and the body in a second ``write``. A non-streamed answer sends both
in one step of its task, so the two writes follow each other, each a system call that on a
loopback connection also runs the receiver's side of TCP. Profiled at 64 requests in flight,
py-spy put ~9 % of the router replica's samples on those two lines; holding the head took one
write a request away (2.93 -> 1.96 by strace), though the CPU saved was below what the 2-core
machine it was measured on could show.

:class:`HeadWithBody` stands in for the transport of one request cycle: the cycle's first
write (the head, or an interim ``100 Continue``) is held until the end of the event loop's
current step; a write in that step carries it along, otherwise it goes out alone, one step
later. Every other write passes straight through, so a stream's chunks are not delayed.
"""

from __future__ import annotations

import asyncio
from typing import Any


class HeadWithBody:
    """The transport of one request cycle, holding its first write for the next one."""

    __slots__ = ("_held", "_loop", "_started", "transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self.transport = transport
        self._loop = loop
        self._held: bytes | None = None
        self._started = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        held = self._held
        if held is not None:
            self._held = None
            self.transport.write(held + bytes(data))
        elif not self._started:
            self._started = True
            self._held = bytes(data)
            self._loop.call_soon(self.flush)
        else:
            self.transport.write(data)

    def flush(self) -> None:
        """Write what is held (nothing once a later write took it along)."""
        held = self._held
        if held is not None:
            self._held = None
            if not self.transport.is_closing():
                self.transport.write(held)

    def close(self) -> None:
        self.flush()
        self.transport.close()

    def is_closing(self) -> bool:
        return self.transport.is_closing()

    def __getattr__(self, name: str) -> Any:  # anything else a cycle may ask of its transport
        return getattr(self.transport, name)


def hold_heads(cycle: Any, loop: asyncio.AbstractEventLoop) -> None:
    """Give a uvicorn request cycle a :class:`HeadWithBody` transport (a cycle without a
    ``transport`` attribute, from another uvicorn release, is left as it is)."""
    transport = getattr(cycle, "transport", None)
    if transport is not None and not isinstance(transport, HeadWithBody):
        cycle.transport = HeadWithBody(transport, loop)
