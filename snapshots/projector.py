"""The projector: a replica's child process that keeps its SQL catalog and ledger up to date.

Projections follow the router stream (three messages per request) into SQLite; done in the
replica's own process, that work competed with request handling for the interpreter (about a
quarter of the replica's CPU under load). In a child process it runs on the other core. The
replica opens the same database for reading (SQLite WAL: readers never block the writer).

`python -m snapshots.projector --nats-url URL --namespace NS --database-url URL` (plus the
replica's NATS credential/TLS flags) — it exits when its parent dies (it checks the parent pid)
or on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable

from eventlog.connect import NatsOptions, add_nats_arguments, connect, options_from_args
from eventlog.names import Names
from leanhttp.loop import run as run_loop
from snapshots.projections import ProjectionFeeder, Projections

log = logging.getLogger("jetrouter.projector")


async def project(nats: NatsOptions, namespace: str, database_url: str, retention: float,
                  parent: int) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    # Orphaned (the replica died): the watcher thread sets `stop`, so the loop itself runs no
    # timer while the streams are quiet.
    threading.Thread(target=_watch_parent, args=(parent, lambda: _set_from_thread(loop, stop)),
                     daemon=True).start()
    nc = await connect(nats, name=f"projector-{parent}",
                       max_reconnect_attempts=-1, reconnect_time_wait=0.5)
    projections = Projections(database_url, ledger_retention=retention)
    await projections.start()
    feeder = ProjectionFeeder(nc.jetstream(), Names(namespace), projections)
    await feeder.start()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await feeder.stop()  # the feeder writes into the projections: stop it first
        await projections.close()
        await nc.close()


def _set_from_thread(loop: asyncio.AbstractEventLoop, event: asyncio.Event) -> None:
    with contextlib.suppress(RuntimeError):  # the loop already closed
        loop.call_soon_threadsafe(event.set)


def _watch_parent(parent: int, orphaned: Callable[[], None], grace: float = 5.0) -> None:
    """When orphaned, ask the loop for a clean shutdown, then exit whatever the event loop is
    doing (a shutdown can hang on a NATS server that died with the replica). SQLite
    transactions are atomic, so exiting mid-write is safe."""
    while os.getppid() == parent:
        time.sleep(0.5)
    orphaned()
    time.sleep(grace)  # let the loop's own clean shutdown finish first
    os._exit(0)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m snapshots.projector")
    p.add_argument("--nats-url", required=True)
    p.add_argument("--namespace", default="jr")
    p.add_argument("--database-url", required=True)
    p.add_argument("--ledger-retention", type=float, default=7 * 86400.0)
    p.add_argument("--parent", type=int, default=os.getppid())
    add_nats_arguments(p)  # the replica's own identity; literal secrets come in the environment
    args = p.parse_args()
    logging.basicConfig(level="WARNING", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run_loop(project(options_from_args(args), args.namespace, args.database_url,
                     args.ledger_retention, args.parent))


if __name__ == "__main__":
    main()
