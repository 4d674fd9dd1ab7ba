"""Reading the KV tail while the snapshot before it is restored (design.md §7).

A restarting replica fetches, verifies and decodes its snapshot — waiting on NATS, or on a
thread that inflates and decodes — and only then reads the tail after it: ~100 k KV messages,
~0.8 s of CPU reading and decoding them. Reading does not depend on the state, only on where
the snapshot ends, which its meta says before its blob is fetched. So :class:`TailPrefetch`
starts a reader there and keeps what it reads, in order, while the snapshot loads. The follower
*adopts* it when the state it ends up with continues exactly where the prefetch starts: it
applies what was read, then goes on with the same reader. Anything else — an older snapshot
restored instead, a position moved, a reader that failed — and the prefetch is closed and what
it read dropped; the follower reads from the state's own position as it always did.

It stops on its own after ``limit`` messages or once the server said nothing was left after
the last one, so it never waits on a live pull and holds a bounded number of messages.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

from eventlog.events import Event
from eventlog.log import LogReader

Item = tuple[int, list[Event]]


class TailPrefetch:
    """Reads ``reader`` from its start into memory until ``limit`` messages or the end."""

    def __init__(self, reader: LogReader, limit: int) -> None:
        self.reader = reader
        self.start_seq = reader.last_seq + 1
        self.limit = limit
        self.read = 0
        self._items: list[Item] = []
        self._more = asyncio.Event()
        self._task = asyncio.create_task(self._run(), name=f"prefetch-{reader.stream}")

    async def _run(self) -> None:
        reader = self.reader
        async for first in reader:
            taken = [first, *reader.take_received(max(self.limit - self.read - 1, 0))]
            self._items += taken
            self.read += len(taken)
            self._more.set()
            if reader.pending == 0 or self.read >= self.limit:
                return

    @property
    def failed(self) -> bool:
        """Whether reading ended with an error (the reader is then unusable)."""
        task = self._task
        return task.done() and (task.cancelled() or task.exception() is not None)

    async def take(self) -> list[Item] | None:
        """What was read since the last take, waiting until there is some; None once reading
        has ended and everything was taken."""
        while not self._items:
            if self._task.done():
                return None
            self._more.clear()
            waiter = asyncio.ensure_future(self._more.wait())
            try:
                await asyncio.wait({self._task, waiter}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiter.cancel()
        items, self._items = self._items, []
        return items

    async def close(self) -> None:
        """Stop reading and close the reader (what was read and not taken is dropped)."""
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)  # the caller's cancel goes on
        self._items = []
        with contextlib.suppress(Exception):
            await self.reader.close()


async def adopt(prefetch: TailPrefetch, apply: Callable[[list[Item]], Awaitable[None]]
                ) -> LogReader | None:
    """Hand what ``prefetch`` reads to ``apply`` as it comes, until it stops; then its reader,
    positioned after the last message applied (None, reader closed, if reading failed)."""
    try:
        while (items := await prefetch.take()) is not None:
            await apply(items)
    except BaseException:
        await prefetch.close()
        raise
    if prefetch.failed:
        await prefetch.close()
        return None
    return prefetch.reader
