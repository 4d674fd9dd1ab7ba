"""One pre-imported replica process kept ready by `jetrouter up` (see api/standby.py).

A replica killed at any moment is meant to be back at once; a fresh `python -m api.cli serve`
first spends most of a second importing its libraries. The supervisor keeps one `api.standby`
process that has done that already, hands it the dead replica's command line, and starts the
next standby only once the restarted replica answers `/ready`, so the two never compete for the
CPU while a replica is coming back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path

from api.standby import READY_LINE, activation_line

__all__ = ["StandbySlot"]

log = logging.getLogger("jetrouter.up")

# Spawns `python -m api.standby` with stdin and stdout piped and the supervisor's usual process
# settings (own session, dies with the supervisor); given the path stderr goes to until activation.
SpawnStandby = Callable[[Path], Awaitable[asyncio.subprocess.Process]]


class StandbySlot:
    """At most one waiting standby process; `take` hands it over, `fill` starts the next one."""

    def __init__(self, spawn: SpawnStandby, log_path: Path) -> None:
        self._spawn = spawn
        self._log_path = log_path
        self._proc: asyncio.subprocess.Process | None = None
        self._ready = asyncio.Event()
        self._watch: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def ready(self) -> bool:
        """Imported and waiting (a standby still importing can be taken too: see `take`)."""
        return self._ready.is_set() and self._alive()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def _alive(self) -> bool:
        return self._proc is not None and self._proc.returncode is None

    async def fill(self) -> None:
        """Start a standby unless one is waiting already."""
        if self._closed or self._alive():
            return
        self._ready = asyncio.Event()
        self._proc = await self._spawn(self._log_path)
        self._watch = asyncio.create_task(self._read_ready(self._proc, self._ready),
                                          name="standby-ready")
        log.info("standby replica process started (pid %d)", self._proc.pid)

    async def wait_ready(self, timeout: float) -> bool:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._ready.wait(), timeout)
        return self.ready

    @staticmethod
    async def _read_ready(proc: asyncio.subprocess.Process, ready: asyncio.Event) -> None:
        assert proc.stdout is not None
        with contextlib.suppress(Exception):
            line = await proc.stdout.readline()
            if line.decode(errors="replace") == READY_LINE:
                ready.set()
            # After activation the process writes to its replica's log, not to this pipe: the
            # next read only sees the pipe close.
            await proc.stdout.read()

    async def take(self, argv: list[str], env: dict[str, str],
                   log_path: Path) -> asyncio.subprocess.Process | None:
        """Turn the waiting standby into the process `jetrouter <argv>` (with ``env`` added,
        output appended to ``log_path``); None when there is none alive. One still importing
        is taken as well: it runs the command as soon as its imports are done, which is still
        sooner than a fresh process."""
        proc = self._proc
        if proc is None or proc.returncode is not None or proc.stdin is None:
            return None
        self._proc = None
        try:
            proc.stdin.write(activation_line(argv, env, str(log_path)))
            await proc.stdin.drain()
            proc.stdin.close()
        except (BrokenPipeError, ConnectionResetError):
            return None
        return proc

    async def close(self) -> None:
        self._closed = True
        proc, self._proc = self._proc, None
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(proc.wait(), 5.0)
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(BaseException):
                await self._watch
