"""A local cluster in front of real vLLM engines: NATS, N engines, one bridge per engine, and
router replicas (the demo and the opt-in real-vLLM tests share it).

Start order: nats-server; every engine at once (each takes 25-45 s to load and compile, so they
start concurrently and a progress line shows what each is doing); one `jetrouter bridge` per engine
(registers it as a worker and carries its ZMQ KV events into ``JR_KV``); then the router replicas
(`launch.local_cluster.LocalCluster` with no simulated workers, on the same NATS). Replicas can be
stopped and started again in another router mode while engines and bridges keep running, which is
what lets the demo compare modes without paying for engine start-up twice.

Every child runs in its own process group with SIGTERM-on-parent-death, and `stop` takes them
down in reverse order, so Ctrl-C or a failing test leaves nothing behind.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import httpx

from errors.root import JetrouterError
from launch.local_cluster import LocalCluster
from natsops.server import NatsServer
from workers.vllm.engine import DEFAULT_BLOCK_SIZE, VllmEngine
from workers.vllm.env import REPO_ROOT, child_preexec

# A cold start is ~40 s alone; two at once on a 2-core host shared with other work took 5-10 min.
ENGINE_READY_TIMEOUT = 900.0


def router_model_args(model_dir: Path) -> list[str]:
    """Replicas tokenize text and chat prompts with the engines' own tokenizer folder."""
    from api.serve import add_arguments as serve_arguments

    probe = argparse.ArgumentParser(add_help=False)
    serve_arguments(probe)
    if any("--model-path" in a.option_strings for a in probe._actions):
        return ["--model-path", str(model_dir)]
    return ["--tokenizer", str(model_dir / "tokenizer.json")]


class EngineStartError(JetrouterError, RuntimeError):
    """An engine (or a bridge) did not come up; the message carries its log tail."""


@dataclass
class BridgeProcess:
    """`jetrouter bridge` for one engine, as a child process (restartable)."""

    name: str
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        if self.running:
            return
        env = dict(os.environ)
        env["PYTHONUNBUFFERED"] = "1"
        paths = [str(REPO_ROOT), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            log.write(f"\n=== {time.strftime('%H:%M:%S')} starting {self.name}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, env=env, cwd=str(REPO_ROOT),
                                         start_new_session=True, preexec_fn=child_preexec())

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                self.proc.send_signal(sig)

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is None:
            return
        self.kill(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill(signal.SIGKILL)
            self.proc.wait(10)

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


class VllmCluster:
    def __init__(
        self,
        *,
        python: Path,
        model_dir: Path,
        data_dir: Path,
        engines: int = 2,
        replicas: int = 2,
        block_size: int = DEFAULT_BLOCK_SIZE,
        num_gpu_blocks: int | None = None,
        max_model_len: int = 2048,
        namespace: str = "jr",
        cache_root: Path | None = None,
        router_args: Sequence[str] = (),
        bridge_args: Sequence[str] = (),
        progress: TextIO | None = sys.stderr,
        roles: Sequence[str] = (),
        nixl: bool = False,
        engine_bridge_args: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        """``roles``: each engine's disaggregated-serving role in order (bridge ``--role``;
        default "both"); ``nixl``: start every engine with NixlConnector, for the KV hand-off
        between a prefill and a decode engine; ``engine_bridge_args``: more bridge arguments
        for the engine of that name ("e0", ...), after ``bridge_args`` (e.g. an
        ``--advertise-url`` that puts a proxy between the routers and one engine)."""
        self.python = python
        self.model_dir = model_dir
        self.data_dir = data_dir.resolve()
        self.block_size = block_size
        self.namespace = namespace
        self.replica_count = replicas
        self.router_args = list(router_args)
        self.bridge_args = list(bridge_args)
        self.engine_bridge_args = {k: list(v) for k, v in (engine_bridge_args or {}).items()}
        self.progress = progress
        logs = self.data_dir / "logs"
        self.engines = [
            VllmEngine(name=f"e{i}", python=python, model_dir=model_dir,
                       log_path=logs / f"e{i}.log", cache_root=cache_root,
                       block_size=block_size, num_gpu_blocks=num_gpu_blocks,
                       max_model_len=max_model_len, cpu_bind=str(i % (os.cpu_count() or 1)),
                       nixl=nixl)
            for i in range(engines)]
        self.roles = {e.name: (roles[i] if i < len(roles) else "both")
                      for i, e in enumerate(self.engines)}
        self.nats: NatsServer | None = None
        self.bridges: dict[str, BridgeProcess] = {}
        self.routers: LocalCluster | None = None
        self.admin_token = "vllm-demo-" + os.urandom(8).hex()

    # -- views --------------------------------------------------------------------------------

    @property
    def nats_url(self) -> str:
        assert self.nats is not None
        return self.nats.url

    @property
    def router_urls(self) -> list[str]:
        return self.routers.router_urls if self.routers is not None else []

    def worker_id(self, engine: VllmEngine) -> str:
        return f"vllm-{engine.name}"

    def engine(self, worker_id: str) -> VllmEngine:
        return next(e for e in self.engines if self.worker_id(e) == worker_id)

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self, router_mode: str = "kv") -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.nats = NatsServer(store_dir=self.data_dir / "nats")
        self.nats.launch()
        await asyncio.to_thread(self.nats.wait_ready)
        await self.start_engines()
        for engine in self.engines:
            self.start_bridge(engine)
        await self.start_routers(router_mode)
        await self.wait_workers(len(self.engines))

    async def start_engines(self, engines: Sequence[VllmEngine] | None = None,
                            timeout: float = ENGINE_READY_TIMEOUT) -> None:
        """Start engines concurrently (from this thread: the parent-death signal belongs to the
        thread that forks) and wait until each answers, drawing a progress line meanwhile."""
        engines = list(engines or self.engines)
        for engine in engines:
            engine.start()
        t0 = time.monotonic()
        ready: dict[str, float] = {}
        last_draw = 0.0
        async with httpx.AsyncClient(timeout=2.0) as client:
            while len(ready) < len(engines):
                for engine in engines:
                    if engine.name in ready:
                        continue
                    if not engine.running:
                        code = engine.proc.returncode if engine.proc else None
                        raise EngineStartError(
                            f"vLLM engine {engine.name} exited with {code}; "
                            f"log {engine.log_path}:\n{engine.log_tail()}")
                    try:
                        resp = await client.get(engine.url + "/v1/models")
                        if resp.status_code == 200:
                            ready[engine.name] = time.monotonic() - t0
                    except httpx.HTTPError:
                        pass
                now = time.monotonic()
                if now - t0 > timeout:
                    slow = [e for e in engines if e.name not in ready]
                    raise EngineStartError("vLLM engine(s) not ready after "
                                           f"{timeout:.0f} s: " + "; ".join(
                                               f"{e.name} log {e.log_path}:\n{e.log_tail()}"
                                               for e in slow))
                if now - last_draw >= 1.0 or len(ready) == len(engines):
                    last_draw = now
                    self._draw_progress(engines, ready, now - t0)
                await asyncio.sleep(0.5)  # polling engines that take tens of seconds to load
        if self.progress is not None:
            self.progress.write("\n")
            self.progress.flush()

    def _draw_progress(self, engines: Sequence[VllmEngine], ready: dict[str, float],
                       elapsed: float) -> None:
        if self.progress is None:
            return
        parts = []
        for e in engines:
            if e.name in ready:
                parts.append(f"{e.name} ready in {ready[e.name]:.0f} s")
            else:
                parts.append(f"{e.name} starting ({e.last_log_line(40)})")
        line = f"[vllm {elapsed:5.0f} s] " + " | ".join(parts)
        tty = getattr(self.progress, "isatty", lambda: False)()
        if tty:
            self.progress.write("\r" + line[:200].ljust(200))
        elif int(elapsed) % 5 == 0 or len(ready) == len(engines):
            self.progress.write(line + "\n")
        self.progress.flush()

    def bridge_argv(self, engine: VllmEngine) -> list[str]:
        return [sys.executable, "-m", "api.cli", "bridge",
                "--engine-url", engine.url, "--kv-events", engine.kv_events,
                "--kv-replay", engine.kv_replay, "--worker-id", self.worker_id(engine),
                "--nats-url", self.nats_url, "--namespace", self.namespace,
                "--block-size", str(self.block_size), "--role", self.roles[engine.name],
                *self.bridge_args, *self.engine_bridge_args.get(engine.name, ())]

    def start_bridge(self, engine: VllmEngine) -> BridgeProcess:
        name = f"bridge-{engine.name}"
        bridge = self.bridges.get(name)
        if bridge is None:
            bridge = BridgeProcess(name, self.bridge_argv(engine),
                                   self.data_dir / "logs" / f"{name}.log")
            self.bridges[name] = bridge
        bridge.start()
        return bridge

    def bridge(self, engine: VllmEngine) -> BridgeProcess:
        return self.bridges[f"bridge-{engine.name}"]

    async def start_routers(self, router_mode: str = "kv", *, tag: str = "") -> None:
        """Router replicas in ``router_mode`` (fresh data dirs); engines and bridges untouched."""
        if self.routers is not None:
            await self.stop_routers()
        args = ["--router-mode", router_mode, "--kv-cache-block-size", str(self.block_size),
                *self.router_args]
        self.routers = LocalCluster(
            replicas=self.replica_count, workers=0, base_port=None,
            data_dir=self.data_dir / f"routers-{router_mode}{tag}", router_args=args,
            nats_url=self.nats_url, namespace=self.namespace, admin_token=self.admin_token,
            ready_timeout=120.0)
        try:
            await self.routers.start()
        except BaseException:
            await self.routers.stop()
            self.routers = None
            raise

    async def stop_routers(self) -> None:
        if self.routers is not None:
            await self.routers.stop()
            self.routers = None

    async def stop(self) -> None:
        await self.stop_routers()
        for bridge in self.bridges.values():
            await asyncio.to_thread(bridge.stop)
        await asyncio.gather(*(asyncio.to_thread(e.stop) for e in self.engines))
        if self.nats is not None:
            await asyncio.to_thread(self.nats.stop)

    async def __aenter__(self) -> VllmCluster:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- admin helpers -------------------------------------------------------------------------

    def admin_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_token}"}

    async def admin_get(self, path: str, replica: int = 0) -> Any:
        async with httpx.AsyncClient(timeout=10.0) as client:
            resp = await client.get(self.router_urls[replica] + path,
                                    headers=self.admin_headers())
            resp.raise_for_status()
            return resp.json()

    async def workers(self, replica: int = 0) -> list[dict[str, Any]]:
        return list((await self.admin_get("/admin/workers", replica))["workers"])

    async def wait_workers(self, count: int, timeout: float = 60.0,
                           predicate: Callable[[dict[str, Any]], bool] | None = None) -> None:
        """Every replica lists ``count`` workers (matching ``predicate``) — the bridges'
        registrations went through JetStream to each replica."""
        deadline = time.monotonic() + timeout
        while True:
            counts = []
            for i in range(len(self.router_urls)):
                try:
                    ws = await self.workers(i)
                except httpx.HTTPError:
                    ws = []
                counts.append(sum(1 for w in ws if predicate is None or predicate(w)))
            if all(c == count for c in counts):
                return
            if time.monotonic() > deadline:
                tails = "\n".join(f"{b.name}:\n{b.log_tail(10)}" for b in self.bridges.values())
                raise EngineStartError(f"replicas list {counts} workers, want {count}; "
                                       f"bridge logs:\n{tails}")
            await asyncio.sleep(0.2)  # polling a condition with a deadline

    async def reset_prefix_caches(self, model: str,
                                  engines: Sequence[VllmEngine] | None = None,
                                  timeout: float = 120.0) -> None:
        """Empty every engine's prefix cache (vLLM dev-mode endpoint). vLLM queues
        ``AllBlocksCleared`` for it but publishes KV events only after an engine step, so a
        prompt shorter than one block (it caches nothing) follows to flush the event out; the
        bridges then carry it to the routers. vLLM refuses the reset (``success: false``)
        while a request holds blocks (a router's canary, say), so it is asked again until it
        succeeds."""
        async with httpx.AsyncClient(timeout=60.0) as client:
            for engine in engines or self.engines:
                deadline = time.monotonic() + timeout
                while True:
                    resp = await client.post(engine.url + "/reset_prefix_cache")
                    resp.raise_for_status()
                    if resp.json().get("success", True) is not False:
                        break
                    if time.monotonic() > deadline:
                        raise EngineStartError(f"engine {engine.name} did not empty its prefix "
                                               f"cache in {timeout:.0f} s (blocks still held)")
                    await asyncio.sleep(0.2)  # until the request holding blocks ends
                resp = await client.post(engine.url + "/v1/completions", json={
                    "model": model, "prompt": [5, 6, 7], "max_tokens": 1})
                resp.raise_for_status()
