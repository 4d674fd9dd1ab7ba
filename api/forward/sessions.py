"""Session lifecycle calls to engines that keep per-session state (SGLang's streaming sessions).

When a sticky session is first pinned to an engine (its first turn, or a re-pin after its engine
went away), the router asks that engine to open the session; after the session's last turn it
asks it to close it. The calls follow SGLang's endpoints: ``POST /open_session`` with
``{"session_id", "capacity_of_str_len"}`` and ``POST /close_session`` with ``{"session_id"}``.
An engine that answers 404 or 405 to an open does not support sessions: it is remembered and
not asked again (the pin still works, it only lives in the router). A failed call never fails
the turn: routing does not depend on the engine's session state.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from fastapi.responses import Response

from api.upstream import UpstreamError, UpstreamPool

log = logging.getLogger("jetrouter.sessions")

OPEN_PATH = "/open_session"
CLOSE_PATH = "/close_session"
CALL_TIMEOUT = 2.0
DEFAULT_CAPACITY = 65536  # SGLang's capacity_of_str_len: room for the session's context


class EngineSessions:
    def __init__(self, pool: UpstreamPool) -> None:
        self.pool = pool
        self.unsupported: set[str] = set()  # engine base URLs without session endpoints
        self.calls: dict[tuple[str, str], int] = {}  # (path, outcome) -> count
        self._bg: set[asyncio.Task[None]] = set()

    async def open(self, url: str, session_id: str) -> None:
        await self._call(url, OPEN_PATH, {"session_id": session_id,
                                          "capacity_of_str_len": DEFAULT_CAPACITY})

    def close_after(self, resp: Response, url: str, session_id: str) -> None:
        """Close once the last turn's answer is out: after its stream ends (or at once for a
        complete body), in the background, so the client never waits for it."""
        body_iter = getattr(resp, "body_iterator", None)
        if body_iter is None:
            self.close_later(url, session_id)
            return

        async def then_close() -> AsyncIterator[Any]:
            try:
                async for chunk in body_iter:
                    yield chunk
            finally:
                self.close_later(url, session_id)

        resp.body_iterator = then_close()

    def close_later(self, url: str, session_id: str) -> None:
        task = asyncio.ensure_future(self._call(url, CLOSE_PATH, {"session_id": session_id}))
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    async def _call(self, url: str, path: str, body: dict[str, object]) -> None:
        base = url.rstrip("/")
        if base in self.unsupported:
            return
        outcome = "error"
        try:
            resp = await asyncio.wait_for(
                self.pool.post(base + path, msgspec.json.encode(body),
                               {"content-type": "application/json"},
                               idle_timeout=CALL_TIMEOUT, connect_timeout=CALL_TIMEOUT),
                CALL_TIMEOUT)
            try:
                await resp.aread()
            finally:
                resp.close()
            if resp.status_code in (404, 405) and path == OPEN_PATH:
                self.unsupported.add(base)
                outcome = "unsupported"
                log.info("engine %s has no %s: sessions live in the router only", base, path)
            elif resp.status_code == 404:  # closing a session the engine no longer has
                outcome = "unknown_session"
            elif resp.status_code < 300:
                outcome = "ok"
            else:
                log.warning("engine %s answered %s to %s", base, resp.status_code, path)
        except (UpstreamError, OSError, TimeoutError) as exc:
            log.warning("engine %s: %s failed (%s)", base, path, type(exc).__name__)
        key = (path, outcome)
        self.calls[key] = self.calls.get(key, 0) + 1
