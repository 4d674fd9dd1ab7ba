"""`jetrouter worker --engines N`: N simulated engines in one OS process.

Each hosted engine is a whole `jetrouter worker` of its own — its own `WorkerRuntime` (engines,
KV publisher with its own NATS connection and incarnation, metrics), its own FastAPI app, its own
HTTP port and worker id — so the routers see exactly what N separate processes would show them.
Only the interpreter, its imports and the event loop are shared: a fleet of hundreds of fast
simulated engines (`bench scale`) costs a few processes instead of hundreds.

Worker ids are ``<worker-id><i>`` and ports ``<port> + i - <engine-offset>`` for
``i = engine_offset .. engine_offset + N - 1`` (``--port 0``: each engine picks a free port). One
SIGTERM drains every engine the way a single worker drains (``WorkerRetired`` first, in-flight
requests finish); a ``crash`` fault ends the process, so every engine it hosts goes with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import signal
import sys
from collections.abc import Iterator, Sequence

from leanhttp.loop import run as run_loop
from workers.server import WorkerServer, WorkerSettings, build_server


def hosted_settings(base: WorkerSettings, engines: int, offset: int = 0) -> list[WorkerSettings]:
    """The settings of each of ``engines`` engines numbered from ``offset``, from one command
    line's: the worker id becomes a prefix, the port the first of consecutive ports."""
    if engines < 1 or offset < 0:
        raise ValueError("--engines must be at least 1 and --engine-offset not negative")
    if base.advertise_url and engines > 1:
        raise ValueError("--advertise-url names one engine: not with --engines above 1")
    return [dataclasses.replace(base, worker_id=f"{base.worker_id}{offset + i}",
                                port=base.port + i if base.port else 0)
            for i in range(engines)]


class _HostedServer(WorkerServer):
    """One hosted engine's uvicorn server: the host, not each server, owns the signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def _serve_all(servers: Sequence[WorkerServer]) -> None:
    loop = asyncio.get_running_loop()

    def drain(sig: int) -> None:
        for server in servers:
            server.handle_exit(sig, None)

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, drain, sig)
    await asyncio.gather(*(server.serve() for server in servers))


def serve_engines(settings: Sequence[WorkerSettings]) -> int:
    """Run every engine of ``settings`` in this process until SIGTERM; 0 once all have drained."""
    servers = [build_server(one, _HostedServer) for one in settings]
    run_loop(_serve_all(servers))
    if all(server.started for server in servers):
        return 0
    print("jetrouter worker: not every hosted engine started", file=sys.stderr)
    return 1
