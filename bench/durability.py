"""`jetrouter bench durability`: snapshot size and speed, and SIGKILL-to-ready with a big state.

Everything runs against a real ``nats-server`` (started here) and, for the end-to-end figure, a
real ``jetrouter serve`` process. Printed, never asserted.

1. **Build.** ``--workers`` workers register, then store chains of ``--chain-blocks`` blocks
   (half of them start with one of 50 shared 8-block system prompts) until ``--blocks`` blocks
   are held; one JetStream message is one batch of ``--chains-per-message`` chains from one
   worker. The batches are published to ``<ns>.kv.*`` and applied, at their stream sequences, to
   an in-process ``RouterState``.
2. **Take** (best of ``--repeats``): capture the state (``RouterState.capture()``, its steps
   run at once here: the part a leader runs on the event loop, in 5 ms slices, with the KV
   stream held), encode the capture, then ``SnapshotStore.put`` (compress, sha256,
   write to the object store, prune). Raw and stored sizes.
3. **Restore** (best of ``--repeats``): ``SnapshotStore.load_newest_valid`` (fetch, verify,
   inflate) and ``RouterState.decode``; digests must equal the original's.
4. **Restart** (unless ``--skip-restart``): start ``jetrouter serve`` on that state, append a tail
   of ``--tail-events`` KV events (stores extending chains and removals of old blocks, half
   each; ``--tail-batch`` events per message) after the snapshot, wait until the replica applied
   it, SIGKILL it, start it again and time process start → ``GET /ready`` 200 (polled every
   10 ms), with the process's CPU seconds at that moment (the figure to compare on a loaded
   machine). The restarted replica's digests must equal the in-process state's. For comparison,
   the same restore + tail replay is also timed in-process (``replay_tail_s``).
   ``--restart-via fresh`` (the default) starts a new ``python -m api.cli serve`` process;
   ``--restart-via standby`` hands the dead replica's command line to a pre-imported
   ``api.standby`` process started (and done importing) before the kill, as ``jetrouter up``
   restarts a replica (``launch/standby_pool.py``): the restart then pays no import time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import nats
from nats.js import JetStreamContext

from api.standby import READY_LINE, activation_line
from eventlog import events as ev
from eventlog.names import CONTROL, KV, STREAM_KINDS, Names
from eventlog.reader import StreamReader
from eventlog.streams import ensure_streams, stream_bounds
from natsops.server import NatsServer, free_port
from replicas.core.state import INDEX_FORMS, RouterState, StateConfig
from snapshots.store import SnapshotStore

NAMESPACE = "durbench"
SHARED_PROMPTS = 50
PROMPT_BLOCKS = 8
PUBLISH_WINDOW = 256  # publishes in flight at once
_FORMATS = {"reference": "msgpack state v2, index v2 (columns per worker) + zlib-1",
            "compact": "msgpack state v6, index v6 (the tables' arrays, packed), uncompressed"}
_PARAMS = ("index_form", "blocks", "workers", "chain_blocks", "chains_per_message", "tail_events",
           "tail_batch", "tail_blocks", "repeats", "seed", "restart_via")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print only the JSON object")
    p.add_argument("--blocks", type=int, default=1_000_000, help="blocks held by the state")
    p.add_argument("--index-form", choices=sorted(INDEX_FORMS), default="reference",
                   help="the prefix index's form, in-process and in the replica "
                        "(--router-index-form)")
    p.add_argument("--workers", type=int, default=64, help="workers (dp rank 0 each)")
    p.add_argument("--chain-blocks", type=int, default=32, help="blocks per stored chain")
    p.add_argument("--chains-per-message", type=int, default=4,
                   help="BlocksStored events (chains) per message while building")
    p.add_argument("--tail-events", type=int, default=100_000,
                   help="KV events appended after the snapshot")
    p.add_argument("--tail-batch", type=int, default=1, help="tail events per message")
    p.add_argument("--tail-blocks", type=int, default=4, help="blocks per tail event")
    p.add_argument("--repeats", type=int, default=3, help="runs of take/restore (best kept)")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--skip-restart", action="store_true",
                   help="no replica process: take/restore figures only")
    p.add_argument("--restart-via", choices=("fresh", "standby"), default="fresh",
                   help="restart the killed replica as a new process, or by handing its command "
                        "line to a pre-imported standby process as `jetrouter up` does")
    p.add_argument("--ready-timeout", type=float, default=120.0,
                   help="give up waiting for /ready after this long")
    p.add_argument("--keep-dir", type=Path, default=None,
                   help="keep the nats store and replica logs here (default: a temp dir, removed)")


def run(args: argparse.Namespace) -> int:
    result = asyncio.run(measure(args))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_table(result)
    restart = result.get("restart") or {}
    ok = result["restore"]["digests_equal"] and restart.get("digests_equal", True)
    return 0 if ok else 1


# --- workload ------------------------------------------------------------------------------


class Workload:
    """Deterministic KV events for ``workers`` workers: event ids, chains and evictions."""

    def __init__(self, workers: int, seed: int) -> None:
        self.rng = random.Random(seed)
        self.workers = [f"w{i:03d}" for i in range(workers)]
        self.event_ids = dict.fromkeys(self.workers, 0)
        self.held: dict[str, deque[int]] = {w: deque() for w in self.workers}
        self.tips: dict[str, int | None] = dict.fromkeys(self.workers)
        bits = self.rng.getrandbits
        self.prompts = [[bits(64) for _ in range(PROMPT_BLOCKS)] for _ in range(SHARED_PROMPTS)]

    def registrations(self, ts: float) -> list[ev.Event]:
        return [ev.WorkerRegistered(w, f"http://127.0.0.1:9/{w}", "bench-model", 16, 1 << 20,
                                    8192, ts) for w in self.workers]

    def _next_id(self, worker: str) -> int:
        self.event_ids[worker] += 1
        return self.event_ids[worker]

    def chain(self, worker: str, blocks: int, ts: float) -> ev.BlocksStored:
        bits = self.rng.getrandbits
        tokens = [bits(64) for _ in range(blocks)]
        if self.rng.random() < 0.5:
            prompt = self.rng.choice(self.prompts)
            tokens[:PROMPT_BLOCKS] = prompt[:blocks]
        ids = [bits(64) for _ in range(blocks)]
        self.held[worker].extend(ids)
        self.tips[worker] = ids[-1]
        return ev.BlocksStored(worker, self._next_id(worker), 0, None, list(zip(ids, tokens,
                                                                               strict=True)), ts)

    def extend(self, worker: str, blocks: int, ts: float) -> ev.BlocksStored:
        """Blocks continuing the worker's newest chain (a decode growing its context)."""
        bits = self.rng.getrandbits
        ids = [bits(64) for _ in range(blocks)]
        parent = self.tips[worker]
        self.held[worker].extend(ids)
        self.tips[worker] = ids[-1]
        return ev.BlocksStored(worker, self._next_id(worker), 0, parent,
                               [(i, bits(64)) for i in ids], ts)

    def evict(self, worker: str, blocks: int, ts: float) -> ev.BlocksRemoved:
        """The worker's oldest blocks (LRU eviction, roughly)."""
        held = self.held[worker]
        gone = [held.popleft() for _ in range(min(blocks, max(len(held) - 1, 0)))]
        return ev.BlocksRemoved(worker, self._next_id(worker), 0, gone, ts)


# --- helpers -------------------------------------------------------------------------------


def _best(values: Sequence[float]) -> float:
    return round(min(values), 4)


async def _timed(fn: Callable[[], Awaitable[Any]]) -> tuple[Any, float]:
    start = time.perf_counter()
    out = await fn()
    return out, time.perf_counter() - start


async def _publish_all(js: JetStreamContext, messages: Sequence[tuple[str, list[ev.Event]]],
                       state: RouterState, kind: str) -> None:
    """Publish with a window of acks in flight, then apply each batch at its stream sequence."""
    acked: list[tuple[int, list[ev.Event]]] = []
    for start in range(0, len(messages), PUBLISH_WINDOW):
        chunk = messages[start:start + PUBLISH_WINDOW]
        acks = await asyncio.gather(*(js.publish(subject, ev.encode_batch(batch), timeout=60)
                                      for subject, batch in chunk))
        acked.extend((ack.seq, batch) for ack, (_, batch) in zip(acks, chunk, strict=True))
    for seq, batch in sorted(acked, key=lambda x: x[0]):
        state.apply(kind, seq, batch)


async def _stream_ends(js: JetStreamContext, names: Names) -> dict[str, int]:
    return {k: (await stream_bounds(js, names.stream(k)))[1] for k in STREAM_KINDS}


async def _replay_tail(js: JetStreamContext, names: Names, state: RouterState,
                       ends: dict[str, int]) -> None:
    """Apply every stream from the state's positions to ``ends`` (as a restarting replica)."""

    async def follow(kind: str) -> None:
        if state.positions[kind] >= ends[kind]:
            return
        reader = StreamReader(js, names.stream(kind), start_seq=state.positions[kind] + 1,
                              time_decode=False)
        try:  # as the replica's follower does: what a pull brought, without an await each,
            # the KV stream's stores and removals as runs (RouterState.apply_many)
            async for first in reader:
                taken = [m for m in [first, *reader.take_received(1 << 30)] if m[0] <= ends[kind]]
                state.apply_many(kind, taken)
                if not taken or taken[-1][0] >= ends[kind]:
                    return
        finally:
            await reader.close()

    await asyncio.gather(*(follow(k) for k in STREAM_KINDS))


def _hex_digests(state: RouterState) -> dict[str, str]:
    return {k: f"{v:016x}" for k, v in state.digests().items()}


# --- the replica process -------------------------------------------------------------------


class ReplicaProcess:
    """One `jetrouter serve` child with a fixed id, port and data dir (so it can restart)."""

    def __init__(self, nats_url: str, root: Path, token: str, index_form: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.token = token
        self.log_path = root / "replica.log"
        self.cmd = [sys.executable, "-m", "api.cli", "serve", "--host", "127.0.0.1",
                    "--port", str(self.port), "--replica-id", "dur-r0", "--nats-url", nats_url,
                    "--namespace", NAMESPACE, "--data-dir", str(root / "r0"),
                    f"--admin-token={token}", "--log-level", "warning",
                    "--router-snapshot-threshold", str(10**12), "--canary-interval", "0",
                    "--worker-timeout", "86400", "--replica-timeout", "86400",
                    "--router-index-form", index_form]
        self.proc: subprocess.Popen[bytes] | None = None
        self.standby: subprocess.Popen[bytes] | None = None
        self.cpu_at_ready: float | None = None  # the process's CPU seconds when /ready said 200

    def prepare_standby(self) -> None:
        """Start a pre-imported ``api.standby`` process and wait until it has imported what
        ``serve`` needs (it says so on stdout), as ``jetrouter up`` keeps one waiting."""
        with (self.log_path.parent / "standby.log").open("ab") as err:
            self.standby = subprocess.Popen(
                [sys.executable, "-m", "api.standby"], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=err, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                cwd=Path(__file__).resolve().parents[1])
        assert self.standby.stdout is not None
        line = self.standby.stdout.readline().decode(errors="replace")
        self.standby.stdout.close()  # after activation it writes to the replica's log
        if line != READY_LINE:
            raise RuntimeError(f"standby process said {line!r}, not that it is ready")

    def start_standby(self) -> float:
        """Hand this replica's command line to the waiting standby; returns the monotonic time
        just before it was handed over."""
        standby, self.standby = self.standby, None
        assert standby is not None and standby.stdin is not None
        started = time.monotonic()
        standby.stdin.write(activation_line(self.cmd[3:], {"PYTHONUNBUFFERED": "1"},
                                            str(self.log_path)))
        standby.stdin.close()
        self.proc = standby
        return started

    def start(self) -> float:
        """Start the process; returns the monotonic time just before it was spawned."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        log = self.log_path.open("ab")
        started = time.monotonic()
        self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                     cwd=Path(__file__).resolve().parents[1])
        log.close()
        return started

    async def wait_ready(self, client: httpx.AsyncClient, timeout: float) -> float:
        """Poll /ready every 10 ms; returns the monotonic time of the first 200."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"replica exited with {self.proc.returncode}; "
                                   f"see {self.log_path}")
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get(f"{self.url}/ready", timeout=1.0)).status_code == 200:
                    ready_at = time.monotonic()
                    self.cpu_at_ready = _process_cpu_s(self.proc.pid)
                    return ready_at
            await asyncio.sleep(0.01)
        raise TimeoutError(f"replica not ready within {timeout} s; see {self.log_path}")

    async def state(self, client: httpx.AsyncClient) -> dict[str, Any]:
        r = await client.get(f"{self.url}/admin/state", timeout=5.0,
                             headers={"Authorization": f"Bearer {self.token}"})
        r.raise_for_status()
        return dict(r.json())

    async def wait_positions(self, client: httpx.AsyncClient, ends: dict[str, int],
                             timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            st = await self.state(client)
            if all(int(st["positions"].get(k, 0)) >= ends[k] for k in STREAM_KINDS):
                return st
            if time.monotonic() > deadline:
                raise TimeoutError(f"replica at {st['positions']}, wanted {ends}")
            await asyncio.sleep(0.05)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.standby is not None and self.standby.poll() is None:
            self.standby.kill()  # never activated: nothing of a replica in it
            self.standby.wait(10)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


def _process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` so far (None where /proc is not there): on
    a loaded machine the restart's CPU time says more than its wall time."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _snapshot_loaded_at(log_path: Path, offset: int) -> float | None:
    """Wall time of the replica's "loaded snapshot" log line written after ``offset``."""
    with log_path.open("rb") as f:
        f.seek(offset)
        for line in f.read().decode(errors="replace").splitlines():
            if "loaded snapshot" in line:
                with contextlib.suppress(ValueError):
                    stamp = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
                    return stamp.timestamp()
    return None


def _digests_of(admin_state: dict[str, Any]) -> dict[str, str]:
    return {k: str(v) for k, v in admin_state["digests"].items()}


# --- measuring -----------------------------------------------------------------------------


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    root = args.keep_dir or Path(tempfile.mkdtemp(prefix="jetrouter-durbench-"))
    root.mkdir(parents=True, exist_ok=True)
    server = NatsServer(store_dir=root / "nats").start()
    try:
        nc = await nats.connect(server.url)
        try:
            return await _measure(args, nc, server.url, root)
        finally:
            await nc.close()
    finally:
        server.cleanup()
        if args.keep_dir is None:
            shutil.rmtree(root, ignore_errors=True)


async def _measure(args: argparse.Namespace, nc: nats.NATS, nats_url: str,
                   root: Path) -> dict[str, Any]:
    js = nc.jetstream()
    names = Names(NAMESPACE)
    await ensure_streams(js, names)
    wl = Workload(args.workers, args.seed)
    config = StateConfig(index_form=args.index_form)
    state = RouterState(config)
    ts = time.time()

    # 1. build
    start = time.perf_counter()
    messages: list[tuple[str, list[ev.Event]]] = [(names.kv_subject(wl.workers[0]),
                                                    wl.registrations(ts))]
    total = 0
    turn = 0
    while total < args.blocks:
        worker = wl.workers[turn % len(wl.workers)]
        turn += 1
        batch: list[ev.Event] = []
        for _ in range(args.chains_per_message):
            n = min(args.chain_blocks, args.blocks - total)
            if n <= 0:
                break
            batch.append(wl.chain(worker, n, ts))
            total += n
        messages.append((names.kv_subject(worker), batch))
    await _publish_all(js, messages, state, KV)
    build_s = time.perf_counter() - start
    built = {"blocks": state.index.total_blocks, "nodes": state.index.node_count,
             "workers": len(state.workers), "kv_messages": len(messages), "build_s":
             round(build_s, 2)}

    # 2. take
    store = SnapshotStore(js, names, keep=max(args.repeats, 2) + 1)
    take: dict[str, list[float]] = {"capture_s": [], "encode_s": [], "put_s": [], "total_s": []}
    meta = None
    raw = b""
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        taken = state.capture()
        for _ in taken.steps:
            pass
        t1 = time.perf_counter()
        raw = taken.encode()
        t2 = time.perf_counter()
        meta = await store.put(raw, positions=dict(state.positions), epoch=state.epoch,
                               created_by="bench", trigger="bench", format=state.snapshot_format)
        t3 = time.perf_counter()
        for key, value in zip(take, (t1 - t0, t2 - t1, t3 - t2, t3 - t0), strict=True):
            take[key].append(value)
    assert meta is not None
    taken = ev.SnapshotTaken(meta.snapshot_id, dict(meta.positions), meta.size, meta.sha256,
                             "bench", "bench", ts)  # as the leader does after writing the blob
    ack = await js.publish(names.control_subject("snapshot"), ev.encode_batch([taken]))
    state.apply(CONTROL, ack.seq, [taken])

    # 3. restore
    reference = state.digests()
    restore: dict[str, list[float]] = {"load_s": [], "decode_s": [], "total_s": []}
    equal = True
    for _ in range(args.repeats):
        loaded, t_load = await _timed(store.load_newest_valid)
        assert loaded is not None
        start = time.perf_counter()
        copy = RouterState.decode(loaded.data, config)
        t_decode = time.perf_counter() - start
        equal = equal and loaded.data == raw and copy.digests() == reference
        for key, value in zip(restore, (t_load, t_decode, t_load + t_decode), strict=True):
            restore[key].append(value)
        del copy
    result: dict[str, Any] = {
        "params": {k: getattr(args, k) for k in _PARAMS},
        "state": built,
        "snapshot": {"raw_bytes": meta.size, "stored_bytes": meta.stored_size,
                     "raw_bytes_per_held_block": round(meta.size / max(built["blocks"], 1), 2),
                     "stored_bytes_per_held_block": round(
                         meta.stored_size / max(built["blocks"], 1), 2),
                     "format": _FORMATS[args.index_form]},
        "take": {k: _best(v) for k, v in take.items()},
        "take_median_total_s": round(statistics.median(take["total_s"]), 4),
        "restore": {**{k: _best(v) for k, v in restore.items()}, "digests_equal": equal},
        "restore_median_total_s": round(statistics.median(restore["total_s"]), 4),
    }
    if not args.skip_restart:
        result["restart"] = await _restart(args, js, names, nats_url, root, wl, state)
    return result


async def _restart(args: argparse.Namespace, js: JetStreamContext, names: Names, nats_url: str,
                   root: Path, wl: Workload, state: RouterState) -> dict[str, Any]:
    token = secrets.token_urlsafe(16)
    replica = ReplicaProcess(nats_url, root, token, args.index_form)
    out: dict[str, Any] = {}
    async with httpx.AsyncClient() as client:
        try:
            started = replica.start()
            out["first_start_ready_s"] = round(
                await replica.wait_ready(client, args.ready_timeout) - started, 3)
            # the tail: after the snapshot, applied live by the replica
            ts = time.time()
            messages: list[tuple[str, list[ev.Event]]] = []
            events = 0
            turn = 0
            while events < args.tail_events:
                worker = wl.workers[turn % len(wl.workers)]
                turn += 1
                batch: list[ev.Event] = []
                for _ in range(min(args.tail_batch, args.tail_events - events)):
                    step = wl.event_ids[worker]
                    batch.append(wl.extend(worker, args.tail_blocks, ts) if step % 2
                                 else wl.evict(worker, args.tail_blocks, ts))
                    events += 1
                messages.append((names.kv_subject(worker), batch))
            start = time.perf_counter()
            await _publish_all(js, messages, state, KV)
            out["tail"] = {"events": events, "messages": len(messages),
                           "publish_s": round(time.perf_counter() - start, 2),
                           "blocks_after": state.index.total_blocks}
            ends = await _stream_ends(js, names)
            before = await replica.wait_positions(client, ends, args.ready_timeout)
            out["digests_equal_before_kill"] = _digests_of(before) == _hex_digests(state)
            if args.restart_via == "standby":
                replica.prepare_standby()
            replica.kill()
            log_offset = replica.log_path.stat().st_size
            wall_started = time.time()
            started = (replica.start_standby() if args.restart_via == "standby"
                       else replica.start())
            ready_at = await replica.wait_ready(client, args.ready_timeout)
            out["sigkill_restart_ready_s"] = round(ready_at - started, 3)
            if replica.cpu_at_ready is not None:
                out["sigkill_restart_cpu_to_ready_s"] = round(replica.cpu_at_ready, 3)
            loaded_at = _snapshot_loaded_at(replica.log_path, log_offset)
            if loaded_at is not None:  # the replica logs when it has restored the snapshot
                out["start_to_snapshot_restored_s"] = round(loaded_at - wall_started, 3)
                out["snapshot_restored_to_ready_s"] = round(
                    out["sigkill_restart_ready_s"] - out["start_to_snapshot_restored_s"], 3)
            after = await replica.wait_positions(client, ends, args.ready_timeout)
            out["digests_equal"] = _digests_of(after) == _hex_digests(state)
            out["positions"] = after["positions"]
        finally:
            replica.stop()
    # the same restore + tail replay, in-process, for the breakdown
    store = SnapshotStore(js, names)
    start = time.perf_counter()
    loaded = await store.load_newest_valid()
    assert loaded is not None
    t_load = time.perf_counter() - start
    copy = RouterState.decode(loaded.data, StateConfig(index_form=args.index_form))
    t_decode = time.perf_counter() - start - t_load
    await _replay_tail(js, names, copy, await _stream_ends(js, names))
    t_replay = time.perf_counter() - start - t_load - t_decode
    out["in_process"] = {"load_s": round(t_load, 3), "decode_s": round(t_decode, 3),
                         "replay_tail_s": round(t_replay, 3),
                         "total_s": round(t_load + t_decode + t_replay, 3),
                         "digests_equal": copy.digests() == state.digests()}
    out["target_s"] = 5.0
    return out


def print_table(result: dict[str, Any]) -> None:
    st, snap, take, rest = result["state"], result["snapshot"], result["take"], result["restore"]
    rows: list[tuple[str, str]] = [
        ("state", f"{st['blocks']:,} blocks ({st['nodes']:,} nodes) over {st['workers']} "
                  f"workers; {st['kv_messages']:,} KV messages, built in {st['build_s']} s"),
        ("snapshot size", f"{snap['raw_bytes']:,} B raw, {snap['stored_bytes']:,} B stored "
                          f"({snap['stored_bytes_per_held_block']} B a held block; "
                          f"{snap['format']})"),
        ("take (best)", f"{take['total_s']:.3f} s = capture {take['capture_s']:.3f} (KV held) "
                        f"+ encode {take['encode_s']:.3f} + put {take['put_s']:.3f} "
                        f"(compress, sha256, write, prune); "
                        f"median {result['take_median_total_s']}"),
        ("restore (best)", f"{rest['total_s']:.3f} s = load {rest['load_s']:.3f} (fetch, verify, "
                           f"inflate) + decode {rest['decode_s']:.3f}; median "
                           f"{result['restore_median_total_s']}; digests equal: "
                           f"{rest['digests_equal']}"),
    ]
    rs = result.get("restart")
    if rs:
        tail, ip = rs["tail"], rs["in_process"]
        rows += [
            ("tail", f"{tail['events']:,} KV events in {tail['messages']:,} messages "
                     f"(state then {tail['blocks_after']:,} blocks)"),
            ("first start -> ready", f"{rs['first_start_ready_s']:.3f} s (snapshot, no tail)"),
            ("SIGKILL, restart -> ready", f"{rs['sigkill_restart_ready_s']:.3f} s "
                                          f"(restarted {result['params']['restart_via']}) "
                                          f"(target <= {rs['target_s']} s); digests equal: "
                                          f"{rs['digests_equal']}"),
            ("  its CPU to ready", f"{rs.get('sigkill_restart_cpu_to_ready_s', '?')} s "
                                 f"(user + system, the replica process)"),
            ("  of which", f"start -> snapshot restored "
                           f"{rs.get('start_to_snapshot_restored_s', '?')} s, then replay -> "
                           f"ready {rs.get('snapshot_restored_to_ready_s', '?')} s"),
            ("  same, in-process", f"{ip['total_s']:.3f} s = load {ip['load_s']:.3f} + decode "
                                   f"{ip['decode_s']:.3f} + replay tail {ip['replay_tail_s']:.3f}"),
        ]
    width = max(len(k) for k, _ in rows)
    print("jetrouter bench durability")
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")
