"""A listening socket on loopback that takes no connection: what a live engine too busy to accept
looks like from the router's side.

Linux queues ``backlog + 1`` completed handshakes for a socket that has not accepted them; with
the queue full it drops further SYNs (``tcp_abort_on_overflow`` 0, the default), so a client's
connect neither succeeds nor is refused: it waits, resending its SYN after 1 s, 3 s, 7 s ... The
socket here listens with a backlog of 0 and one connection of its own (the plug) fills the queue.
:meth:`FullAcceptQueue.accepting` then serves it like any server, which empties the queue: the
engine catching up.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class FullAcceptQueue:
    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(0)
        self.port: int = self.sock.getsockname()[1]
        # Room for one completed handshake: the plug's connect returns at once and fills it.
        self.plug = socket.create_connection(("127.0.0.1", self.port), timeout=5)
        self.server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def accepting(self, handler: Handler) -> None:
        """From now on accept and serve connections (the plug's too) with ``handler``."""
        self.sock.setblocking(False)
        self.server = await asyncio.start_server(handler, sock=self.sock)

    async def close(self) -> None:
        self.plug.close()
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()
        else:
            self.sock.close()
