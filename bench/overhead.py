"""`jetrouter bench overhead`: what one router replica adds in front of an engine.

One run starts a local cluster of one replica and one fast simulated worker
(`launch.local_cluster.LocalCluster`, ``--speedup-ratio`` high so the engine itself costs almost
nothing) and measures, side by side:

* **TTFT** of streaming ``/v1/completions`` sent through the replica and straight to the worker,
  at each ``--concurrency`` level (closed loop: every connection sends its next request as soon as
  the previous one ends). The two targets are measured in alternating rounds so drift (other
  processes, caches warming) hits both alike. Overhead = router p50 - direct p50 (and p99).
* **Routing throughput**: non-streaming requests with ``max_tokens=1`` for ``--duration`` seconds
  through the replica, and straight to the worker (the ceiling the machine allows, since the
  worker and the load generator share its cores).
* **CPU per request**: CPU seconds (user + system, from ``/proc``) each process spent in a phase,
  divided by the requests the phase completed — the replica process and its children (the SQL
  projector) separately, so a child that costs more than the router at low load shows. An idle
  phase first records what each process burns with no traffic at all (timers, polling).

The load generator is a minimal HTTP/1.1 keep-alive client on raw asyncio streams (uvloop when
installed): a request costs it a few tens of microseconds, where httpx costs several hundred. CPU
seconds of every process (replica, worker, nats-server, this one) are read from ``/proc`` for each
phase, so the report says what the bottleneck was rather than guessing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from errors.root import JetrouterError
from launch.children import children_of
from leanhttp.loop import run as run_loop

DEFAULT_CONCURRENCY = (1, 16, 64)
IDLE_SECONDS = 3.0
_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


# -- a cheap HTTP/1.1 client ----------------------------------------------------------------------


class UnexpectedStatus(JetrouterError):
    pass


class RawConnection:
    """One keep-alive HTTP/1.1 connection; requests on it are sequential."""

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self.reader is None or self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        return self.reader, self.writer

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None

    async def post(self, path: str, body: bytes, *, first_chunk: bool = False
                   ) -> tuple[int, bytes, float | None]:
        """POST ``body``; (status, response body, seconds to the first body bytes that carry
        data) — the last only with ``first_chunk`` (TTFT of an SSE stream)."""
        reader, writer = await self._connect()
        started = time.perf_counter()
        writer.write(b"POST %s HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (path.encode(), self.host.encode(),
                                                        len(body), body))
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            self.close()
            raise UnexpectedStatus(f"connection closed before the response: {exc}") from None
        lines = head.split(b"\r\n")
        status = int(lines[0].split(b" ", 2)[1])
        length: int | None = None
        chunked = False
        keep_alive = True
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"transfer-encoding" and b"chunked" in value.lower():
                chunked = True
            elif name == b"connection" and b"close" in value.lower():
                keep_alive = False
        first: float | None = None
        if chunked:
            parts = []
            while True:
                size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                data = await reader.readexactly(size + 2)
                if size == 0:
                    break
                if first is None and first_chunk and b"data:" in data:
                    first = time.perf_counter() - started
                parts.append(data[:-2])
            payload = b"".join(parts)
        elif length is not None:
            payload = await reader.readexactly(length)
            if first_chunk:
                first = time.perf_counter() - started
        else:  # read to close
            payload = await reader.read()
            keep_alive = False
        if not keep_alive:
            self.close()
        return status, payload, first


def split_url(url: str) -> tuple[str, int]:
    rest = url.split("://", 1)[-1].rstrip("/")
    host, _, port = rest.partition(":")
    return host, int(port or 80)


# -- measurements ---------------------------------------------------------------------------------


def proc_cpu_seconds(pid: int) -> float | None:
    """user + system CPU seconds of a process (Linux /proc), None if unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _CLK_TCK
    except (OSError, IndexError, ValueError):
        return None


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


class CpuMeter:
    """CPU seconds per named process across one phase."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self._start: dict[str, float] = {}
        self._t0 = 0.0
        self.wall = 0.0

    def start(self) -> None:
        self._t0 = time.perf_counter()
        self._start = {n: s for n, p in self.pids.items()
                       if (s := proc_cpu_seconds(p)) is not None}

    def stop(self) -> dict[str, float]:
        """CPU seconds used per process over the phase (``wall`` holds the phase's length)."""
        self.wall = max(time.perf_counter() - self._t0, 1e-9)
        out = {}
        for name, before in self._start.items():
            after = proc_cpu_seconds(self.pids[name])
            if after is not None:
                out[name] = after - before
        return out


@dataclass(slots=True)
class PhaseResult:
    target: str                          # "router" | "direct"
    concurrency: int
    ok: int = 0
    errors: int = 0
    seconds: float = 0.0
    ttft: list[float] = field(default_factory=list)
    latency: list[float] = field(default_factory=list)
    cpu_seconds: dict[str, float] = field(default_factory=dict)  # per process, summed over rounds

    def add_cpu(self, used: dict[str, float]) -> None:
        for proc, seconds in used.items():
            self.cpu_seconds[proc] = self.cpu_seconds.get(proc, 0.0) + seconds

    def cpu_report(self) -> dict[str, dict[str, float]]:
        """Cores busy (1.0 = one core all the time) and CPU milliseconds per completed request."""
        return {"cores": {p: round(c / max(self.seconds, 1e-9), 2)
                          for p, c in self.cpu_seconds.items()},
                "ms_per_request": {p: round(1000 * c / max(self.ok, 1), 3)
                                   for p, c in self.cpu_seconds.items()}}

    @property
    def rate(self) -> float:
        return self.ok / self.seconds if self.seconds > 0 else 0.0


def percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


async def closed_loop(url: str, path: str, body: Callable[[int], bytes], concurrency: int, *,
                      requests: int | None = None, duration: float | None = None,
                      stream: bool, result: PhaseResult) -> PhaseResult:
    """``concurrency`` connections each sending back to back until ``requests`` are done (all
    connections together) or ``duration`` seconds pass."""
    host, port = split_url(url)
    counter = [0]
    deadline = None if duration is None else time.perf_counter() + duration

    async def one_connection() -> None:
        conn = RawConnection(host, port)
        try:
            while True:
                if requests is not None and counter[0] >= requests:
                    return
                if deadline is not None and time.perf_counter() >= deadline:
                    return
                n = counter[0]
                counter[0] += 1
                t0 = time.perf_counter()
                try:
                    status, _, first = await conn.post(path, body(n), first_chunk=stream)
                except (UnexpectedStatus, OSError, asyncio.IncompleteReadError):
                    result.errors += 1
                    conn.close()
                    continue
                if status != 200:
                    result.errors += 1
                    continue
                result.ok += 1
                result.latency.append(time.perf_counter() - t0)
                if first is not None:
                    result.ttft.append(first)
        finally:
            conn.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(one_connection() for _ in range(concurrency)))
    result.seconds += time.perf_counter() - t0
    return result


def prompt_body(model: str, prompt_chars: int, max_tokens: int, stream: bool,
                sessions: int = 0, prefix_chars: int | None = None, prefixes: int = 1
                ) -> Callable[[int], bytes]:
    """Distinct text prompts (the byte tokenizer: one token per byte) so every request hashes
    and matches a fresh prompt, sharing a prefix like requests of one deployment do: the first
    ``prefix_chars`` (default half the prompt) are one of ``prefixes`` shared prefixes (request
    n takes prefix ``n % prefixes``), the rest is the request's own. With ``sessions`` > 0
    request n is a turn of sticky session ``n % sessions`` (an engine without that session
    open ignores ``nvext``, so the direct target is unchanged)."""
    shared_chars = prompt_chars // 2 if prefix_chars is None else prefix_chars
    base = "You are a helpful assistant. " * (shared_chars // 29 + 1)
    shared = [(f"{k}: " + base if k else base)[:shared_chars] for k in range(prefixes)]

    def body(n: int) -> bytes:
        head = shared[n % prefixes]
        tail = (f" request {n}: " + "lorem ipsum " * prompt_chars)[: prompt_chars - len(head)]
        doc: dict[str, Any] = {"model": model, "prompt": head + tail,
                               "max_tokens": max_tokens, "stream": stream, "temperature": 0}
        if sessions:
            doc["nvext"] = {"session_control": {"session_id": f"bench-{n % sessions}",
                                                "action": "bind"}}
        return json.dumps(doc).encode()

    return body


# -- the run --------------------------------------------------------------------------------------


@dataclass(slots=True)
class OverheadOptions:
    concurrency: Sequence[int] = DEFAULT_CONCURRENCY
    ttft_requests: int = 2000            # per target and concurrency level
    rounds: int = 4                      # alternations router/direct per level
    duration: float = 10.0               # seconds per throughput target
    throughput_concurrency: int = 64
    prompt_chars: int = 512
    prefix_chars: int | None = None      # shared part of each prompt (None: half of it)
    prefixes: int = 1                    # distinct shared prefixes, taken in turn
    max_tokens: int = 8                  # TTFT requests (streamed)
    worker_speedup_ratio: float = 1000.0
    router_args: Sequence[str] = ()
    worker_args: Sequence[str] = ()
    warmup: int = 200
    sessions: int = 0                    # >0: TTFT requests are turns of this many sessions
    idle_seconds: float = IDLE_SECONDS    # CPU with no traffic, measured once before the load


async def _wait_for_model(url: str, timeout: float = 30.0) -> str:
    host, port = split_url(url)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(b"GET /v1/models HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            raw = await reader.read()
            writer.close()
            data = json.loads(raw.split(b"\r\n\r\n", 1)[1] or b"{}").get("data") or []
            if data:
                return str(data[0]["id"])
        except (OSError, ValueError, IndexError):
            pass
        await asyncio.sleep(0.1)  # polling a condition with a deadline
    raise RuntimeError(f"no model registered at {url} within {timeout}s")


async def measure(router_url: str, worker_url: str, pids: dict[str, int],
                  opts: OverheadOptions, log: Callable[[str], None] = lambda _: None
                  ) -> dict[str, Any]:
    """Both measurements against running servers; the report as a dict."""
    model = await _wait_for_model(router_url)
    targets = {"router": router_url, "direct": worker_url}
    shape = {"prefix_chars": opts.prefix_chars, "prefixes": opts.prefixes}
    stream_body = prompt_body(model, opts.prompt_chars, opts.max_tokens, stream=True,
                              sessions=opts.sessions, **shape)
    one_token = prompt_body(model, opts.prompt_chars, 1, stream=False, **shape)
    path = "/v1/completions"
    offset = [0]

    def fresh(body: Callable[[int], bytes]) -> Callable[[int], bytes]:
        base = offset[0]
        offset[0] += 1_000_000
        return lambda n: body(base + n)

    for name, url in targets.items():  # warm both paths (connections, caches, JIT-free Python)
        await closed_loop(url, path, fresh(stream_body), 8, requests=opts.warmup, stream=True,
                          result=PhaseResult(name, 8))
    idle: dict[str, float] = {}
    if opts.idle_seconds > 0:
        log(f"idle for {opts.idle_seconds:g}s")
        meter = CpuMeter(pids)
        meter.start()
        await asyncio.sleep(opts.idle_seconds)  # measuring what no traffic costs
        idle = {p: round(c / meter.wall, 4) for p, c in meter.stop().items()}
    ttft: list[dict[str, Any]] = []
    for conc in opts.concurrency:
        res = {name: PhaseResult(name, conc) for name in targets}
        per_round = max(1, opts.ttft_requests // opts.rounds)
        for r in range(opts.rounds):
            order = list(targets) if r % 2 == 0 else list(reversed(targets))
            for name in order:
                log(f"ttft c={conc} round {r + 1}/{opts.rounds}: {name}")
                meter = CpuMeter(pids)
                meter.start()
                await closed_loop(targets[name], path, fresh(stream_body), conc,
                                  requests=per_round, stream=True, result=res[name])
                res[name].add_cpu(meter.stop())
        ttft.append(_ttft_row(conc, res["router"], res["direct"]))
    throughput: dict[str, Any] = {"concurrency": opts.throughput_concurrency,
                                  "duration_s": opts.duration}
    for name in ("direct", "router"):
        log(f"throughput: {name} for {opts.duration:.0f}s")
        meter = CpuMeter(pids)
        meter.start()
        res_ = await closed_loop(targets[name], path, fresh(one_token),
                                 opts.throughput_concurrency, duration=opts.duration,
                                 stream=False, result=PhaseResult(name,
                                                                  opts.throughput_concurrency))
        res_.add_cpu(meter.stop())
        cpu = res_.cpu_report()
        throughput[name] = {"req_per_s": round(res_.rate, 1), "ok": res_.ok,
                            "errors": res_.errors,
                            "latency_p50_ms": _ms(percentile(res_.latency, 50)),
                            "latency_p99_ms": _ms(percentile(res_.latency, 99)),
                            "cpu_cores": cpu["cores"], "cpu_ms_per_request": cpu["ms_per_request"]}
    return {"machine": machine(), "options": _describe(opts), "idle_cpu_cores": idle,
            "ttft": ttft, "throughput": throughput}


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000, 3)


def _ttft_row(conc: int, router: PhaseResult, direct: PhaseResult) -> dict[str, Any]:
    row: dict[str, Any] = {"concurrency": conc}
    for name, res in (("router", router), ("direct", direct)):
        cpu = res.cpu_report()
        row[name] = {"p50_ms": _ms(percentile(res.ttft, 50)),
                     "p99_ms": _ms(percentile(res.ttft, 99)),
                     "mean_ms": _ms(statistics.fmean(res.ttft) if res.ttft else None),
                     "ok": res.ok, "errors": res.errors, "req_per_s": round(res.rate, 1),
                     "cpu_cores": cpu["cores"], "cpu_ms_per_request": cpu["ms_per_request"]}
    for q in ("p50_ms", "p99_ms"):
        a, b = row["router"][q], row["direct"][q]
        row[f"overhead_{q}"] = None if a is None or b is None else round(a - b, 3)
    return row


def machine() -> dict[str, Any]:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpus": os.cpu_count(), "cpu_model": model, "python": platform.python_version(),
            "platform": platform.platform()}


def _describe(opts: OverheadOptions) -> dict[str, Any]:
    return {"concurrency": list(opts.concurrency), "ttft_requests": opts.ttft_requests,
            "rounds": opts.rounds, "throughput_duration_s": opts.duration,
            "throughput_concurrency": opts.throughput_concurrency,
            "prompt_chars": opts.prompt_chars, "ttft_max_tokens": opts.max_tokens,
            "prefix_chars": opts.prefix_chars if opts.prefix_chars is not None
            else opts.prompt_chars // 2, "prefixes": opts.prefixes,
            "worker_speedup_ratio": opts.worker_speedup_ratio,
            "router_args": list(opts.router_args), "worker_args": list(opts.worker_args),
            "sessions": opts.sessions, "idle_seconds": opts.idle_seconds}


async def run_overhead(opts: OverheadOptions, data_dir: Path | None = None,
                       log: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Start a 1-replica, 1-worker cluster, measure, stop it."""
    from launch.local_cluster import LocalCluster

    owned = data_dir is None
    root = data_dir or Path(tempfile.mkdtemp(prefix="jetrouter-overhead-"))
    cluster = LocalCluster(replicas=1, workers=1, base_port=None, data_dir=root,
                           router_args=list(opts.router_args), namespace="overhead",
                           worker_args=["--speedup-ratio", str(opts.worker_speedup_ratio),
                                        *opts.worker_args])
    async with cluster:
        pids = {("replica" if c.kind == "replica" else "worker" if c.kind == "worker"
                 else n): c.pid for n, c in cluster.children.items() if c.pid is not None}
        if "replica" in pids:  # its children (the SQL projector), measured on their own
            for k, child in enumerate(children_of(pids["replica"])):
                pids["projector" if b"snapshots.projector" in _cmdline(child)
                     else f"replica-child{k}"] = child
        nats_proc = getattr(cluster._nats, "proc", None)
        if nats_proc is not None:
            pids["nats"] = nats_proc.pid
        pids["loadgen"] = os.getpid()
        result = await measure(cluster.router_urls[0], cluster.worker_urls[0], pids, opts, log)
    if owned:
        shutil.rmtree(root, ignore_errors=True)
    return result


def _cpu_cells(s: dict[str, Any]) -> str:
    """CPU ms per request of the router-side processes, then the cores each process used."""
    per = s.get("cpu_ms_per_request", {})
    head = " ".join(f"{p}={per[p]:.3f}" for p in ("replica", "projector") if p in per)
    cores = " ".join(f"{k}={v}" for k, v in s["cpu_cores"].items())
    return f"{head:<34} {cores}"


def format_report(r: dict[str, Any]) -> str:
    m = r["machine"]
    lines = [f"machine: {m['cpus']} cores, {m['cpu_model']}, Python {m['python']}",
             "one replica + one simulated worker (--speedup-ratio "
             f"{r['options']['worker_speedup_ratio']:g}); load generator shares the cores"]
    if r.get("idle_cpu_cores"):
        lines.append("idle (no traffic), cores: "
                     + " ".join(f"{k}={v}" for k, v in r["idle_cpu_cores"].items()))
    lines += ["", "TTFT, streaming /v1/completions "
              f"({r['options']['prompt_chars']}-token prompts"
              + (f", the first {r['options']['prefix_chars']} one of "
                 f"{r['options']['prefixes']} shared prefixes"
                 if "prefixes" in r["options"] else "") + ", closed loop"
              + (f", turns of {r['options']['sessions']} sticky sessions"
                 if r["options"].get("sessions") else "") + ")",
              f"{'conc':>5} {'target':<7} {'p50 ms':>8} {'p99 ms':>8} {'req/s':>8}  "
              f"{'cpu ms/request':<34} cpu cores"]
    for row in r["ttft"]:
        for name in ("direct", "router"):
            s = row[name]
            lines.append(f"{row['concurrency']:>5} {name:<7} {s['p50_ms']:>8.3f} "
                         f"{s['p99_ms']:>8.3f} {s['req_per_s']:>8.1f}  {_cpu_cells(s)}")
        lines.append(f"{row['concurrency']:>5} {'added':<7} {row['overhead_p50_ms']:>8.3f} "
                     f"{row['overhead_p99_ms']:>8.3f}")
    t = r["throughput"]
    lines += ["", f"throughput, non-streaming, max_tokens=1, concurrency {t['concurrency']}, "
                  f"{t['duration_s']:g}s each",
              f"{'target':<7} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'errors':>6}  "
              f"{'cpu ms/request':<34} cpu cores"]
    for name in ("direct", "router"):
        s = t[name]
        lines.append(f"{name:<7} {s['req_per_s']:>8.1f} {s['latency_p50_ms'] or 0:>8.3f} "
                     f"{s['latency_p99_ms'] or 0:>8.3f} {s['errors']:>6}  {_cpu_cells(s)}")
    return "\n".join(lines)


# -- command line ---------------------------------------------------------------------------------


_D = OverheadOptions()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print only the JSON report")
    p.add_argument("--concurrency", default=",".join(map(str, DEFAULT_CONCURRENCY)),
                   help="TTFT concurrency levels, comma-separated (default 1,16,64)")
    p.add_argument("--ttft-requests", type=int, default=_D.ttft_requests,
                   help="TTFT requests per target and level (default %(default)s)")
    p.add_argument("--rounds", type=int, default=_D.rounds,
                   help="router/direct alternations per level (default %(default)s)")
    p.add_argument("--duration", type=float, default=_D.duration,
                   help="seconds of throughput load per target (default %(default)s)")
    p.add_argument("--throughput-concurrency", type=int,
                   default=_D.throughput_concurrency,
                   help="connections for the throughput phase (default %(default)s)")
    p.add_argument("--prompt-chars", type=int, default=_D.prompt_chars,
                   help="prompt length in bytes = tokens (default %(default)s)")
    p.add_argument("--prefix-chars", type=int, default=None,
                   help="shared part of each prompt, in bytes = tokens (default: half of it)")
    p.add_argument("--prefixes", type=int, default=_D.prefixes,
                   help="distinct shared prefixes, taken in turn (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=_D.max_tokens,
                   help="output tokens of TTFT requests (default %(default)s)")
    p.add_argument("--worker-speedup-ratio", type=float,
                   default=_D.worker_speedup_ratio,
                   help="the worker's --speedup-ratio (default %(default)s)")
    p.add_argument("--router-arg", action="append", default=[], metavar="ARG",
                   help="extra raw argument for the replica (repeatable)")
    p.add_argument("--worker-arg", action="append", default=[], metavar="ARG",
                   help="extra raw argument for the worker (repeatable)")
    p.add_argument("--sessions", type=int, default=0,
                   help="TTFT requests are turns of this many sticky sessions "
                        "(nvext.session_control): the cost of a pin and its catch-up read")
    p.add_argument("--data-dir", type=Path, default=None,
                   help="cluster data/logs here (default: a temporary dir)")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON report here")


def options_from_args(args: argparse.Namespace) -> OverheadOptions:
    try:
        levels = tuple(int(x) for x in str(args.concurrency).split(",") if x.strip())
    except ValueError:
        levels = ()
    if not levels or min(levels) < 1 or args.ttft_requests < 1 or args.rounds < 1 \
            or args.duration <= 0 or args.throughput_concurrency < 1 or args.sessions < 0:
        raise ValueError("concurrency levels, --ttft-requests, --rounds, --duration and "
                         "--throughput-concurrency must be positive")
    if args.prefixes < 1 or args.prompt_chars < 1 or not (
            args.prefix_chars is None or 0 <= args.prefix_chars < args.prompt_chars):
        raise ValueError("--prefixes and --prompt-chars must be positive, and --prefix-chars "
                         "between 0 and --prompt-chars - 1")
    return OverheadOptions(concurrency=levels, ttft_requests=args.ttft_requests,
                           rounds=args.rounds, duration=args.duration,
                           throughput_concurrency=args.throughput_concurrency,
                           prompt_chars=args.prompt_chars, max_tokens=args.max_tokens,
                           worker_speedup_ratio=args.worker_speedup_ratio,
                           router_args=tuple(args.router_arg), worker_args=tuple(args.worker_arg),
                           sessions=args.sessions, prefix_chars=args.prefix_chars,
                           prefixes=args.prefixes)


def run(args: argparse.Namespace) -> int:
    try:
        opts = options_from_args(args)
    except ValueError as exc:
        print(f"jetrouter bench overhead: error: {exc}", file=sys.stderr)
        return 2
    quiet = bool(args.json)
    result = run_loop(run_overhead(opts, args.data_dir,
                                   log=(lambda s: None) if quiet else
                                   (lambda s: print(f"  {s}", file=sys.stderr, flush=True))))
    text = json.dumps(result, indent=2)
    if args.out is not None:
        args.out.write_text(text + "\n")
    print(text if quiet else format_report(result))
    return 0
