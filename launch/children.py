"""The child processes a local cluster supervises, and what each needs to start and be found.

A child runs in its own session from the repository root, with unbuffered output into its log
file, and dies with the launcher (``PR_SET_PDEATHSIG`` on Linux) so a SIGKILLed `jetrouter up`,
bench or test leaves nothing behind. :class:`LocalCluster` (``launch/local_cluster.py``) plans,
spawns and restarts them.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent


def children_of(pid: int) -> list[int]:
    """Direct children of ``pid`` (Linux /proc; every thread's, since any thread may fork),
    [] when the process is gone or /proc cannot tell. How benches, soaks and tests find a
    replica's projector child."""
    found: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found.extend(int(x) for x in f.read().split())
    except OSError:
        pass
    return found


@dataclass
class Child:
    """One supervised child process (a replica, a worker, or a host of several simulated
    engines); `proc` changes on every restart."""

    name: str
    kind: str  # "replica" | "worker" | "engines" (several workers in one process)
    argv: list[str]
    url: str  # an engine host's: its first engine's
    probe_path: str  # "/ready" for replicas, "/health" for workers
    log_path: Path
    engines: dict[str, str] = field(default_factory=dict)  # a host's worker ids -> their URLs
    proc: asyncio.subprocess.Process | None = None
    started_at: float = 0.0
    exits: int = 0
    restarts: int = 0
    last_returncode: int | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None


def port_in_use(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def load_prctl() -> Any:
    """libc's prctl, looked up in the parent: nothing may be imported between fork and exec."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        return ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PR_SET_PDEATHSIG = 1


def die_with_parent(prctl: Any, parent_pid: int) -> None:
    """Runs in the child before exec: if `jetrouter up` is SIGKILLed its children get SIGTERM
    instead of lingering (Linux only; elsewhere a no-op)."""
    if prctl is not None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"  # logs reach the file as they happen
    paths = [str(REPO_ROOT), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "    (no log)"
    return "\n".join("    " + line for line in text[-lines:])
