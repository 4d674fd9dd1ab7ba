"""A pre-imported standby: a process that has already paid `jetrouter serve`'s start-up imports
and waits to be told which replica to become.

Importing FastAPI, uvicorn, nats-py, msgspec, numpy, SQLAlchemy and our own modules takes
0.7 to 1.1 s on this project's 2-core VM before a restarted replica does any work; a supervisor
(`jetrouter up`) that keeps one of these ready hands a dead replica's command line to it and the
replica's restart pays only for what is specific to it (connect, restore, replay, listen).

Protocol, over the standby's standard streams (the supervisor owns both ends):

* once imported, the standby writes ``READY_LINE`` to stdout;
* the supervisor writes one JSON line to its stdin:
  ``{"argv": [...], "env": {...}, "log": "/path/to/replica.log"}`` — the arguments after
  ``jetrouter``, environment entries to add, and the log file to append to;
* the standby points stdout and stderr at that log, updates its environment and runs
  ``jetrouter <argv>`` in this very process. Its exit status is the replica's.

End of input before an activation line (the supervisor went away) ends the standby quietly.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import sys
from typing import Any

__all__ = ["PRELOADED", "READY_LINE", "activation_line", "main"]

READY_LINE = "jetrouter-standby ready\n"

# What `jetrouter serve` imports on its way to listening, including the lazy imports of its
# start path (api/serve.py `run`, uvicorn's protocol and loop choice, the leader and projection
# modules a replica reaches once running). A module missing here is only imported later.
PRELOADED: tuple[str, ...] = (
    "api.cli",
    "api.serve",
    "api.app",
    "api.admin",
    "api.tenancy",
    "leanhttp.hotpath",
    "replicas.runtime.leader",
    "snapshots.projections",
    "snapshots.db",
    "uvicorn.loops.auto",
    "uvicorn.loops.asyncio",
    "uvicorn.lifespan.on",
    "uvicorn.protocols.http.httptools_impl",
    "uvicorn.protocols.http.h11_impl",
    "uvicorn.protocols.websockets.websockets_sansio_impl",
    "uvloop",
    "pydantic.v1",
    "sqlalchemy.dialects.sqlite.aiosqlite",
    "aiosqlite",
    "httpcore._sync.connection_pool",
)


def activation_line(argv: list[str], env: dict[str, str], log: str) -> bytes:
    """The line a supervisor writes to activate a standby (see the module docstring)."""
    return (json.dumps({"argv": argv, "env": env, "log": log}) + "\n").encode()


def _preload() -> None:
    for name in PRELOADED:
        try:
            importlib.import_module(name)
        except ImportError:  # an optional piece (e.g. httptools) absent: imported later or never
            continue
    from api.cli import build_parser

    build_parser(["serve"])  # the verb's option registry, built once here
    # `serve` collects and freezes the heap once it has built its app (api/serve.py tune_gc);
    # done here for the imported modules, that pass only walks what the replica itself built.
    gc.collect()
    gc.freeze()


def _activate(line: str) -> list[str]:
    order: dict[str, Any] = json.loads(line)
    argv = [str(a) for a in order["argv"]]
    os.environ.update({str(k): str(v) for k, v in dict(order.get("env") or {}).items()})
    log_fd = os.open(str(order["log"]), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # the replica reads nothing from the supervisor from now on
    os.close(devnull)
    return argv


def main() -> int:
    _preload()
    sys.stdout.write(READY_LINE)
    sys.stdout.flush()
    line = sys.stdin.readline()
    if not line.strip():
        return 0
    argv = _activate(line)
    from api.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
