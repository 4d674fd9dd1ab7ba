"""The replica runtime: feeds the pure RouterState from JetStream and turns requests into decisions.

Thin adapter around the core (design.md §7): connect → ensure streams → replay each stream from
its position + 1 → ready once caught up → follow live. Routing decisions are appended to the router
stream before the request is proxied, so a replica killed mid-request leaves a trace every peer can
account for. A decision counts in this replica's load at once (the optimistic overlay) and is
reconciled when it comes back from the stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext
from tenacity import AsyncRetrying, retry_if_not_exception_type, stop_after_delay, wait_exponential

from eventlog import events as ev
from eventlog.appender import Appender, AppendFailed
from eventlog.connect import NatsConnectFatal, NatsOptions, connect
from eventlog.group_commit import GroupCommit
from eventlog.hashing import prompt_hashes
from eventlog.names import CONTROL, KV, ROUTER, STREAM_KINDS, Names
from eventlog.reader import StartPurged, StreamReader
from eventlog.streams import ensure_streams, stream_bounds
from replicas.core.index import WorkerKey
from replicas.core.queue import RequestQueue, should_queue
from replicas.core.selection import (
    BusyThresholds,
    Candidate,
    Decision,
    Overloaded,
    RoutingConfig,
    Selector,
)
from replicas.core.state import RouterState, StateConfig
from replicas.runtime.replication_cost import ReplicationCost

if TYPE_CHECKING:
    from replicas.runtime.durability import Durability

log = logging.getLogger("jetrouter.replica")

HEALTH_WEIGHT = {"healthy": 1.0, "suspicious": 0.5}


class _Rewind(Exception):
    """Raised inside a follower when a StateReset moved positions: restart the followers."""


class RoutingError(Exception):
    """Base of the request-level failures the HTTP layer maps to statuses."""


class NoWorkers(RoutingError):
    pass


class UnknownModel(RoutingError):
    def __init__(self, model: str, known: Sequence[str]) -> None:
        super().__init__(f"The model `{model}` does not exist. Available: {', '.join(known)}")
        self.model = model


class AllWorkersBusy(RoutingError):
    pass


class DecisionNotRecorded(RoutingError):
    """JetStream refused the routing decision's append or did not ack it in time: the request
    is not served (docs/design-notes.md, "when JetStream says no")."""

    def __init__(self, request_id: str, cause: BaseException) -> None:
        super().__init__(f"the routing decision could not be recorded ({_describe(cause)})")
        self.request_id = request_id
        self.cause = cause


def _describe(exc: BaseException) -> str:
    cause = getattr(exc, "cause", None) or exc  # AppendFailed carries the server's answer
    if isinstance(cause, TimeoutError):
        return "no acknowledgement from JetStream in time"
    text = str(cause).strip() or type(cause).__name__
    return f"{type(cause).__name__}: {text}"[:300]


@dataclass(slots=True)
class DecisionLogHealth:
    """What /ready, metrics and logs say about recording routing decisions on this replica."""

    failures: int = 0          # decisions refused or timed out since start
    last_error: str | None = None
    last_failure_at: float | None = None  # time.monotonic()
    failing_since: float | None = None    # wall time of the first failure of the current run
    recent_window: float = 5.0  # seconds a failure keeps /ready at 503 without a success

    def failing(self, now: float) -> bool:
        return self.last_failure_at is not None and now - self.last_failure_at < self.recent_window

    def view(self, now: float) -> dict[str, object]:
        return {"ok": not self.failing(now), "failures": self.failures,
                "last_error": self.last_error, "failing_since": self.failing_since}


@dataclass(frozen=True, slots=True)
class ReplicaConfig:
    replica_id: str
    nats_url: str
    namespace: str = "jr"
    state: StateConfig = field(default_factory=StateConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    default_thresholds: BusyThresholds = field(default_factory=BusyThresholds)
    queue_threshold: float | None = None
    queue_policy: str = "fcfs"
    queue_timeout: float = 30.0
    ready_lag: int = 0
    seed: int | None = None
    durable: bool = True  # snapshots, leader lease, reset (off only in narrow tests)
    snapshot_threshold: int = 1_000_000
    snapshot_keep: int = 3
    lease_ttl: float = 5.0
    database_url: str | None = None  # catalog + ledger projections (None: no projections)
    ledger_retention: float = 7 * 86400.0
    heartbeat_interval: float = 1.0
    replica_timeout: float = 10.0
    worker_timeout: float = 10.0
    canary_interval: float = 30.0  # 0 disables canaries
    canary_timeout: float = 5.0
    canary_recovery_timeout: float = 60.0
    # Longest a request waits for its routing decision to be acknowledged (retries included)
    # before it is refused with 503; covers a stream leader election after a NATS node loss.
    decision_append_timeout: float = 15.0
    stream_max_bytes: int | None = None  # per stream; None leaves the streams' limit as it is
    # Credentials and TLS (eventlog/connect.py); its servers are ignored: nats_url names them.
    nats: NatsOptions = field(default_factory=NatsOptions)

    @property
    def nats_options(self) -> NatsOptions:
        return self.nats.with_servers(self.nats_url)


@dataclass(frozen=True, slots=True)
class RouteRequest:
    request_id: str
    model: str
    token_ids: Sequence[int]
    expected_osl: int = 128
    priority: int = 0
    overlap_weight: float | None = None
    latency_sensitivity: float = 0.0
    exclude: frozenset[str] = frozenset()  # worker ids not to use (e.g. one that just failed)


@dataclass(slots=True)
class Routed:
    request_id: str
    worker_id: str
    worker_url: str
    dp_rank: int
    isl_tokens: int
    overlap_blocks: int
    total_blocks: int
    decision: Decision
    event: ev.RequestRouted
    timings: dict[str, float] = field(default_factory=dict)  # seconds per stage


@dataclass(slots=True)
class _Pending:
    worker: WorkerKey
    prefill_tokens: int
    new_blocks: int


class Replica:
    def __init__(self, config: ReplicaConfig) -> None:
        self.config = config
        self.replica_id = config.replica_id
        self.names = Names(config.namespace)
        self.state = RouterState(config.state)
        self.selector = Selector(config.routing)
        self.rng = random.Random(config.seed)
        self.nc: NatsClient | None = None
        self.js: JetStreamContext | None = None
        self.appender: Appender | None = None
        self.router_log: GroupCommit | None = None  # our router-stream events, group-committed
        self.replication = ReplicationCost()  # decoding + applying peers' router messages
        self.ready = False
        self.draining = False  # SIGTERM: no new requests, in-flight ones finish
        self._becoming_ready = False
        self._boot = f"{time.time_ns():x}"
        self.stream_last: dict[str, int] = {k: 0 for k in STREAM_KINDS}
        self.malformed: dict[str, int] = {k: 0 for k in STREAM_KINDS}  # by finished followers
        self._readers: dict[str, StreamReader] = {}
        self._catch_up_targets: dict[str, int] = {}
        self._supervisor: asyncio.Task[None] | None = None
        self.durability: Durability | None = None
        self.projections: Any = None  # snapshots.projections.Projections when enabled
        self._projector: asyncio.subprocess.Process | None = None
        self.liveness: Any = None  # replicas.runtime.liveness.Liveness when enabled
        self.canary: Any = None  # replicas.runtime.canary.CanaryChecker (acts only while leader)
        self.health_board: Any = None
        self._canary_client: Any = None
        self.on_health_check: Callable[[str, float, str], None] | None = None
        self.on_divergence: Callable[[object], None] | None = None
        self.restores = 0
        self._bg: set[asyncio.Task[object]] = set()
        self._pending: dict[str, _Pending] = {}
        self._overlay_prefill: dict[WorkerKey, int] = {}
        self._overlay_decode: dict[WorkerKey, int] = {}
        self._queue: RequestQueue = RequestQueue(config.queue_policy)
        self._load_changed = asyncio.Event()
        self._dispatcher: asyncio.Task[None] | None = None
        self._ready_event = asyncio.Event()
        self._reannounce_asked: set[str] = set()
        self.decision_log = DecisionLogHealth()
        # (reason) -> None: the HTTP layer's counter of decisions JetStream did not take.
        self.on_decision_refused: Callable[[str], None] | None = None
        self._refused_logged: set[str] = set()
        # Hooks for the HTTP layer's metrics (no prometheus in here).
        self.on_applied: Callable[[str, int, Sequence[ev.Event]], None] | None = None

    # --- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        # Bad credentials or TLS are not retried: NatsConnectFatal names the cause at once.
        async for attempt in AsyncRetrying(stop=stop_after_delay(30),
                                           wait=wait_exponential(0.1, max=2.0),
                                           retry=retry_if_not_exception_type(NatsConnectFatal),
                                           reraise=True):
            with attempt:
                self.nc = await connect(self.config.nats_options, name=self.replica_id,
                                        max_reconnect_attempts=-1, reconnect_time_wait=0.5,
                                        connect_timeout=2)
        assert self.nc is not None
        self.js = self.nc.jetstream()
        await ensure_streams(self.js, self.names, max_bytes=self.config.stream_max_bytes)
        # A stream leader election after a NATS node dies answers 'no responders' at once for
        # 4-9 s (nats-server's fixed Raft election timeout), and a publish that reached the dead
        # leader is never acked. Short ack waits and a 0.25 s backoff cap retry soon after the new
        # leader is up; the 20 s window bounds the whole wait (same msg id: applied once).
        self.appender = Appender(self.js, timeout=1.5, attempts=1000, backoff_max=0.25,
                                 retry_window=20.0)
        self.router_log = GroupCommit(self.appender, self.names.router_subject(self.replica_id),
                                      f"{self.replica_id}.{self._boot}")
        if self.config.durable:
            from replicas.runtime.durability import Durability

            self.durability = Durability(self, self.nc, self.js, self.names,
                                         snapshot_threshold=self.config.snapshot_threshold,
                                         keep=self.config.snapshot_keep,
                                         lease_ttl=self.config.lease_ttl)
            await self._restore("start-up")
        for kind in STREAM_KINDS:
            _, last = await stream_bounds(self.js, self.names.stream(kind))
            self._catch_up_targets[kind] = last
            self.stream_last[kind] = max(last, self.state.positions[kind])
        self._check_ready()
        self._supervisor = asyncio.create_task(self._supervise(), name="followers")
        self._dispatcher = asyncio.create_task(self._dispatch_queue(), name="queue-dispatcher")
        if self.config.database_url:
            await self._start_projections(self.config.database_url)
        if self.durability is not None:
            await self.durability.start()
            await self._start_liveness()
            if self.config.canary_interval > 0:
                await self._start_canary()

    async def _start_projections(self, url: str) -> None:
        """Catalog + ledger: written by a child process (off this process's interpreter),
        read here for the admin API."""
        import os
        import sys

        from snapshots.projections import Projections

        self.projections = Projections(url, ledger_retention=self.config.ledger_retention)
        await self.projections.start()  # creates the tables before the writer starts
        nats_opts = self.config.nats_options
        self._projector = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "snapshots.projector", "--nats-url", self.config.nats_url,
            *nats_opts.child_argv(),  # same identity as this replica; secrets via env below
            "--namespace", self.config.namespace, "--database-url", url,
            "--ledger-retention", str(self.config.ledger_retention), "--parent", str(os.getpid()),
            env={**os.environ, **nats_opts.child_env()})

    async def _start_liveness(self) -> None:
        from replicas.runtime.liveness import Heartbeat, Liveness, liveness_subject

        durability = self.durability
        assert durability is not None and self.appender is not None and self.js is not None
        appender = self.appender
        cfg = self.config

        def leader() -> bool:
            return durability.is_leader

        async def append(kind: str, event: ev.Event, msg_id: str) -> int:
            return await appender.append(liveness_subject(self.names, event), [event], msg_id)

        def divergence(d: object) -> None:
            if self.on_divergence is not None:
                self.on_divergence(d)

        self.liveness = Liveness(
            self.js, self.nc, self.names, self.replica_id,
            heartbeat_interval=cfg.heartbeat_interval, replica_timeout=cfg.replica_timeout,
            worker_timeout=cfg.worker_timeout,
            snapshot=lambda: Heartbeat(self.replica_id, time.time(), dict(self.state.positions),
                                       self.state.digests(), self.ready, leader()),
            append=append,
            is_leader=lambda: self.ready and leader(),
            known_workers=lambda: {w: i.url for w, i in self.state.workers.items()},
            known_replicas_with_load=lambda: self.state.load.replicas(),
            worker_incarnation=lambda w: self.state.workers[w].registered_ts,
            on_divergence=divergence)
        await self.liveness.start()

    async def _start_canary(self) -> None:
        import httpx

        from replicas.core.health import HealthBoard, HealthConfig, StatusChange
        from replicas.runtime.canary import CanaryChecker

        durability = self.durability
        assert durability is not None

        async def emit(change: StatusChange) -> None:
            if durability.is_leader:  # leadership may have moved during the round
                await self.append_control(change.event(),
                                          f"health.{change.worker_id}.{change.ts}.{change.new}",
                                          control_kind="health")

        self._canary_client = httpx.AsyncClient()
        self.health_board = HealthBoard(
            HealthConfig(recovery_timeout=self.config.canary_recovery_timeout))
        self.canary = CanaryChecker(
            self._canary_client, self.health_board, interval=self.config.canary_interval,
            timeout=self.config.canary_timeout,
            model_of=lambda w: self.state.workers[w].model,
            workers=lambda: {w: i.url for w, i in self.state.workers.items()},
            emit=emit, is_leader=lambda: durability.is_leader,
            statuses=lambda: self.state.health, nc=self.nc, names=self.names,
            on_check=self.on_health_check)
        await self.canary.start()

    async def wait_ready(self, timeout: float | None = None) -> None:
        await asyncio.wait_for(self._ready_event.wait(), timeout)

    async def stop(self) -> None:
        self.ready = False
        if self.liveness is not None:
            with contextlib.suppress(Exception):
                await self.liveness.stop()
        if self.canary is not None:
            with contextlib.suppress(Exception):
                await self.canary.stop()
            await self._canary_client.aclose()
        if self.durability is not None:
            await self.durability.stop()
        if self._projector is not None and self._projector.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self._projector.terminate()
            try:
                await asyncio.wait_for(self._projector.wait(), 5)
            except TimeoutError:
                self._projector.kill()
        if self.projections is not None:
            with contextlib.suppress(Exception):
                await self.projections.close()
        tasks = [t for t in (self._supervisor, self._dispatcher) if t is not None]
        for t in tasks:
            t.cancel()
        if self.router_log is not None:
            await self.router_log.flush()  # prefill completions and ends still lingering
        if self._bg:
            await asyncio.wait(self._bg, timeout=5)
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self.nc is not None and not self.nc.is_closed:
            with contextlib.suppress(Exception):
                await self.nc.drain()

    # --- snapshots ---------------------------------------------------------------------------

    async def _restore(self, why: str) -> bool:
        """Replace the state with the newest valid snapshot if it is ahead of ours."""
        assert self.durability is not None
        found = await self.durability.store.load_newest_valid()
        if found is None:
            return False
        meta, blob = found[0], found[1]
        # Decoding a large state takes a while: off the loop, so heartbeats and the lease go on.
        candidate = await asyncio.to_thread(RouterState.decode, blob, self.config.state)
        ours = self.state.positions
        if candidate.epoch < self.state.epoch or all(
                candidate.positions[k] <= ours[k] for k in STREAM_KINDS):
            return False
        self.state = candidate
        self.restores += 1
        log.warning("replica %s loaded snapshot %s at %s (%s)", self.replica_id,
                    meta.snapshot_id, candidate.positions, why)
        return True

    # --- following the streams --------------------------------------------------------------

    async def _supervise(self) -> None:
        """Run one follower per stream; a purge under us means reload from the snapshot, a
        StateReset means re-read from its cut; anything else restarts the followers from the
        positions the state has applied (nothing is lost or applied twice)."""
        backoff = 0.2
        while True:
            followers = [asyncio.create_task(self._follow(k), name=f"follow-{k}")
                         for k in STREAM_KINDS]
            done, pending = await asyncio.wait(followers, return_when=asyncio.FIRST_EXCEPTION)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            errors = [t.exception() for t in done if not t.cancelled() and t.exception()]
            purged = [e for e in errors if isinstance(e, StartPurged)]
            if any(isinstance(e, _Rewind) for e in errors) and not purged:
                backoff = 0.2
                continue
            if purged:
                reloaded = self.durability is not None and await self._restore(str(purged[0]))
                if not reloaded:
                    log.error("%s and no snapshot covers it yet; retrying", purged[0])
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, 5.0)
                else:
                    backoff = 0.2
                continue
            for e in errors:
                log.error("stream follower failed (%s: %s); restarting from applied positions",
                          type(e).__name__, e)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)

    async def _follow(self, kind: str) -> None:
        assert self.js is not None
        stream = self.names.stream(kind)
        reader = StreamReader(self.js, stream, start_seq=self.state.positions[kind] + 1)
        self._readers[kind] = reader
        try:
            own = self.names.router_subject(self.replica_id)
            async for seq, batch in reader:
                if kind == ROUTER and reader.last_subject != own:
                    t0 = time.thread_time()
                    self._apply(kind, seq, batch, reader)
                    self.replication.note(time.thread_time() - t0 + reader.last_decode_s,
                                          len(batch))
                else:
                    self._apply(kind, seq, batch, reader)
        finally:
            self._readers.pop(kind, None)
            self.malformed[kind] += reader.malformed
            with contextlib.suppress(Exception):
                await reader.close()

    def _apply(self, kind: str, seq: int, batch: Sequence[ev.Event], reader: StreamReader) -> None:
        before = (self.state.epoch, self.state.positions[KV], self.state.positions[ROUTER])
        self.state.apply(kind, seq, batch)
        self.stream_last[kind] = max(self.stream_last[kind], seq + reader.pending)
        if kind == ROUTER:
            for e in batch:
                if isinstance(e, ev.RequestRouted):
                    self._reconcile(e.request_id)
            self._load_changed.set()
        elif kind == KV:
            if self.state.out_of_sync:
                self._ask_reannounce()
            if self.state.refused_workers.keys() != self._refused_logged:
                self._log_refusals()
        elif kind == CONTROL:
            self._load_changed.set()
        if self.on_applied is not None:
            self.on_applied(kind, seq, batch)
        if not self.ready:
            self._check_ready()
        if kind == CONTROL and self.state.epoch != before[0] and (
                self.state.positions[KV], self.state.positions[ROUTER]) != before[1:]:
            # A StateReset moved the other streams' positions to its cut: re-read from there.
            self._pending.clear()
            self._overlay_prefill.clear()
            self._overlay_decode.clear()
            raise _Rewind()

    def _log_refusals(self) -> None:
        """One clear line when a worker becomes refused (a bad block size in its registration)."""
        refused = self.state.refused_workers
        for worker_id in refused.keys() - self._refused_logged:
            info = refused[worker_id]
            log.error("worker %s (%s) refused: %s; it is never indexed nor routed to until it "
                      "registers again with --kv-cache-block-size %d", worker_id, info.url,
                      self.state.refusal_reason(worker_id), self.config.state.block_size)
        self._refused_logged = set(refused)

    def _check_ready(self) -> None:
        if self.draining:
            return
        lag = self.config.ready_lag
        if self._becoming_ready or not all(
                self.state.positions[k] + lag >= self._catch_up_targets.get(k, 0)
                for k in STREAM_KINDS):
            return
        self._becoming_ready = True
        if self.replica_id in self.state.load.replicas():
            # A previous incarnation of this replica died with requests in flight and we came
            # back before anyone declared it lost: free them now, before routing anything new
            # (same connection, so our own ReplicaLost precedes our first RequestRouted).
            self._spawn(self._free_previous_incarnation())
        else:
            self._mark_ready()

    def _mark_ready(self) -> None:
        self.ready = True
        self._ready_event.set()

    async def _free_previous_incarnation(self) -> None:
        event = ev.ReplicaLost(self.replica_id, time.time())
        try:
            await self._append(ROUTER, event, f"lost.{self.replica_id}.boot.{self._boot}")
            log.warning("replica %s freed the requests its previous incarnation left in flight",
                        self.replica_id)
        finally:
            self._mark_ready()

    def malformed_counts(self) -> dict[str, int]:
        """Malformed messages skipped per stream, including the running followers' counts."""
        return {k: self.malformed[k] + (r.malformed if (r := self._readers.get(k)) else 0)
                for k in STREAM_KINDS}

    def lag(self) -> dict[str, int]:
        return {k: max(self.stream_last[k] - self.state.positions[k], 0) for k in STREAM_KINDS}

    def _ask_reannounce(self) -> None:
        assert self.nc is not None
        for worker_id in self.state.out_of_sync - self._reannounce_asked:
            self._reannounce_asked.add(worker_id)
            self._spawn(self.nc.publish(self.names.reannounce_subject(worker_id), b""))
        self._reannounce_asked &= self.state.out_of_sync

    # --- routing -----------------------------------------------------------------------------

    def models(self) -> list[str]:
        return sorted({m for w in self.state.workers.values() for m in (w.model, *w.loras)})

    def _adapter(self, model: str) -> str | None:
        """``model`` if it names a LoRA adapter some worker serves (its blocks hash salted),
        else None (a base model)."""
        workers = self.state.workers.values()
        if any(w.model == model for w in workers):
            return None
        return model if any(model in w.loras for w in workers) else None

    def thresholds_for(self, model: str) -> BusyThresholds:
        return self.state.thresholds_for(model) or self.config.default_thresholds

    def candidates(self, model: str, seq_hashes: Sequence[int],
                   exclude: frozenset[str] = frozenset()) -> list[Candidate]:
        state = self.state
        scores = state.index.find_matches(seq_hashes)
        out: list[Candidate] = []
        n = len(seq_hashes)
        load = state.load
        for w in state.workers.values():
            if (w.model != model and model not in w.loras) or w.worker_id in exclude:
                continue
            weight = HEALTH_WEIGHT.get(state.health.get(w.worker_id, "healthy"), 0.0)
            if weight <= 0.0:
                continue
            for rank in range(w.dp_size):
                key = (w.worker_id, rank)
                active_prefix = load.active_prefix_len(key, seq_hashes) if n else 0
                out.append(Candidate(
                    worker=key,
                    overlap_blocks=scores.scores.get(key, 0),
                    tree_size=scores.tree_sizes.get(key, 0),
                    active_prefill_tokens=load.active_prefill_tokens(key)
                    + self._overlay_prefill.get(key, 0),
                    active_decode_blocks=load.active_decode_blocks(key)
                    + self._overlay_decode.get(key, 0),
                    new_request_blocks=n - active_prefix,
                    kv_total_blocks=w.kv_total_blocks,
                    max_num_batched_tokens=w.max_num_batched_tokens,
                    weight=weight,
                ))
        return out

    def _decide(
        self, req: RouteRequest
    ) -> tuple[Decision | Overloaded, list[int], dict[str, float]]:
        if not self.state.workers:
            refused = sorted(self.state.refused_workers)
            if refused:
                raise NoWorkers(f"no usable inference workers: {', '.join(refused)} refused ("
                                f"{self.state.refusal_reason(refused[0])})")
            raise NoWorkers("no inference workers are registered yet")
        if not any(w.model == req.model or req.model in w.loras
                   for w in self.state.workers.values()):
            raise UnknownModel(req.model, self.models())
        t0 = time.perf_counter()
        seq_hashes = prompt_hashes(req.token_ids, self.config.state.block_size,
                                   adapter=self._adapter(req.model))
        t1 = time.perf_counter()
        cands = self.candidates(req.model, seq_hashes, req.exclude)
        t2 = time.perf_counter()
        thresholds = self.thresholds_for(req.model)
        self.selector.config = _with_thresholds(self.selector.config, thresholds)
        result = self.selector.select(cands, len(req.token_ids), self.rng,
                                      overlap_weight=req.overlap_weight)
        t3 = time.perf_counter()
        return result, seq_hashes, {"hashing": t1 - t0, "matching": t2 - t1,
                                    "selection": t3 - t2, "total": t3 - t0}

    async def route(self, req: RouteRequest) -> Routed:
        """Decide, count the decision in our load at once, append it, hand back the worker."""
        if self.config.queue_threshold is not None and self._must_queue(req):
            fut: asyncio.Future[Routed] = asyncio.get_running_loop().create_future()
            self._queue.push((req, fut), arrival=time.monotonic(),
                             priority_jump=req.latency_sensitivity,
                             uncached_isl_tokens=len(req.token_ids))
            self._load_changed.set()
            try:
                routed = await asyncio.wait_for(asyncio.shield(fut), self.config.queue_timeout)
            except TimeoutError:
                with contextlib.suppress(ValueError):
                    self._queue.remove((req, fut))
                if fut.done() and not fut.cancelled() and fut.exception() is None:
                    self._reconcile(req.request_id)
                raise AllWorkersBusy("waited too long in the router queue") from None
        else:
            routed = self._prepare(req)
        try:
            await asyncio.wait_for(
                self._append(ROUTER, routed.event, f"{req.request_id}.routed"),
                self.config.decision_append_timeout)
        except (AppendFailed, TimeoutError) as exc:
            self._reconcile(req.request_id)  # the overlay must not keep what the log refused
            self._decision_refused(req.request_id, exc)
            raise DecisionNotRecorded(req.request_id, exc) from exc
        except BaseException:
            self._reconcile(req.request_id)
            raise
        if self.decision_log.last_failure_at is not None:
            log.warning("replica %s records routing decisions again (after %d refused)",
                        self.replica_id, self.decision_log.failures)
            self.decision_log.last_failure_at = None
            self.decision_log.failing_since = None
        return routed

    def _decision_refused(self, request_id: str, exc: BaseException) -> None:
        """Count and log a decision JetStream did not take, and make sure it never counts:
        an append that timed out may still land later, so a RequestFinished follows it (same
        subject and connection, hence after it on the stream); if the decision never landed,
        that finish is a no-op for every replica."""
        health = self.decision_log
        why = _describe(exc)
        reason = "timeout" if isinstance(exc, TimeoutError) or isinstance(
            getattr(exc, "cause", None), TimeoutError) else "refused"
        health.failures += 1
        health.last_error = why
        health.last_failure_at = time.monotonic()
        if health.failing_since is None:
            health.failing_since = time.time()
            log.error("replica %s: JetStream did not take the routing decision of %s (%s); "
                      "refusing requests with 503 until it does", self.replica_id, request_id,
                      why)
        else:
            log.warning("replica %s: routing decision of %s not recorded (%s)", self.replica_id,
                        request_id, why)
        if self.on_decision_refused is not None:
            self.on_decision_refused(reason)
        self._spawn(self._append(ROUTER, ev.RequestFinished(request_id, "not_routed", 0,
                                                            time.time()),
                                 f"{request_id}.finished"))

    def _prepare(self, req: RouteRequest) -> Routed:
        """Synchronous part of routing: select and add the decision to the overlay."""
        result, seq_hashes, timings = self._decide(req)
        if isinstance(result, Overloaded):
            raise AllWorkersBusy(result.reason)
        worker_id, dp_rank = result.worker
        info = self.state.workers[worker_id]
        event = ev.RequestRouted(
            request_id=req.request_id, replica_id=self.replica_id, worker_id=worker_id,
            dp_rank=dp_rank, isl_tokens=len(req.token_ids), block_seq_hashes=list(seq_hashes),
            overlap_blocks=result.overlap_blocks, expected_osl=req.expected_osl,
            priority=req.priority, ts=time.time(), candidates=result.costs.rows(),
            model=req.model, block_size=self.config.state.block_size)
        prefill = max(len(req.token_ids) - result.overlap_blocks * info.block_size, 0)
        new_blocks = len(seq_hashes) - self.state.load.active_prefix_len(result.worker,
                                                                         seq_hashes)
        self._add_overlay(req.request_id, _Pending(result.worker, prefill, new_blocks))
        return Routed(req.request_id, worker_id, info.url, dp_rank, len(req.token_ids),
                      result.overlap_blocks, len(seq_hashes), result, event, timings)

    def _must_queue(self, req: RouteRequest) -> bool:
        threshold = self.config.queue_threshold
        assert threshold is not None
        if len(self._queue):
            return True  # keep arrival order: nobody overtakes the queue
        cands = self.candidates(req.model, ())
        return bool(cands) and should_queue(cands, threshold)

    def prefill_completed(self, request_id: str) -> None:
        self._append_lazy(ev.PrefillCompleted(request_id, time.time()))

    def finished(self, request_id: str, outcome: str, output_tokens: int,
                 cached_tokens: int = -1) -> None:
        self._reconcile(request_id)
        self._append_lazy(ev.RequestFinished(request_id, outcome, output_tokens, time.time(),
                                             cached_tokens))

    # --- config changes through the control stream -------------------------------------------

    async def set_busy_thresholds(self, model: str, decode_blocks: float | None,
                                  prefill_tokens: int | None,
                                  prefill_tokens_frac: float | None) -> None:
        event = ev.BusyThresholdsSet(model, decode_blocks, prefill_tokens, prefill_tokens_frac,
                                     time.time())
        seq = await self._append(CONTROL, event, None, control_kind="thresholds")
        await self.wait_applied(CONTROL, seq)

    async def wait_applied(self, kind: str, seq: int, timeout: float = 10.0) -> None:
        """Wait until this replica's state has applied `seq` of a stream (read-your-writes)."""
        deadline = time.monotonic() + timeout
        while self.state.positions[kind] < seq:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{kind} stream not applied up to {seq}")
            self._load_changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._load_changed.wait(), 0.05)

    async def set_snapshot_threshold(self, threshold: int) -> None:
        seq = await self.append_control(ev.SnapshotThresholdSet(threshold, time.time()), None,
                                        control_kind="snapshot-threshold")
        await self.wait_applied(CONTROL, seq)

    async def peers_view(self) -> list[dict[str, object]]:
        """What /admin/replicas shows: every live replica's heartbeat (liveness, issue 5)."""
        if self.liveness is None:
            return [self._self_view()]
        return await self.liveness.view()

    def _self_view(self) -> dict[str, object]:
        return {"replica_id": self.replica_id, "ready": self.ready,
                "leader": bool(self.durability and self.durability.is_leader),
                "positions": dict(self.state.positions),
                "digests": {k: f"{v:016x}" for k, v in self.state.digests().items()},
                "age_s": 0.0, "divergent": False}

    # --- internals ----------------------------------------------------------------------------

    async def append_control(self, event: ev.Event, msg_id: str | None, *,
                             control_kind: str = "config") -> int:
        return await self._append(CONTROL, event, msg_id, control_kind=control_kind)

    async def _append(self, kind: str, event: ev.Event, msg_id: str | None, *,
                      control_kind: str = "config", urgent: bool = True) -> int:
        """Router events are group-committed (the message id is the batch's, so ``msg_id`` is
        not used for them); ``urgent=False`` lets an event wait for the next message."""
        assert self.appender is not None
        if kind == ROUTER:
            assert self.router_log is not None
            return await self.router_log.append(event, urgent=urgent)
        if kind == CONTROL:
            subject = self.names.control_subject(control_kind)
        else:
            raise ValueError("replicas append only to the router and control streams")
        mid = msg_id or f"{self.replica_id}.{time.time_ns()}.{self.rng.getrandbits(32)}"
        return await self.appender.append(subject, [event], mid)

    def _append_lazy(self, event: ev.Event) -> None:
        """Queue a router event that may wait for the next message (no task per event)."""
        assert self.router_log is not None
        self.router_log.submit(event, urgent=False).add_done_callback(self._bg_done)

    def _spawn(self, coro: object) -> None:
        task = asyncio.ensure_future(coro)  # type: ignore[arg-type]
        self._bg.add(task)
        task.add_done_callback(self._bg_done)

    def _bg_done(self, task: asyncio.Future[object]) -> None:
        self._bg.discard(task)  # type: ignore[arg-type]
        if not task.cancelled() and task.exception() is not None:
            log.error("background append failed: %s", task.exception())

    def _add_overlay(self, request_id: str, p: _Pending) -> None:
        self._pending[request_id] = p
        self._overlay_prefill[p.worker] = self._overlay_prefill.get(p.worker, 0) + p.prefill_tokens
        self._overlay_decode[p.worker] = self._overlay_decode.get(p.worker, 0) + p.new_blocks

    def _reconcile(self, request_id: str) -> None:
        p = self._pending.pop(request_id, None)
        if p is None:
            return
        self._overlay_prefill[p.worker] -= p.prefill_tokens
        self._overlay_decode[p.worker] -= p.new_blocks

    async def _dispatch_queue(self) -> None:
        """Release queued requests in policy order while some worker has capacity. The decision
        is made here, synchronously, so each release already counts in the load the next
        release is judged by."""
        threshold = self.config.queue_threshold
        while True:
            await self._load_changed.wait()
            self._load_changed.clear()
            if threshold is None:
                continue
            while len(self._queue):
                cands = [c for m in self.models() for c in self.candidates(m, ())]
                if cands and should_queue(cands, threshold):
                    break
                item = self._queue.pop()
                if item is None:
                    break
                req, fut = item
                if fut.done():
                    continue
                try:
                    fut.set_result(self._prepare(req))
                except RoutingError as exc:
                    fut.set_exception(exc)

    def pending_decisions(self) -> int:
        """Decisions in the optimistic overlay: routed here, not yet applied from the stream."""
        return len(self._pending)

    def queue_depth(self) -> int:
        return len(self._queue)


def _with_thresholds(cfg: RoutingConfig, t: BusyThresholds) -> RoutingConfig:
    if cfg.thresholds == t:
        return cfg
    return replace(cfg, thresholds=t)  # keeps every other routing field
