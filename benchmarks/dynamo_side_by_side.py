"""jetrouter beside Dynamo 1.6.1's frontend: requests per second and router CPU per request.

Not a test (prints figures, asserts nothing about speed) and not part of CI: Dynamo lives in a
virtualenv of its own, outside the repository. Run from the repository root:

    .venv/bin/python -m benchmarks.dynamo_side_by_side --dynamo-venv /work/dynamo-venv

Both stacks run at once, each with four engines in one process and its own nats-server:

* Dynamo: ``python -m dynamo.mocker --num-workers 4`` and ``python -m dynamo.frontend
  --router-mode kv`` (file discovery, ``DYN_LOG=warn``), both from ``--dynamo-venv``;
* jetrouter: one replica and ``jetrouter worker --engines 4`` (`launch.local_cluster`).

Engines on both sides take the same flags: 4096 blocks of 16 tokens, ``--speedup-ratio``. The same
client (`bench.overhead.closed_loop`: raw keep-alive HTTP/1.1 on uvloop) sends ``/v1/completions``
bodies whose prompt is token ids, so neither router tokenizes: each prompt is one of
``--prefixes`` shared prefixes and a suffix of its own. For each pair of runs and each
concurrency the two stacks take turns (the first of the pair alternates), each for
``--duration`` seconds of closed-loop load. Per run: requests per second, and the router
process's CPU seconds (user + system from ``/proc``, its child processes included: jetrouter's
SQL projector) divided by the requests completed. Engines, nats-server and the client are
measured too and printed, never counted as the router; "stack" is every process of the stack
plus the client (this process) per request: on a machine of few cores req/s follows it. The
report gives medians over the pairs and the ratios jetrouter / Dynamo.

Streamed requests at low concurrency measure Dynamo 1.6.1's HTTP server more than its routing:
it leaves Nagle on for client connections, so on a keep-alive connection each SSE chunk after
the first waits for the client's delayed ACK (~40 ms a request at c = 1). ``--no-stream`` is the
comparison of the routers.

Without a Dynamo virtualenv (``--dynamo-venv`` or ``JETROUTER_DYNAMO_VENV``) the script prints
one line saying how to make one and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.overhead import (
    CpuMeter,
    PhaseResult,
    _wait_for_model,
    closed_loop,
    machine,
)
from launch.children import children_of
from launch.local_cluster import LocalCluster
from leanhttp.loop import run as run_loop
from natsops.server import NatsServer, free_port

ENGINES = 4
GPU_BLOCKS = 4096
BLOCK_SIZE = 16
VOCAB = 4096
INSTALL_HINT = ("python3 -m venv DIR; DIR/bin/pip install ai-dynamo-runtime==1.6.1; "
                "DIR/bin/pip install --no-deps ai-dynamo==1.6.1; then its other requirements "
                "(docs/measurements/dynamo-1.6.1-side-by-side.md)")

# A tokenizer folder for the mocker (it loads one at start and detokenizes what it generates).
# Prompts are token ids, so any vocabulary of VOCAB words serves; written by the Dynamo venv's
# own `tokenizers`, nothing is downloaded.
_MODEL_SCRIPT = """
import json, sys
from pathlib import Path
from tokenizers import Tokenizer, models, pre_tokenizers, decoders
out, vocab = Path(sys.argv[1]), int(sys.argv[2])
tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
tok.decoder = decoders.WordPiece(prefix="##")
tok.save(str(out / "tokenizer.json"))
(out / "tokenizer_config.json").write_text(json.dumps({
    "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 65536,
    "unk_token": "t0", "bos_token": "t1", "eos_token": "t1",
    "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}"}))
(out / "config.json").write_text(json.dumps({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
    "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 65536,
    "bos_token_id": 1, "eos_token_id": 1}))
"""


class DynamoMissing(Exception):
    """No usable Dynamo virtualenv: the comparison is skipped."""


def dynamo_python(venv: Path | None) -> Path:
    """The Dynamo venv's interpreter, or DynamoMissing saying why not."""
    if venv is None:
        raise DynamoMissing("no --dynamo-venv (or JETROUTER_DYNAMO_VENV) given")
    python = venv / "bin" / "python"
    if not python.exists():
        raise DynamoMissing(f"no Dynamo virtualenv at {venv}")
    probe = subprocess.run([str(python), "-c", "import dynamo.frontend, dynamo.mocker"],
                           capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        raise DynamoMissing(f"{venv} cannot import dynamo.frontend and dynamo.mocker ({last})")
    return python


def token_body(model: str, prompt_tokens: int, prefix_tokens: int, prefixes: int,
               max_tokens: int, stream: bool) -> Callable[[int], bytes]:
    """Request n: the ids of shared prefix ``n % prefixes`` then a suffix of its own, all in
    2..VOCAB-1 (0 and 1 are left to the tokenizers' specials)."""
    span = VOCAB - 2
    shared = [[2 + (k * 977 + i * 13) % span for i in range(prefix_tokens)]
              for k in range(prefixes)]
    head = [",".join(map(str, ids)) for ids in shared]
    rest = prompt_tokens - prefix_tokens
    tail = (f'], "max_tokens": {max_tokens}, "stream": {json.dumps(stream)}, '
            f'"temperature": 0}}').encode()
    opening = f'{{"model": {json.dumps(model)}, "prompt": ['.encode()

    def body(n: int) -> bytes:
        own = ",".join(str(2 + (n * 7919 + i * 31) % span) for i in range(rest))
        ids = head[n % prefixes] + ("," + own if own and head[n % prefixes] else own)
        return opening + ids.encode() + tail

    return body


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        for child in children_of(todo.pop()):
            out.append(child)
            todo.append(child)
    return out


@dataclass(slots=True)
class Stack:
    """One router under test: its URL, the pid whose CPU is the router's, the others shown."""

    name: str
    url: str
    router_pid: int
    other_pids: dict[str, int] = field(default_factory=dict)
    model: str = ""

    def pids(self) -> dict[str, int]:
        """Named pids to meter: the router, its descendants (each on its own), the rest."""
        named = {"router": self.router_pid}
        named.update({f"router-child{k}": p
                      for k, p in enumerate(descendants(self.router_pid))})
        named.update(self.other_pids)
        return named


@contextlib.contextmanager
def dynamo_stack(python: Path, work: Path, speedup: float, block_size: int
                 ) -> Iterator[Stack]:
    """nats-server, the mocker with ENGINES workers and the KV frontend; stopped on exit."""
    model_dir = work / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    subprocess.run([str(python), "-c", _MODEL_SCRIPT, str(model_dir), str(VOCAB)], check=True)
    nats = NatsServer(store_dir=work / "nats")
    nats.start()
    port = free_port()
    env = {**os.environ, "NATS_SERVER": nats.url, "DYN_FILE_KV": str(work / "discovery"),
           "DYN_LOG": "warn", "VIRTUAL_ENV": str(python.parent.parent)}
    env.pop("PYTHONPATH", None)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for argv, log_name in (
                (["-m", "dynamo.mocker", "--model-path", str(model_dir),
                  "--num-workers", str(ENGINES), "--num-gpu-blocks-override", str(GPU_BLOCKS),
                  "--block-size", str(block_size), "--speedup-ratio", f"{speedup:g}",
                  "--discovery-backend", "file"], "mocker.log"),
                (["-m", "dynamo.frontend", "--router-mode", "kv", "--http-host", "127.0.0.1",
                  "--http-port", str(port), "--kv-cache-block-size", str(block_size),
                  "--discovery-backend", "file"], "frontend.log")):
            with open(work / log_name, "wb") as log:
                procs.append(subprocess.Popen([str(python), *argv], env=env, cwd=work,
                                              stdout=log, stderr=subprocess.STDOUT))
        yield Stack("dynamo", f"http://127.0.0.1:{port}", procs[1].pid,
                    {"engines": procs[0].pid, "nats": nats.proc.pid if nats.proc else 0})
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in reversed(procs):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        nats.stop()


def jetrouter_cluster(work: Path, speedup: float, block_size: int) -> LocalCluster:
    engine = ["--speedup-ratio", f"{speedup:g}", "--num-gpu-blocks", str(GPU_BLOCKS),
              "--kv-cache-block-size", str(block_size)]
    return LocalCluster(replicas=1, workers=ENGINES, engines_per_process=ENGINES,
                        base_port=None, data_dir=work, namespace="sbs", worker_args=engine,
                        router_args=["--kv-cache-block-size", str(block_size)])


def jetrouter_stack(cluster: LocalCluster) -> Stack:
    pids = cluster.processes
    replica = next(c for c in cluster.children.values() if c.kind == "replica")
    others = {"engines" if c.kind in ("worker", "engines") else n: c.pid
              for n, c in cluster.children.items() if c.kind != "replica" and c.pid}
    nats_proc = getattr(cluster._nats, "proc", None)
    if nats_proc is not None:
        others["nats"] = nats_proc.pid
    assert replica.pid is not None and pids
    return Stack("jetrouter", replica.url, replica.pid, others)


# -- the runs ---------------------------------------------------------------------------------


@dataclass(slots=True)
class Options:
    concurrency: Sequence[int] = (1, 64)
    pairs: int = 3
    duration: float = 8.0
    warmup: float = 3.0
    prompt_tokens: int = 512
    prefix_tokens: int = 256
    prefixes: int = 8
    max_tokens: int = 8
    stream: bool = True
    speedup: float = 1000.0
    block_size: int = BLOCK_SIZE
    idle_seconds: float = 3.0


def _load() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


async def _run(stack: Stack, body: Callable[[int], bytes], conc: int, opts: Options,
               *, duration: float, offset: int) -> dict[str, Any]:
    meter = CpuMeter(stack.pids())
    meter.start()
    client = time.process_time()  # this process is the load generator
    res = await closed_loop(stack.url, "/v1/completions", lambda n: body(offset + n), conc,
                            duration=duration, stream=opts.stream,
                            result=PhaseResult(stack.name, conc))
    client = time.process_time() - client
    used = meter.stop()
    router = sum(v for k, v in used.items() if k.startswith("router"))
    ok = max(res.ok, 1)
    return {"ok": res.ok, "errors": res.errors, "seconds": round(res.seconds, 3),
            "req_per_s": round(res.rate, 1),
            # every process of the stack and the client: on a machine of few cores req/s
            # follows this, not the router's share alone
            "stack_cpu_ms_per_request": round(1000 * (sum(used.values()) + client) / ok, 4),
            "client_cpu_ms_per_request": round(1000 * client / ok, 4),
            "router_cpu_ms_per_request": round(1000 * router / ok, 4),
            "router_process_cpu_ms_per_request": round(1000 * used.get("router", 0.0) / ok, 4),
            "cpu_ms_per_request": {k: round(1000 * v / ok, 4) for k, v in used.items()},
            "cpu_cores": {k: round(v / meter.wall, 3) for k, v in used.items()},
            "load": _load()}


async def compare(stacks: Sequence[Stack], opts: Options,
                  log: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    for s in stacks:
        s.model = await _wait_for_model(s.url, timeout=120.0)
    bodies = {s.name: token_body(s.model, opts.prompt_tokens, opts.prefix_tokens,
                                 opts.prefixes, opts.max_tokens, opts.stream) for s in stacks}
    offset = [0]

    def fresh() -> int:
        offset[0] += 10_000_000
        return offset[0]

    for s in stacks:  # every engine registered, connections and caches warm
        log(f"warm-up {s.name} for {opts.warmup:g}s")
        await _run(s, bodies[s.name], 8, opts, duration=opts.warmup, offset=fresh())
    idle: dict[str, dict[str, float]] = {}
    if opts.idle_seconds > 0:
        meters = {s.name: CpuMeter(s.pids()) for s in stacks}
        for m in meters.values():
            m.start()
        await asyncio.sleep(opts.idle_seconds)  # what no traffic costs each process
        idle = {n: {k: round(v / m.wall, 4) for k, v in m.stop().items()}
                for n, m in meters.items()}
    runs: list[dict[str, Any]] = []
    for pair in range(opts.pairs):
        order = list(stacks) if pair % 2 == 0 else list(reversed(stacks))
        for conc in opts.concurrency:
            for s in order:
                log(f"pair {pair + 1}/{opts.pairs} c={conc}: {s.name}")
                r = await _run(s, bodies[s.name], conc, opts, duration=opts.duration,
                               offset=fresh())
                runs.append({"pair": pair, "concurrency": conc, "stack": s.name, **r})
    return {"machine": machine(), "options": _describe(opts), "idle_cpu_cores": idle,
            "runs": runs, "summary": summarise(runs, opts.concurrency)}


def summarise(runs: Sequence[dict[str, Any]], levels: Sequence[int]) -> list[dict[str, Any]]:
    """Per concurrency: medians of each stack's runs and jetrouter / Dynamo ratios, of the
    medians and pair by pair."""
    out = []
    for conc in levels:
        row: dict[str, Any] = {"concurrency": conc}
        per: dict[str, dict[int, dict[str, Any]]] = {}
        for r in runs:
            if r["concurrency"] == conc:
                per.setdefault(r["stack"], {})[r["pair"]] = r
        for name, by_pair in per.items():
            rs = list(by_pair.values())
            row[name] = {key: statistics.median(r[key] for r in rs)
                         for key in ("req_per_s", "router_cpu_ms_per_request",
                                     "router_process_cpu_ms_per_request",
                                     "stack_cpu_ms_per_request")}
            row[name]["errors"] = sum(r["errors"] for r in rs)
            others = sorted({k for r in rs for k in r.get("cpu_ms_per_request", {})
                             if not k.startswith("router")})
            row[name]["other_cpu_ms_per_request"] = {
                k: statistics.median(r["cpu_ms_per_request"].get(k, 0.0) for r in rs)
                for k in others}
            if all("client_cpu_ms_per_request" in r for r in rs):
                row[name]["other_cpu_ms_per_request"]["client"] = statistics.median(
                    r["client_cpu_ms_per_request"] for r in rs)
        if "jetrouter" in per and "dynamo" in per:
            j, d = row["jetrouter"], row["dynamo"]
            pairs = sorted(set(per["jetrouter"]) & set(per["dynamo"]))
            for key, name in (("req_per_s", "req_per_s"), ("router_cpu_ms_per_request",
                                                           "router_cpu"),
                              ("router_process_cpu_ms_per_request", "router_process_cpu"),
                              ("stack_cpu_ms_per_request", "stack_cpu")):
                row[f"{name}_ratio"] = _ratio(j[key], d[key])
                row[f"pair_{name}_ratios"] = [
                    _ratio(per["jetrouter"][p][key], per["dynamo"][p][key]) for p in pairs]
        out.append(row)
    return out


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def _describe(opts: Options) -> dict[str, Any]:
    return {"concurrency": list(opts.concurrency), "pairs": opts.pairs,
            "duration_s": opts.duration, "prompt_tokens": opts.prompt_tokens,
            "prefix_tokens": opts.prefix_tokens, "prefixes": opts.prefixes,
            "max_tokens": opts.max_tokens, "stream": opts.stream,
            "engine_speedup_ratio": opts.speedup, "engines": ENGINES,
            "gpu_blocks": GPU_BLOCKS, "block_size": opts.block_size}


def format_report(r: dict[str, Any]) -> str:
    m, o = r["machine"], r["options"]
    lines = [f"machine: {m['cpus']} cores, {m['cpu_model']}, Python {m['python']}; "
             f"load before {r.get('load_before', '?')}, after {r.get('load_after', '?')}",
             f"{o['engines']} engines a side at --speedup-ratio {o['engine_speedup_ratio']:g}; "
             f"/v1/completions, {o['prompt_tokens']} token ids ({o['prefix_tokens']} one of "
             f"{o['prefixes']} shared prefixes), max_tokens {o['max_tokens']}, "
             f"{'streamed' if o['stream'] else 'not streamed'}; {o['pairs']} pairs of "
             f"{o['duration_s']:g}s runs, medians"]
    for name, cores in r.get("idle_cpu_cores", {}).items():
        lines.append(f"idle cores, {name}: " + " ".join(f"{k}={v}" for k, v in cores.items()))
    lines += ["", "router ms/req: the router process and its children (jetrouter's SQL projector);"
              " (process): the router process alone; stack: every process of the stack and the"
              " client; others: CPU ms per request of the rest",
              f"{'conc':>5} {'stack':<10} {'req/s':>9} {'router ms/req':>14} "
              f"{'(process)':>10} {'stack':>7} {'errors':>6}  others"]
    for row in r["summary"]:
        for name in ("dynamo", "jetrouter"):
            if name in row:
                s = row[name]
                others = " ".join(f"{k}={v:.3f}"
                                  for k, v in s.get("other_cpu_ms_per_request", {}).items())
                lines.append(f"{row['concurrency']:>5} {name:<10} {s['req_per_s']:>9.1f} "
                             f"{s['router_cpu_ms_per_request']:>14.3f} "
                             f"{s['router_process_cpu_ms_per_request']:>10.3f} "
                             f"{s['stack_cpu_ms_per_request']:>7.3f} "
                             f"{s['errors']:>6}  {others}")
        if "req_per_s_ratio" in row:
            lines.append(f"{row['concurrency']:>5} {'jet/dyn':<10} {row['req_per_s_ratio']:>8}x "
                         f"{row['router_cpu_ratio']:>13}x {row['router_process_cpu_ratio']:>9}x "
                         f"{row['stack_cpu_ratio']:>6}x")
            lines.append(f"{'':>5} {'pairs':<10} req/s {row['pair_req_per_s_ratios']}, router "
                         f"{row['pair_router_cpu_ratios']}, process "
                         f"{row['pair_router_process_cpu_ratios']}, stack "
                         f"{row['pair_stack_cpu_ratios']}")
    return "\n".join(lines)


# -- command line -----------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    d = Options()
    p = argparse.ArgumentParser(prog="python -m benchmarks.dynamo_side_by_side",
                                description=__doc__.split("\n\n")[0])
    env_venv = os.environ.get("JETROUTER_DYNAMO_VENV")
    p.add_argument("--dynamo-venv", type=Path, default=Path(env_venv) if env_venv else None,
                   help="virtualenv with ai-dynamo 1.6.1 (default $JETROUTER_DYNAMO_VENV)")
    p.add_argument("--concurrency", default=",".join(map(str, d.concurrency)),
                   help="closed-loop connections, comma-separated (default %(default)s)")
    p.add_argument("--pairs", type=int, default=d.pairs,
                   help="runs of each stack per level, alternating (default %(default)s)")
    p.add_argument("--duration", type=float, default=d.duration,
                   help="seconds per run (default %(default)s)")
    p.add_argument("--warmup", type=float, default=d.warmup,
                   help="seconds of warm-up load per stack (default %(default)s)")
    p.add_argument("--prompt-tokens", type=int, default=d.prompt_tokens)
    p.add_argument("--prefix-tokens", type=int, default=d.prefix_tokens)
    p.add_argument("--prefixes", type=int, default=d.prefixes)
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--no-stream", dest="stream", action="store_false",
                   help="non-streaming requests (default: streamed)")
    p.add_argument("--speedup-ratio", type=float, default=d.speedup,
                   help="both sides' engines (default %(default)s)")
    p.add_argument("--only", choices=("dynamo", "jetrouter"), default=None,
                   help="run one stack alone (profiling)")
    p.add_argument("--json", action="store_true", help="print only the JSON report")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON report here")
    p.add_argument("--work-dir", type=Path, default=None,
                   help="logs and data here (default: a temporary directory, removed)")
    return p.parse_args(argv)


def options(args: argparse.Namespace) -> Options:
    levels = tuple(int(x) for x in args.concurrency.split(",") if x.strip())
    if not levels or min(levels) < 1 or args.pairs < 1 or args.duration <= 0 \
            or not 0 <= args.prefix_tokens < args.prompt_tokens or args.prefixes < 1:
        raise ValueError("positive levels, --pairs and --duration, and --prefix-tokens "
                         "below --prompt-tokens, please")
    return Options(concurrency=levels, pairs=args.pairs, duration=args.duration,
                   warmup=args.warmup, prompt_tokens=args.prompt_tokens,
                   prefix_tokens=args.prefix_tokens, prefixes=args.prefixes,
                   max_tokens=args.max_tokens, stream=args.stream, speedup=args.speedup_ratio)


async def _main(args: argparse.Namespace, opts: Options, python: Path | None, work: Path,
                log: Callable[[str], None]) -> dict[str, Any]:
    load_before = _load()
    with contextlib.ExitStack() as exits:
        stacks: list[Stack] = []
        cluster = None
        if args.only != "jetrouter":
            assert python is not None
            log("starting Dynamo (nats-server, mocker, frontend)")
            stacks.append(exits.enter_context(
                dynamo_stack(python, work / "dynamo", opts.speedup, opts.block_size)))
        if args.only != "dynamo":
            log("starting jetrouter (nats-server, replica, engines)")
            cluster = jetrouter_cluster(work / "jetrouter", opts.speedup, opts.block_size)
            await cluster.start()
        try:
            if cluster is not None:
                stacks.append(jetrouter_stack(cluster))
            result = await compare(stacks, opts, log)
        finally:
            if cluster is not None:
                await cluster.stop()
    result["load_before"], result["load_after"] = load_before, _load()
    return result


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        opts = options(args)
    except ValueError as exc:
        print(f"dynamo_side_by_side: error: {exc}", file=sys.stderr)
        return 2
    python = None
    if args.only != "jetrouter":
        try:
            python = dynamo_python(args.dynamo_venv)
        except DynamoMissing as exc:
            print(f"dynamo_side_by_side: skipped: {exc}; to make one: {INSTALL_HINT}")
            return 0
    owned = args.work_dir is None
    work = Path(tempfile.mkdtemp(prefix="jr-dynamo-sbs-")) if owned else args.work_dir
    log = (lambda s: None) if args.json else (
        lambda s: print(f"  [{time.strftime('%H:%M:%S')}] {s}", file=sys.stderr, flush=True))
    try:
        result = run_loop(_main(args, opts, python, work, log))
    finally:
        if owned:
            shutil.rmtree(work, ignore_errors=True)
    text = json.dumps(result, indent=2)
    if args.out is not None:
        args.out.write_text(text + "\n")
    print(text if args.json else format_report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
