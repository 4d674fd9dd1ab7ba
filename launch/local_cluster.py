"""`LocalCluster`: nats-server, router replicas and simulated engines as supervised local
processes (design.md §10).

An embedded nats-server with JetStream (or an existing NATS via ``nats_url``), N router replicas
(`jetrouter serve`) and M simulated engines (`jetrouter worker`) as child processes, each logging
to ``<data-dir>/logs/<name>.log``. A child that dies is restarted with exponential backoff unless
``restart=False``. ``<data-dir>/cluster.json`` always describes the running cluster (URLs, pids,
admin token), so scripts and tests can find it. Stopping stops the children first, then
nats-server.

`jetrouter up` (``cluster/up.py``), the bench, the demos and the chaos harness all start their
clusters with it; it imports none of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from errors.root import JetrouterError
from eventlog.connect import NatsOptions
from eventlog.events import Role
from eventlog.names import Names
from launch.children import (
    REPO_ROOT,
    Child,
    child_env,
    die_with_parent,
    load_prctl,
    log_tail,
    port_in_use,
)
from launch.standby_pool import StandbySlot
from natsops import server as nats_server

log = logging.getLogger("jetrouter.up")

BACKOFF_MIN = 0.5
BACKOFF_MAX = 10.0
STABLE_AFTER = 30.0  # a child up this long has its backoff reset
REPLICA_PORT_OFFSET = 0
WORKER_PORT_OFFSET = 100
_ROLE_PREFIX = {Role.BOTH: "w", Role.PREFILL: "p", Role.DECODE: "d"}


class ClusterStartError(JetrouterError):
    """The cluster did not become ready; the message names the children and their log tails."""


class LocalCluster:
    """nats-server + replicas + workers on loopback, supervised; an async context manager."""

    def __init__(
        self,
        *,
        replicas: int = 2,
        workers: int = 4,
        base_port: int | None = None,
        data_dir: Path = Path(".jetrouter"),
        router_args: Sequence[str] = (),
        worker_args: Sequence[str] = (),
        nats_url: str | None = None,
        restart: bool = True,
        namespace: str = "jr",
        nats_cluster: int = 1,
        admin_token: str | None = None,
        ready_timeout: float = 60.0,
        stop_timeout: float = 10.0,
        secure: bool = False,
        nats_options: NatsOptions | None = None,
        model_path: Path | str | None = None,
        router_module: str = "api.cli",
        prefill_workers: int = 0,
        decode_workers: int = 0,
        standby: bool = False,
        stable_after: float = STABLE_AFTER,
        engines_per_process: int = 1,
    ) -> None:
        # router_module: what `python -m` runs as `<module> serve ...` for each replica (a test
        # passes one that adds debug routes; the product never ships them).
        # workers=0: engines come from elsewhere (real engines behind `jetrouter bridge`).
        # prefill_workers / decode_workers: disaggregated serving, engines p0.. and d0.. with
        # those roles, besides the `workers` ones (w0.., role both).
        # engines_per_process > 1: up to that many engines of one role share a process
        # (`jetrouter worker --engines N`, a child named like w0-w15); each is still a worker of
        # its own to the routers. For fleets of hundreds of simulated engines (bench scale).
        if replicas < 1 or min(workers, prefill_workers, decode_workers) < 0:
            raise ValueError("a cluster needs at least one replica and no negative workers")
        if engines_per_process < 1 or (secure and engines_per_process > 1):
            raise ValueError("engines_per_process must be at least 1, and 1 with secure=True "
                             "(each engine connects to NATS as its own identity)")
        self.engines_per_process = engines_per_process
        # One model folder for both sides: the router hashes exactly the ids the engines cache.
        model_args = ["--model-path", str(Path(model_path).resolve())] if model_path else []
        router_args = [*model_args, *router_args]
        worker_args = [*model_args, *worker_args]
        self.replicas = replicas
        self.roles = ([Role.BOTH] * workers + [Role.PREFILL] * prefill_workers
                      + [Role.DECODE] * decode_workers)
        self.workers = len(self.roles)
        self.base_port = base_port
        self.data_dir = Path(data_dir).resolve()
        self.router_args = list(router_args)
        self.router_module = router_module
        self.worker_args = list(worker_args)
        self.nats_url = nats_url or ""
        self.restart = restart
        self.namespace = namespace
        self.nats_cluster = nats_cluster
        # hex: a token starting with "-" would read as an option in `jetrouter admin --token T`
        self.admin_token = admin_token or secrets.token_hex(24)
        self.ready_timeout = ready_timeout
        self.stop_timeout = stop_timeout
        # --secure: the embedded nats-server gets TLS, users and per-role permissions
        # (natsops/secure.py); every child connects as its own identity.
        self.secure = secure
        if secure and nats_url:
            raise ValueError("--secure sets up the embedded nats-server; for an existing NATS "
                             "give its credentials with the --nats-* flags instead")
        self.nats_options = nats_options or NatsOptions()  # for an existing NATS (--nats-url)
        self.secure_setup: Any = None  # natsops.secure.SecureSetup once started with secure=True
        self.children: dict[str, Child] = {}
        self._roles: dict[str, Role] = {}  # worker name -> role, for prefill/decode engines
        self._nats: Any = None  # natsops.server.NatsServer | NatsCluster when embedded
        self._supervisors: dict[str, asyncio.Task[None]] = {}
        self._background: set[asyncio.Task[None]] = set()
        self.stable_after = stable_after  # a child up this long has its restart backoff reset
        self._stopping = asyncio.Event()
        self._closed = False
        self._prctl = load_prctl()
        # standby: keep one pre-imported replica process (launch/standby_pool.py) so a replica
        # that dies comes back without paying the interpreter's imports again. Only for the
        # product's own entry point: a test's router_module may add routes the standby lacks.
        self.standby = (StandbySlot(self._spawn_standby, self.data_dir / "logs" / "standby.log")
                        if standby and restart and router_module == "api.cli" else None)

    # -- public view ------------------------------------------------------------------------

    @property
    def router_urls(self) -> list[str]:
        return [c.url for c in self.children.values() if c.kind == "replica"]

    @property
    def worker_urls(self) -> list[str]:
        """Every engine's URL, those sharing a process included."""
        return [u for c in self.children.values() if c.kind in ("worker", "engines")
                for u in (c.engines.values() or [c.url])]

    @property
    def processes(self) -> dict[str, int]:
        """name -> pid of each child's latest process (it may be dead, awaiting restart)."""
        return {n: c.pid for n, c in self.children.items() if c.pid is not None}

    @property
    def cluster_json_path(self) -> Path:
        return self.data_dir / "cluster.json"

    @property
    def admin_token_path(self) -> Path:
        return self.data_dir / "admin-token"

    def kill(self, name: str, sig: int = signal.SIGKILL) -> int:
        """Send `sig` to child `name` (chaos tests); returns the pid signalled."""
        child = self.children[name]
        if child.proc is None or child.proc.returncode is not None:
            raise ProcessLookupError(f"{name} is not running")
        self._signal(child, sig)
        return child.proc.pid

    async def wait_ready(self, names: Sequence[str] | None = None,
                         timeout: float | None = None) -> None:
        """Poll until each named child (default: all) answers 200 on its probe path; give up
        early on a child that keeps crashing (3 exits during the wait, 1 without restarts)."""
        deadline = time.monotonic() + (self.ready_timeout if timeout is None else timeout)
        pending = list(names or self.children)
        max_exits = 3 if self.restart else 1
        exits_before = {n: self.children[n].exits for n in pending}
        async with httpx.AsyncClient(timeout=2.0) as client:
            while pending:
                still = []
                for name in pending:
                    child = self.children[name]
                    if not await self._probe(client, child):
                        still.append(name)
                pending = still
                if not pending:
                    return
                crashed = [n for n in pending
                           if self.children[n].exits - exits_before[n] >= max_exits
                           or (not self.restart and self.children[n].exits > 0)]
                if crashed or time.monotonic() > deadline:
                    raise ClusterStartError(self._not_ready_report(crashed or pending))
                await asyncio.sleep(0.1)

    # -- lifecycle ---------------------------------------------------------------------------

    async def __aenter__(self) -> LocalCluster:
        try:
            await self.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.stop()

    async def start(self) -> None:
        if not self.nats_url:
            # Fail before creating anything when nats-server is missing (one-line message).
            nats_server.find_nats_server()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        (self.data_dir / "logs").mkdir(exist_ok=True)
        self._plan_children()
        if self.secure:
            from natsops.secure import prepare

            self.secure_setup = await asyncio.to_thread(
                prepare, self.data_dir / "secure",
                [c.name for c in self.children.values() if c.kind == "replica"],
                [c.name for c in self.children.values() if c.kind == "worker"],
                names=Names(self.namespace))
            log.info("secured NATS: TLS CA, passwords and nats.conf in %s",
                     self.secure_setup.directory)
        if not self.nats_url:
            await self._start_nats()
        for child in self.children.values():
            self._finish_argv(child)
        self._write_token_file()
        for child in self.children.values():
            await self._spawn(child)
        self._write_cluster_json()
        for name, child in self.children.items():
            self._supervisors[name] = asyncio.create_task(self._supervise(child),
                                                          name=f"supervise-{name}")
        await self.wait_ready()
        if self.standby is not None:  # only now: it must not slow the cluster's own start
            await self.standby.fill()

    async def stop(self) -> None:
        """SIGTERM every child, SIGKILL what is left after `stop_timeout`, then stop nats."""
        if self._closed:
            return
        self._closed = True
        self._stopping.set()
        for child in self.children.values():
            self._signal(child, signal.SIGTERM)
        tasks = list(self._supervisors.values())
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=self.stop_timeout)
            if pending:
                for child in self.children.values():
                    self._signal(child, signal.SIGKILL)
                await asyncio.wait(pending, timeout=5.0)
                for task in pending:
                    task.cancel()
        for task in self._background:
            task.cancel()
        if self.standby is not None:
            await self.standby.close()
        # Children spawned but never supervised (start-up failed half-way).
        for child in self.children.values():
            if child.running and child.proc is not None:
                self._signal(child, signal.SIGKILL)
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(child.proc.wait(), 5.0)
        if self._nats is not None:
            await asyncio.to_thread(self._nats.stop)
            self._nats = None
        if self.cluster_json_path.exists():
            self._write_cluster_json()

    # -- internals ---------------------------------------------------------------------------

    def _engine_groups(self) -> list[tuple[Role, int, int]]:
        """(role, first number, engines) of each worker child: up to `engines_per_process`
        engines of one role, numbered per role, in the order of `self.roles`."""
        groups = []
        for role in dict.fromkeys(self.roles):
            total = self.roles.count(role)
            for first in range(0, total, self.engines_per_process):
                groups.append((role, first, min(self.engines_per_process, total - first)))
        return groups

    def _plan_children(self) -> None:
        groups = self._engine_groups()
        if self.base_port is None:
            replica_ports = nats_server.free_ports(self.replicas)
            # a child of n engines serves on n consecutive ports (`worker --engines n --port P`)
            worker_ports = [nats_server.free_port_run(n) for _, _, n in groups]
        else:
            replica_ports = [self.base_port + REPLICA_PORT_OFFSET + i for i in range(self.replicas)]
            every = [self.base_port + WORKER_PORT_OFFSET + i for i in range(self.workers)]
            starts = list(itertools.accumulate((n for _, _, n in groups), initial=0))[:-1]
            worker_ports = [every[i] for i in starts]
            busy = [p for p in replica_ports + every if port_in_use(p)]
            if busy:
                raise ClusterStartError(
                    f"port(s) {', '.join(map(str, busy))} already in use; choose another "
                    "--base-port (or --base-port 0 for free ports)")
        logs = self.data_dir / "logs"
        for i, port in enumerate(replica_ports):
            name = f"r{i}"
            self.children[name] = Child(name, "replica", [], f"http://127.0.0.1:{port}",
                                        "/ready", logs / f"{name}.log")
        for (role, first, n), port in zip(groups, worker_ports, strict=True):
            prefix = _ROLE_PREFIX[role]
            name = f"{prefix}{first}" if n == 1 else f"{prefix}{first}-{prefix}{first + n - 1}"
            child = self.children[name] = Child(
                name, "worker" if n == 1 else "engines", [], f"http://127.0.0.1:{port}",
                "/health", logs / f"{name}.log")
            if n > 1:
                child.engines = {f"{prefix}{first + i}": f"http://127.0.0.1:{port + i}"
                                 for i in range(n)}
            if role != Role.BOTH:
                self._roles[name] = role

    def child_nats_options(self, name: str) -> NatsOptions:
        """How child ``name`` (or ``admin``, for tools) connects: its own identity when secure,
        else the options given for an existing NATS."""
        if self.secure_setup is not None:
            return self.secure_setup.client_options(name).with_servers(self.nats_url)
        return self.nats_options.with_servers(self.nats_url)

    @property
    def client_options(self) -> NatsOptions:
        """NATS options for tools that observe the cluster (the admin identity when secure)."""
        return self.child_nats_options("admin")

    def _finish_argv(self, child: Child) -> None:
        port = child.url.rsplit(":", 1)[1]
        common = ["--host", "127.0.0.1", "--port", port,
                  *self.child_nats_options(child.name).child_argv()]
        if child.kind == "replica":
            replica_dir = self.data_dir / child.name
            replica_dir.mkdir(exist_ok=True)
            child.argv = [sys.executable, "-m", self.router_module, "serve", *common,
                          "--replica-id", child.name, "--nats-url", self.nats_url,
                          "--namespace", self.namespace, "--data-dir", str(replica_dir),
                          f"--admin-token={self.admin_token}", *self.router_args]
        else:
            role = self._roles.get(child.name)
            first = next(iter(child.engines), "")
            prefix = first.rstrip("0123456789")
            ids = (["--worker-id", prefix, "--engines", str(len(child.engines)),
                    "--engine-offset", first[len(prefix):]] if child.engines
                   else ["--worker-id", child.name])
            child.argv = [sys.executable, "-m", "api.cli", "worker", *common,
                          *ids, "--nats-url", self.nats_url,
                          "--namespace", self.namespace, *self.worker_args,
                          *(["--role", role] if role else [])]

    async def _start_nats(self) -> None:
        store = self.data_dir / "nats"
        store.mkdir(exist_ok=True)
        nats: Any
        setup = self.secure_setup
        conf = {"config_file": setup.config_file, "scheme": "tls"} if setup is not None else {}
        if self.nats_cluster > 1:
            nats = nats_server.NatsCluster(self.nats_cluster, base_dir=store, **conf)
            servers = list(nats.servers)
        else:
            nats = nats_server.NatsServer(store_dir=store, **conf)
            servers = [nats]
        self._nats = nats
        for server in servers:
            self._launch_nats(server)
        await asyncio.to_thread(nats.wait_ready)
        self.nats_url = nats.url
        log.info("nats-server up at %s (store %s)", self.nats_url, store)

    def _launch_nats(self, server: Any) -> None:
        """Like `NatsServer.launch`, but in its own session (so Ctrl-C reaches only `up`, which
        stops nats-server last) and tied to our life (no orphan if `up` is SIGKILLed)."""
        server.proc = subprocess.Popen(
            server.command(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True, env=server.environment(),
            preexec_fn=functools.partial(die_with_parent, self._prctl, os.getpid()))

    async def _spawn(self, child: Child) -> None:
        with child.log_path.open("ab") as logf:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            logf.write(f"\n=== {stamp} jetrouter up: starting {child.name} ===\n".encode())
            logf.flush()
            child.proc = await asyncio.create_subprocess_exec(
                *child.argv, stdin=asyncio.subprocess.DEVNULL, stdout=logf,
                stderr=asyncio.subprocess.STDOUT, cwd=str(REPO_ROOT),
                env={**child_env(), **self.child_nats_options(child.name).child_env()},
                # Own process group: Ctrl-C reaches only `up`, which stops children in order.
                start_new_session=True,
                preexec_fn=functools.partial(die_with_parent, self._prctl, os.getpid()))
        child.started_at = time.monotonic()
        log.info("started %s (pid %d) on %s", child.name, child.proc.pid, child.url)

    async def _supervise(self, child: Child) -> None:
        backoff = BACKOFF_MIN
        while True:
            assert child.proc is not None
            rc = await child.proc.wait()
            child.exits += 1
            child.last_returncode = rc
            if self._stopping.is_set():
                return
            uptime = time.monotonic() - child.started_at
            if uptime >= self.stable_after:
                backoff = BACKOFF_MIN
            if not self.restart:
                log.warning("%s (pid %d) exited with %s; not restarting (--no-restart)",
                            child.name, child.proc.pid, rc)
                self._write_cluster_json()
                return
            if backoff == BACKOFF_MIN and await self._restart_from_standby(child):
                # At once: the first restart after a stable run; a crash loop still backs off.
                backoff = min(backoff * 2, BACKOFF_MAX)
                continue
            log.warning("%s (pid %d) exited with %s after %.1f s; restarting in %.1f s",
                        child.name, child.proc.pid, rc, uptime, backoff)
            # Waiting here IS the restart policy; a stop request cuts it short.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), timeout=backoff)
            if self._stopping.is_set():
                return
            backoff = min(backoff * 2, BACKOFF_MAX)
            self._move_if_port_taken(child)
            await self._spawn(child)
            child.restarts += 1
            if self._stopping.is_set():  # stop() ran while we were spawning
                self._signal(child, signal.SIGTERM)
            self._write_cluster_json()

    async def _spawn_standby(self, stderr_path: Path) -> asyncio.subprocess.Process:
        with stderr_path.open("ab") as errf:
            return await asyncio.create_subprocess_exec(
                sys.executable, "-m", "api.standby", stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, stderr=errf, cwd=str(REPO_ROOT),
                env=child_env(), start_new_session=True,
                preexec_fn=functools.partial(die_with_parent, self._prctl, os.getpid()))

    async def _restart_from_standby(self, child: Child) -> bool:
        """Hand a dead replica's command line to the waiting standby; False when there is none
        (the caller restarts it the usual way)."""
        if self.standby is None or child.kind != "replica" or self._stopping.is_set():
            return False
        self._move_if_port_taken(child)
        argv = child.argv[3:]  # [python, -m, api.cli, serve, ...] -> what follows `jetrouter`
        with child.log_path.open("ab") as logf:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            logf.write(f"\n=== {stamp} jetrouter up: {child.name} from the standby ===\n".encode())
        proc = await self.standby.take(argv, self.child_nats_options(child.name).child_env(),
                                       child.log_path)
        if proc is None:
            return False
        dead_pid = child.pid
        child.proc = proc
        child.started_at = time.monotonic()
        child.restarts += 1
        log.warning("%s (pid %d) exited; restarted at once as pid %d (the standby)",
                    child.name, dead_pid, proc.pid)
        self._write_cluster_json()
        refill = asyncio.create_task(self._refill_standby_once_ready(child),
                                     name="standby-refill")
        self._background.add(refill)
        refill.add_done_callback(self._background.discard)
        return True

    async def _refill_standby_once_ready(self, child: Child) -> None:
        """The next standby starts once the restarted replica is ready (or has given up), so
        its imports do not take CPU from the replica that is coming back."""
        assert self.standby is not None
        with contextlib.suppress(ClusterStartError):
            await self.wait_ready([child.name], timeout=self.ready_timeout)
        if not self._stopping.is_set():
            await self.standby.fill()

    def _move_if_port_taken(self, child: Child) -> None:
        """A child on a port `up` picked (no --base-port) whose port another process took while
        it was down comes back on a fresh port: restarting it on the taken one would fail every
        time. cluster.json and the child's own announcement carry the new URL."""
        ports = [int(u.rsplit(":", 1)[1]) for u in (child.engines.values() or [child.url])]
        if self.base_port is not None or not any(map(port_in_use, ports)):
            return
        fresh = nats_server.free_port_run(len(ports))
        log.warning("%s: port(s) %s taken by another process; restarting it on port %d",
                    child.name, ports, fresh)
        child.url = f"http://127.0.0.1:{fresh}"
        child.engines = {w: f"http://127.0.0.1:{fresh + i}" for i, w in enumerate(child.engines)}
        self._finish_argv(child)

    async def _probe(self, client: httpx.AsyncClient, child: Child) -> bool:
        if not child.running:
            return False
        for url in child.engines.values() or [child.url]:  # an engine host: every engine
            try:
                resp = await client.get(url + child.probe_path)
            except httpx.HTTPError:
                return False
            if resp.status_code != 200:
                return False
        return True

    def _signal(self, child: Child, sig: int) -> None:
        proc = child.proc
        if proc is None or proc.returncode is not None:
            return
        try:
            os.killpg(proc.pid, sig)  # the whole group: a child's own children go too
        except (ProcessLookupError, PermissionError):
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, sig)

    def _not_ready_report(self, names: Sequence[str]) -> str:
        parts = []
        for name in names:
            c = self.children[name]
            state = (f"running (pid {c.pid}), {c.probe_path} not 200" if c.running
                     else f"exited {c.exits}x, last code {c.last_returncode}")
            parts.append(f"{name} at {c.url}: {state}; log {c.log_path}:\n{log_tail(c.log_path)}")
        return "cluster not ready: " + "\n".join(parts)

    def describe(self) -> dict[str, Any]:
        def entry(c: Child) -> dict[str, Any]:
            return {"id": c.name, "url": c.url, "pid": c.pid if c.running else None}

        def engines(c: Child) -> list[dict[str, Any]]:
            return [{"id": w, "url": u, "pid": c.pid if c.running else None, "process": c.name}
                    for w, u in c.engines.items()] if c.engines else [entry(c)]

        kids = self.children.values()
        secured = {"nats_secure": self.secure_setup.describe()} if self.secure_setup else {}
        return {
            **secured,
            "nats_url": self.nats_url,
            "namespace": self.namespace,
            "admin_token": self.admin_token,
            "state": "stopped" if self._closed else "running",
            "replicas": [entry(c) for c in kids if c.kind == "replica"],
            "workers": [e for c in kids if c.kind in ("worker", "engines") for e in engines(c)],
        }

    def _write_private(self, path: Path, text: str) -> None:
        """Atomic write, readable by the owner only (the files hold the admin token)."""
        tmp = path.with_suffix(path.suffix + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)

    def _write_cluster_json(self) -> None:
        self._write_private(self.cluster_json_path, json.dumps(self.describe(), indent=2) + "\n")

    def _write_token_file(self) -> None:
        self._write_private(self.admin_token_path, self.admin_token + "\n")


def check_model_path(path: str | None) -> None:
    """Fail fast, with one clear line, on a model folder the children could not load."""
    if not path:
        return
    from api.cli import CliError
    from tokenization.model_tokenizer import ModelFolderUnusable, load_codec

    try:
        load_codec(path)
    except ModelFolderUnusable as exc:
        raise CliError(str(exc)) from None
