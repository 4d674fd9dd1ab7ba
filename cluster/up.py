"""`jetrouter up`: a whole local cluster in one command (design.md §10).

An embedded nats-server with JetStream (or an existing NATS via ``--nats-url``), N router replicas
(`jetrouter serve`) and M simulated engines (`jetrouter worker`) as child processes, each logging
to ``<data-dir>/logs/<name>.log``. A child that dies is restarted with exponential backoff unless
``--no-restart``. ``<data-dir>/cluster.json`` always describes the running cluster (URLs, pids,
admin token), so scripts and tests can find it. Ctrl-C / SIGTERM stops the children first, then
nats-server, and exits 0.

`LocalCluster` is the reusable part (the bench, the demo and chaos tests start clusters with it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from api.config import SERVE
from errors.root import JetrouterError
from eventlog.connect import NAMESPACE, NATS_SECURITY, NatsOptions, options_from_args
from eventlog.events import Role
from eventlog.names import Names
from natsops import server as nats_server
from natsops.pki import CertificateNotMade
from settings.flags import Group, Option, add_options, find, forward_argv, options_of, unset
from workers.config import WORKER

log = logging.getLogger("jetrouter.up")

REPO_ROOT = Path(__file__).resolve().parent.parent
BACKOFF_MIN = 0.5
BACKOFF_MAX = 10.0
STABLE_AFTER = 30.0  # a child up this long has its backoff reset
REPLICA_PORT_OFFSET = 0
WORKER_PORT_OFFSET = 100
DEFAULT_MODEL = "jetrouter-sim"
_ROLE_PREFIX = {Role.BOTH: "w", Role.PREFILL: "p", Role.DECODE: "d"}


class ClusterStartError(JetrouterError):
    """The cluster did not become ready; the message names the children and their log tails."""


@dataclass
class Child:
    """One supervised child process (a replica or a worker); `proc` changes on every restart."""

    name: str
    kind: str  # "replica" | "worker"
    argv: list[str]
    url: str
    probe_path: str  # "/ready" for replicas, "/health" for workers
    log_path: Path
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


def _load_prctl() -> Any:
    """libc's prctl, looked up in the parent: nothing may be imported between fork and exec."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        return ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PR_SET_PDEATHSIG = 1


def _die_with_parent(prctl: Any, parent_pid: int) -> None:
    """Runs in the child before exec: if `jetrouter up` is SIGKILLed its children get SIGTERM
    instead of lingering (Linux only; elsewhere a no-op)."""
    if prctl is not None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"  # logs reach the file as they happen
    paths = [str(REPO_ROOT), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


def _log_tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "    (no log)"
    return "\n".join("    " + line for line in text[-lines:])


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
    ) -> None:
        # router_module: what `python -m` runs as `<module> serve ...` for each replica (a test
        # passes one that adds debug routes; the product never ships them).
        # workers=0: engines come from elsewhere (real engines behind `jetrouter bridge`).
        # prefill_workers / decode_workers: disaggregated serving, engines p0.. and d0.. with
        # those roles, besides the `workers` ones (w0.., role both).
        if replicas < 1 or min(workers, prefill_workers, decode_workers) < 0:
            raise ValueError("a cluster needs at least one replica and no negative workers")
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
        self._stopping = asyncio.Event()
        self._closed = False
        self._prctl = _load_prctl()

    # -- public view ------------------------------------------------------------------------

    @property
    def router_urls(self) -> list[str]:
        return [c.url for c in self.children.values() if c.kind == "replica"]

    @property
    def worker_urls(self) -> list[str]:
        return [c.url for c in self.children.values() if c.kind == "worker"]

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

    def _plan_children(self) -> None:
        if self.base_port is None:
            ports = nats_server.free_ports(self.replicas + self.workers)
            replica_ports, worker_ports = ports[: self.replicas], ports[self.replicas:]
        else:
            replica_ports = [self.base_port + REPLICA_PORT_OFFSET + i for i in range(self.replicas)]
            worker_ports = [self.base_port + WORKER_PORT_OFFSET + i for i in range(self.workers)]
            busy = [p for p in replica_ports + worker_ports if port_in_use(p)]
            if busy:
                raise ClusterStartError(
                    f"port(s) {', '.join(map(str, busy))} already in use; choose another "
                    "--base-port (or --base-port 0 for free ports)")
        logs = self.data_dir / "logs"
        for i, port in enumerate(replica_ports):
            name = f"r{i}"
            self.children[name] = Child(name, "replica", [], f"http://127.0.0.1:{port}",
                                        "/ready", logs / f"{name}.log")
        counts: dict[str, int] = {}
        for role, port in zip(self.roles, worker_ports, strict=True):
            n = counts[role] = counts.get(role, -1) + 1
            name = f"{_ROLE_PREFIX[role]}{n}"
            self.children[name] = Child(name, "worker", [], f"http://127.0.0.1:{port}",
                                        "/health", logs / f"{name}.log")
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
            child.argv = [sys.executable, "-m", "api.cli", "worker", *common,
                          "--worker-id", child.name, "--nats-url", self.nats_url,
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
            stderr=subprocess.DEVNULL, start_new_session=True,
            preexec_fn=functools.partial(_die_with_parent, self._prctl, os.getpid()))

    async def _spawn(self, child: Child) -> None:
        with child.log_path.open("ab") as logf:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            logf.write(f"\n=== {stamp} jetrouter up: starting {child.name} ===\n".encode())
            logf.flush()
            child.proc = await asyncio.create_subprocess_exec(
                *child.argv, stdin=asyncio.subprocess.DEVNULL, stdout=logf,
                stderr=asyncio.subprocess.STDOUT, cwd=str(REPO_ROOT),
                env={**_child_env(), **self.child_nats_options(child.name).child_env()},
                # Own process group: Ctrl-C reaches only `up`, which stops children in order.
                start_new_session=True,
                preexec_fn=functools.partial(_die_with_parent, self._prctl, os.getpid()))
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
            if uptime >= STABLE_AFTER:
                backoff = BACKOFF_MIN
            if not self.restart:
                log.warning("%s (pid %d) exited with %s; not restarting (--no-restart)",
                            child.name, child.proc.pid, rc)
                self._write_cluster_json()
                return
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

    def _move_if_port_taken(self, child: Child) -> None:
        """A child on a port `up` picked (no --base-port) whose port another process took while
        it was down comes back on a fresh port: restarting it on the taken one would fail every
        time. cluster.json and the child's own announcement carry the new URL."""
        port = int(child.url.rsplit(":", 1)[1])
        if self.base_port is not None or not port_in_use(port):
            return
        fresh = nats_server.free_port()
        log.warning("%s: port %d is taken by another process; restarting it on port %d",
                    child.name, port, fresh)
        child.url = f"http://127.0.0.1:{fresh}"
        self._finish_argv(child)

    async def _probe(self, client: httpx.AsyncClient, child: Child) -> bool:
        if not child.running:
            return False
        try:
            resp = await client.get(child.url + child.probe_path)
        except httpx.HTTPError:
            return False
        return resp.status_code == 200

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
            parts.append(f"{name} at {c.url}: {state}; log {c.log_path}:\n{_log_tail(c.log_path)}")
        return "cluster not ready: " + "\n".join(parts)

    def describe(self) -> dict[str, Any]:
        def entry(c: Child) -> dict[str, Any]:
            return {"id": c.name, "url": c.url, "pid": c.pid if c.running else None}

        kids = self.children.values()
        secured = {"nats_secure": self.secure_setup.describe()} if self.secure_setup else {}
        return {
            **secured,
            "nats_url": self.nats_url,
            "namespace": self.namespace,
            "admin_token": self.admin_token,
            "state": "stopped" if self._closed else "running",
            "replicas": [entry(c) for c in kids if c.kind == "replica"],
            "workers": [entry(c) for c in kids if c.kind == "worker"],
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


# -- the `jetrouter up` verb -----------------------------------------------------------------


UP = Group(
    "cluster",
    Option("replicas", int, 2, "router replicas", at_least=1),
    Option("workers", int, help="simulated workers (default 4, or 0 with --prefill-workers/"
                                "--decode-workers; 0: real engines only, via bridges)",
           at_least=0),
    Option("prefill-workers", int, 0,
           "disaggregated serving: simulated prefill engines p0.. (--role prefill)", at_least=0),
    Option("decode-workers", int, 0,
           "disaggregated serving: simulated decode engines d0.. (--role decode)", at_least=0),
    Option("base-port", int, 8000, "first replica port; 0 = free ports", at_least=0),
    Option("data-dir", Path, Path(".jetrouter"),
           "logs, nats store, replica data, cluster.json"),
    Option("nats-url", help="use this NATS (JetStream enabled) instead of an embedded "
                            "nats-server"),
    Option("nats-cluster", int, 1, "embedded nats-server cluster size (1 or 3)", at_least=1),
    NAMESPACE,
    Option("no-restart", bool, help="do not restart a replica or worker that dies"),
    Option("admin-token", help="admin bearer token (default: a fresh random one)"),
    Option("ready-timeout", float, 60.0, "seconds to wait for every child to be ready",
           above=0),
    Option("secure", bool, help="secure the embedded nats-server: TLS with a generated CA, one "
                                "user per replica/engine with only the subjects its role needs, "
                                "an admin user; files under <data-dir>/secure/"),
)

# `serve` / `worker` options `up` takes itself and hands to the children that have them; left
# out, each child keeps its own default. Forwarding another one is one more name here.
FORWARDED = ("router-mode", "kv-cache-block-size", "num-gpu-blocks", "speedup-ratio",
             "model",  # the engines' served model name (also --served-model-name)
             "otlp-traces-endpoint", "api-keys-file", "tenant-header", "router-queue-threshold",
             "no-tenant-fair-queue")


def _names(groups: tuple[Group, ...]) -> set[str]:
    return {o.name for o in options_of(groups)}


def _forwarded_option(name: str) -> Option:
    to = [who for who, groups in (("replicas", SERVE), ("workers", WORKER))
          if name in _names(groups)]
    if not to:
        raise KeyError(f"{name}: neither a `serve` nor a `worker` option")
    source = find(SERVE, name) if "replicas" in to else find(WORKER, name)
    return unset(source, help=f"{' and '.join(to)}: {source.help}")


CHILDREN = Group(
    "forwarded to the children",
    *(_forwarded_option(name) for name in FORWARDED),
    Option("router-arg", repeat=True, metavar="ARG",
           help="extra raw argument for every replica (repeatable)"),
    Option("worker-arg", repeat=True, metavar="ARG",
           help="extra raw argument for every worker (repeatable)"),
    Option("model-path", help="replicas and workers: one HuggingFace model folder "
                              "(tokenizer.json, tokenizer_config.json) so both tokenize alike "
                              "(default: byte tokens)"),
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = (
        "Ports: replicas listen on BASE..BASE+N-1, workers on BASE+100..; --base-port 0 picks\n"
        "free ports. <data-dir>/cluster.json lists URLs, pids and the admin token (also in\n"
        "<data-dir>/admin-token); logs go to <data-dir>/logs/<name>.log. Other flags reach the\n"
        "children with --router-arg=--flag=value / --worker-arg=--flag=value (repeatable).\n"
        "Every flag can also be set as JETROUTER_<FLAG>, e.g. JETROUTER_REPLICAS=3.")
    # NATS security: credentials/TLS of an existing NATS (--nats-url), for every child.
    add_options(p, (UP, NATS_SECURITY, CHILDREN))


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


TO_REPLICAS = [o for o in CHILDREN.options if o.name in FORWARDED and o.name in _names(SERVE)]
TO_WORKERS = [o for o in CHILDREN.options if o.name in FORWARDED and o.name in _names(WORKER)]


def forwarded_args(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """(router_args, worker_args) from the forwarding flags; unset flags are left to the child."""
    return (forward_argv(args, TO_REPLICAS) + list(args.router_arg),
            forward_argv(args, TO_WORKERS) + list(args.worker_arg))


def served_model(worker_args: Sequence[str]) -> str:
    """The model name the workers serve: the last --model / --served-model-name among their
    arguments (how --served-model-name and --worker-arg=--model=... both reach them)."""
    name = DEFAULT_MODEL
    args = list(worker_args)
    for i, arg in enumerate(args):
        for flag in ("--model", "--served-model-name"):
            if arg == flag and i + 1 < len(args):
                name = args[i + 1]
            elif arg.startswith(flag + "="):
                name = arg.split("=", 1)[1]
    return name


def _plain_workers(args: argparse.Namespace) -> int:
    if args.workers is not None:
        return int(args.workers)
    return 0 if args.prefill_workers or args.decode_workers else 4


def banner(cluster: LocalCluster) -> str:
    url = cluster.router_urls[0]
    model = served_model(cluster.worker_args)
    token = cluster.admin_token_path
    lines = [
        "jetrouter cluster is up",
        f"  routers : {' '.join(cluster.router_urls)}",
        f"  workers : {' '.join(cluster.worker_urls)}",
        f"  model   : {model}",
        *([f"  roles   : disaggregated serving, "
           f"{', '.join(f'{n} {r}' for n, r in sorted(cluster._roles.items()))}"]
          if cluster._roles else []),
        f"  nats    : {cluster.nats_url}  (namespace {cluster.namespace})",
        *([f"  secured : TLS CA {cluster.secure_setup.ca_file}; users' password files in "
           f"{cluster.secure_setup.directory / 'users'} (admin: admin.password); server "
           f"config {cluster.secure_setup.config_file}"] if cluster.secure_setup else []),
        f"  admin   : token in {token} (and {cluster.cluster_json_path})",
        f"  logs    : {cluster.data_dir / 'logs'}",
        "try:",
        f"  curl -s {url}/v1/completions -H 'content-type: application/json' \\",
        f"    -d '{{\"model\": \"{model}\", \"prompt\": \"Hello\", \"max_tokens\": 16}}'",
        f"  curl -s -H \"Authorization: Bearer $(cat {token})\" {url}/admin/state",
        f"  OPENAI_BASE_URL={url}/v1 OPENAI_API_KEY=unused python -c \"import openai; "
        f"print(openai.OpenAI().completions.create(model='{model}', prompt='Hi', "
        "max_tokens=8).choices[0].text)\"",
        "Ctrl-C stops everything.",
    ]
    return "\n".join(lines)


async def _serve_until_signalled(cluster: LocalCluster) -> None:
    """Start the cluster, print the banner, run until SIGINT/SIGTERM (even mid start-up)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    starting = asyncio.create_task(cluster.start())
    stopping = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if starting.done():
            starting.result()  # start-up errors propagate
            print(banner(cluster), flush=True)
            await stopping
        log.info("stopping")
    finally:
        for task in (starting, stopping):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await cluster.stop()
        log.info("stopped")
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def run(args: argparse.Namespace) -> int:
    from api.cli import CliError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s up: %(message)s",
                        datefmt="%H:%M:%S")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # no line per readiness poll
    if args.api_keys_file:  # the replicas run in the repository root: give them the full path
        from api.tenancy import KeysFileInvalid, load_keys

        args.api_keys_file = str(Path(args.api_keys_file).resolve())
        try:
            load_keys(args.api_keys_file)
        except KeysFileInvalid as exc:
            raise CliError(str(exc)) from None
    router_args, worker_args = forwarded_args(args)
    check_model_path(args.model_path)
    if args.secure and args.nats_url:
        raise CliError("--secure sets up the embedded nats-server; for an existing NATS give "
                       "its credentials with the --nats-* flags instead")
    try:
        nats_options = options_from_args(args, url="")
    except ValueError as exc:
        raise CliError(str(exc)) from None
    try:
        cluster = _cluster_from_args(args, router_args, worker_args, nats_options)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    try:
        asyncio.run(_serve_until_signalled(cluster))
    except nats_server.NatsServerNotFound as exc:
        raise CliError(str(exc)) from None
    except CertificateNotMade as exc:
        raise CliError(f"--secure: {exc}") from None
    except ClusterStartError as exc:
        print(f"jetrouter up: error: {exc}", file=sys.stderr)
        return 1
    return 0


def _cluster_from_args(args: argparse.Namespace, router_args: list[str], worker_args: list[str],
                       nats_options: NatsOptions) -> LocalCluster:
    return LocalCluster(
        replicas=args.replicas, workers=_plain_workers(args),
        prefill_workers=args.prefill_workers, decode_workers=args.decode_workers,
        base_port=args.base_port or None,
        data_dir=args.data_dir, router_args=router_args, worker_args=worker_args,
        nats_url=args.nats_url, restart=not args.no_restart, namespace=args.namespace,
        nats_cluster=args.nats_cluster, admin_token=args.admin_token,
        ready_timeout=args.ready_timeout, model_path=args.model_path, secure=args.secure,
        nats_options=nats_options)
