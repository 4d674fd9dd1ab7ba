"""SGLang's KV hand-off (its prefill/decode disaggregation), as SGLang's own router speaks it.

An SGLang prefill engine (``--disaggregation-mode prefill``) runs a *bootstrap server* on
``--disaggregation-bootstrap-port`` (8998 by default); a decode engine
(``--disaggregation-mode decode``) meets it there and receives the prompt's KV cache over the
transfer backend (Mooncake, NIXL). The router's part is three fields in the request body:

* ``bootstrap_host`` — the prefill engine's host (the host of its URL, an IPv6 address in
  brackets);
* ``bootstrap_port`` — its bootstrap port (``null`` when not known: the bridge's
  ``--bootstrap-port`` was not given);
* ``bootstrap_room`` — a random id in ``[0, 2**63)``, one per request, naming the pair's meeting.

With ``n`` > 1 choices each field is a list of ``n`` (SGLang runs the choices as a batch of
``n`` requests, each with its own room). The *same* fields go to both engines, and the two
requests are sent **concurrently**: the prefill engine answers only once the decode engine has
pulled the blocks, so waiting for its answer before asking the decode engine would never end.
The decode engine's answer is the client's; the prefill engine's answer (one token) is read and
dropped, as SGLang's router drops it.

Here the prefill request is the client's body with the fields, not streamed (its answer is read
whole); the decode hop is the client's body with the same fields, streamed like every hop
(:mod:`api.forward.run`). :class:`ConcurrentPrefill` is the prefill request while the decode
hop runs: until the decode engine's first event, a failed prefill request fails the decode hop
(the engine would wait for blocks that are not coming), and a decode hop that ends before its
first event cancels the prefill request (its blocks would go nowhere).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Coroutine
from typing import Any, TypeVar
from urllib.parse import urlsplit

from api.forward.engine import HopFailed, HopFailure
from api.upstream import UpstreamResponse

log = logging.getLogger("jetrouter.disagg")

BOOTSTRAP_HOST = "bootstrap_host"
BOOTSTRAP_PORT = "bootstrap_port"
BOOTSTRAP_ROOM = "bootstrap_room"
ROOM_BITS = 63  # rooms are in [0, 2**63): SGLang's router draws them so

T = TypeVar("T")
_running: set[asyncio.Task[bool]] = set()


def bootstrap_host(url: str) -> str:
    """The host SGLang's decode engine reaches the prefill engine's bootstrap server at."""
    host = urlsplit(url).hostname or ""
    return f"[{host}]" if ":" in host else host


def choices(body: dict[str, Any]) -> int:
    n = body.get("n")
    return n if isinstance(n, int) and n > 1 else 1


def bootstrap_fields(prefill_url: str, bootstrap_port: int, n: int) -> dict[str, Any]:
    """The fields both requests of one hand-off carry, with fresh random rooms."""
    host = bootstrap_host(prefill_url)
    port = bootstrap_port or None
    if n == 1:
        return {BOOTSTRAP_HOST: host, BOOTSTRAP_PORT: port,
                BOOTSTRAP_ROOM: secrets.randbits(ROOM_BITS)}
    return {BOOTSTRAP_HOST: [host] * n, BOOTSTRAP_PORT: [port] * n,
            BOOTSTRAP_ROOM: [secrets.randbits(ROOM_BITS) for _ in range(n)]}


def prefill_body(body: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    """The prefill engine's request: the client's body with the hand-off fields, not streamed
    (the router reads its answer whole and drops it)."""
    out = {k: v for k, v in body.items() if k != "stream_options"}
    out["stream"] = False
    out.update(fields)
    return out


def prompt_blocks(isl_tokens: int, block_size: int) -> int:
    """KV blocks an SGLang decode engine receives: the whole prompt's, the last one partial
    (SGLang's answers do not name them, so this is the router's count of the prompt)."""
    return -(-isl_tokens // block_size) if block_size > 0 else 0


class ConcurrentPrefill:
    """The prefill request of one SGLang hand-off, running beside the decode hop.

    ``start(call)`` runs ``call`` (the prefill hop: True when the engine answered with a
    usable answer). The decode hop opens through :meth:`opened` and reads its events through
    :meth:`events`; :meth:`decode_ended` is how it says it ended."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id  # the prefill hop's id
        self.task: asyncio.Task[bool] | None = None
        self._failed: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.decode_started = False  # the decode engine sent its first event: blocks arrived

    def start(self, call: Coroutine[Any, Any, bool]) -> None:
        self.task = asyncio.ensure_future(self._run(call))
        _running.add(self.task)  # it may outlive its run: the loop keeps only weak references
        self.task.add_done_callback(_running.discard)

    async def _run(self, call: Coroutine[Any, Any, bool]) -> bool:
        ok = False
        try:
            ok = await call
            return ok
        finally:
            if not ok and not self._failed.done():
                self._failed.set_result("the prefill engine failed the hand-off")

    def decode_ended(self) -> None:
        """The decode hop ended: cancel the prefill request unless the decode engine had
        started answering (then the blocks are across and the prefill request ends itself)."""
        if not self.decode_started and self.task is not None and not self.task.done():
            log.info("hand-off %s: the decode hop ended first; cancelling the prefill request",
                     self.request_id)
            self.task.cancel()

    async def opened(self, opening: Awaitable[UpstreamResponse]) -> UpstreamResponse:
        """The decode engine's response head, unless the prefill request fails first."""
        try:
            resp = await self._unless_prefill_fails(opening)
        except BaseException:
            self.decode_ended()
            raise
        if resp.status_code != 200:
            self.decode_ended()
        return resp

    async def events(self, batches: AsyncIterator[T]) -> AsyncIterator[T]:
        """The decode engine's events; until the first, a failed prefill fails the hop."""
        try:
            if not self.decode_started:
                first = await self._unless_prefill_fails(_next_or_none(batches))
                if first is None:
                    return
                self.decode_started = True
                yield first
            async for batch in batches:
                yield batch
        finally:
            self.decode_ended()
            with contextlib.suppress(Exception):
                await batches.aclose()  # type: ignore[attr-defined]

    async def _unless_prefill_fails(self, waiting: Awaitable[T]) -> T:
        """``waiting``, or HopFailed when the prefill request fails first. The decode engine is
        not at fault (``engine_answered``: it stays a candidate and is not reported): the next
        hop carries no hand-off, as after a pull that failed (api/forward/run.py)."""
        task = asyncio.ensure_future(waiting)
        try:
            await asyncio.wait({task, self._failed}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            task.cancel()
            raise
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        raise HopFailed(HopFailure.STREAM_ERROR,
                        f"{self._failed.result()} ({self.request_id}); the decode engine would "
                        "wait for blocks that are not coming", engine_answered=True)


async def _next_or_none(batches: AsyncIterator[T]) -> T | None:
    try:
        return await anext(batches)
    except StopAsyncIteration:
        return None
