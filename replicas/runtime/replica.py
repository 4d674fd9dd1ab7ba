"""The replica: composes the runtime around the pure `RouterState` (design.md §7).

connect → ensure streams → (load the newest snapshot) → replay each stream from its position + 1
→ ready once caught up → follow live. The parts, each in its own module:

* `follower.StreamFollower` owns the state and feeds it from the event log
  (`eventlog.log.EventLog`: JetStream, or the in-memory log in tests; replay, follow, rewind);
* `dispatcher.Dispatcher` turns requests into decisions (decide → overlay → append);
* `leader.Leader` does the leader-only work (lease, snapshots, purge, reset, canaries);
* `liveness.Liveness` heartbeats and, while leading, declares lost replicas and dead workers;
* `log_outage.LogOutage` says whether the log can take appends (degraded mode while it cannot:
  the connection callbacks here and `log_watchdog.LogWatchdog` feed it; the watchdog also
  re-seeds a log NATS lost, `reseed`).

They see the replica only through `port.ReplicaPort`, which `Replica` implements.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import sys
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol

from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext
from tenacity import AsyncRetrying, retry_if_not_exception_type, stop_after_delay, wait_exponential

from eventlog import events as ev
from eventlog.appender import Appender, AppendFailed
from eventlog.connect import NatsConnectFatal, connect
from eventlog.group_commit import GroupCommit
from eventlog.jetstream_log import JetStreamLog
from eventlog.log import EventLog
from eventlog.names import CONTROL, KV, ROUTER, Names
from replicas.core.candidates import is_disaggregated, served_models
from replicas.core.health import HealthBoard
from replicas.core.index import WorkerKey
from replicas.core.routing_errors import AllWorkersBusy, NoWorkers, RoutingError, UnknownModel
from replicas.core.selection import BusyThresholds
from replicas.core.state import RouterState
from replicas.core.stored_responses import Lookup
from replicas.core.tenant_admission import Verdict
from replicas.core.tenants import TenantLimits
from replicas.runtime.background import Background
from replicas.runtime.config import ReplicaConfig
from replicas.runtime.decision_log import DecisionLogHealth, DecisionNotRecorded
from replicas.runtime.dispatcher import Dispatcher, Routed, RouteRequest
from replicas.runtime.follower import AppliedMessages, StreamFollower
from replicas.runtime.leader import Leader
from replicas.runtime.liveness import Liveness, release
from replicas.runtime.log_outage import LogOutage, LogUnavailable
from replicas.runtime.log_watchdog import LogWatchdog
from replicas.runtime.replication_cost import ReplicationCost
from snapshots.store import SnapshotStore

if TYPE_CHECKING:  # imported when configured: it loads SQLAlchemy
    from snapshots.projections import Projections

__all__ = [
    "AllWorkersBusy",
    "DecisionLogHealth",
    "DecisionNotRecorded",
    "Lookup",
    "NoWorkers",
    "Replica",
    "ReplicaConfig",
    "RouteRequest",
    "RouteTracer",
    "Routed",
    "RoutingError",
    "UnknownModel",
]

log = logging.getLogger("jetrouter.replica")


class RouteTracer(Protocol):
    """What the HTTP layer's tracing (api/tracing.py) wraps: every routing decision, whoever
    asks for it (the first hop, the prefill hop, a migration), and every hop's end."""

    async def route(self, req: RouteRequest,
                    route: Callable[[RouteRequest], Awaitable[Routed]]) -> Routed: ...

    def finished(self, request_id: str, outcome: str) -> None: ...


class Replica:
    """``log``: the event log to use instead of connecting to JetStream (the in-memory one, say);
    durability (snapshots, the leader lease, liveness) needs JetStream, so it must be off."""

    def __init__(self, config: ReplicaConfig, *, log: EventLog | None = None) -> None:
        if log is not None and config.durable:
            raise ValueError("durability (snapshots, leader lease, reset) needs JetStream: "
                             "give an event log only with durable=False")
        self.log: EventLog | None = log
        self.config = config
        self.replica_id = config.replica_id
        self.names = Names(config.namespace)
        self.rng = random.Random(config.seed)
        self.nc: NatsClient | None = None
        self.js: JetStreamContext | None = None
        self.appender: Appender | None = None
        self.router_log: GroupCommit | None = None  # our router-stream events, group-committed
        self.ready = False
        self.draining = False  # SIGTERM: no new requests, in-flight ones finish
        self.background = Background()
        self.follower = StreamFollower(self.names, config.state, self, replica_id=self.replica_id)
        self.dispatcher = Dispatcher(self, config, self.rng, self.background)
        self.leader: Leader | None = None  # with durability (snapshots, lease, reset)
        self.liveness: Liveness | None = None
        self.projections: Projections | None = None  # catalog + ledger, when configured
        self._projector: asyncio.subprocess.Process | None = None
        # Observers for the HTTP layer's metrics (no prometheus in here).
        self.on_health_check: Callable[[str, float, str], None] | None = None
        self.on_divergence: Callable[[object], None] | None = None
        # Spans around routing decisions and hop ends (api/tracing.py); None: tracing off.
        self.tracer: RouteTracer | None = None
        self._becoming_ready = False
        self._boot = f"{time.time_ns():x}"
        self._ready_event = asyncio.Event()
        self._applied = asyncio.Event()  # some event was applied (wait_applied re-checks)
        # worker id -> monotonic time its last KV message was applied: the engine is computing
        # (how a busy engine is told from a hung one before its answer's first byte,
        # api/forward/first_byte.py)
        self.kv_heard: dict[str, float] = {}
        self._reannounce_asked: set[str] = set()
        self._refused_logged: set[str] = set()
        self.watchdog: LogWatchdog | None = None

    # --- the port the adapters see (replicas.runtime.port.ReplicaPort) -------------------------

    @property
    def state(self) -> RouterState:
        return self.follower.state

    @property
    def is_leader(self) -> bool:
        return self.leader is not None and self.leader.is_leader

    async def append(self, subject: str, event: ev.Event | list[ev.Event],
                     msg_id: str | None) -> int:
        """Our own router subject is group-committed (the message id is the message's, so
        ``msg_id`` is not used there; events given together are queued together, so they share
        a message); any other subject gets one message per call."""
        assert self.log is not None
        events = event if isinstance(event, list) else [event]
        if self.router_log is not None and subject == self.router_log.subject:
            # Held through an outage by the group commit (it must land: a finish, a progress).
            futures = [self.router_log.submit(e) for e in events]
            seqs = await asyncio.gather(*futures)
            return max(seqs)
        mid = msg_id or f"{self.replica_id}.{time.time_ns()}.{self.rng.getrandbits(32)}"
        if self.outage.degraded(time.monotonic()):
            # A config change, a snapshot's record, a health change: no at once rather than
            # after the appender's 20 s of retries (an admin call answers 503).
            raise AppendFailed(subject, mid, LogUnavailable())
        return await self.log.append(subject, event if isinstance(event, list) else [event], mid)

    def submit(self, subject: str, events: list[ev.Event],
               msg_id: str) -> asyncio.Future[int]:
        """Queue ``events`` now (as one message where they fit) and hand back the future of
        their append without waiting: on our group-committed router subject the message's own
        id is used; elsewhere ``msg_id``."""
        if self.router_log is not None and subject == self.router_log.subject:
            futures = [self.router_log.submit(e) for e in events]
            return futures[0] if len(futures) == 1 else _joined(futures)
        return asyncio.ensure_future(self.append(subject, events, msg_id))

    async def stream_end(self, kind: str) -> int:
        assert self.log is not None
        _, last = await self.log.bounds(self.names.stream(kind))
        return last

    def append_later(self, subject: str, event: ev.Event) -> None:
        if self.router_log is not None and subject == self.router_log.subject:
            # a future, not a task: one per event would cost more than the event's append
            self.background.spawn(self.router_log.submit(event, urgent=False))
        else:
            self.background.spawn(self.append(subject, event, None))

    async def wait_ready(self, timeout: float | None = None) -> None:
        await asyncio.wait_for(self._ready_event.wait(), timeout)

    async def wait_applied(self, kind: str, seq: int, timeout: float = 10.0) -> None:
        """Wait until this replica's state has applied `seq` of a stream (read-your-writes)."""
        deadline = time.monotonic() + timeout
        while self.state.positions[kind] < seq:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{kind} stream not applied up to {seq}")
            self._applied.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._applied.wait(), 0.05)

    # --- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        cfg = self.config
        store: SnapshotStore | None = None
        if self.log is None:
            store = await self._connect()
        else:
            await self.log.ensure_streams(self.names, max_bytes=cfg.stream_max_bytes)
        assert self.log is not None
        self.follower.connect(self.log, store)
        if store is not None:
            assert self.nc is not None and self.js is not None
            self.leader = Leader(self, self.nc, self.js, store, hold_kv=self.follower.hold_kv,
                                 snapshot_threshold=cfg.snapshot_threshold,
                                 lease_ttl=cfg.lease_ttl)
            await self.follower.restore("start-up")
        await self.follower.measure_catch_up()
        self._check_ready()
        self.follower.start()
        self.dispatcher.start()
        if self.nc is not None and self.js is not None:
            self.watchdog = LogWatchdog(self.outage, self.js, self.nc, self.names,
                                        self.follower, cfg, reopen=self._reopen_buckets)
            self.watchdog.start()
        if cfg.database_url:
            await self._start_projections(cfg.database_url)
        if self.leader is not None:
            assert self.nc is not None and self.js is not None
            await self.leader.start()
            self.liveness = Liveness(
                self, self.js, self.nc, heartbeat_interval=cfg.heartbeat_interval,
                replica_timeout=cfg.replica_timeout, worker_timeout=cfg.worker_timeout,
                on_divergence=self._divergence)
            await self.liveness.start()
            if cfg.canary_interval > 0:
                await self.leader.start_canaries(
                    interval=cfg.canary_interval, timeout=cfg.canary_timeout,
                    recovery_timeout=cfg.canary_recovery_timeout, on_check=self._health_checked)

    async def _connect(self) -> SnapshotStore | None:
        """Connect to NATS and use its JetStream streams as the event log; the snapshot store
        when durable."""
        # Bad credentials or TLS are not retried: NatsConnectFatal names the cause at once.
        async for attempt in AsyncRetrying(stop=stop_after_delay(30),
                                           wait=wait_exponential(0.1, max=2.0),
                                           retry=retry_if_not_exception_type(NatsConnectFatal),
                                           reraise=True):
            with attempt:
                self.nc = await connect(self.config.nats_options, name=self.replica_id,
                                        max_reconnect_attempts=-1, reconnect_time_wait=0.5,
                                        connect_timeout=2,
                                        disconnected_cb=self._disconnected,
                                        reconnected_cb=self._reconnected)
        assert self.nc is not None
        self.js = js = self.nc.jetstream()
        jetstream = JetStreamLog(js)
        await jetstream.ensure_streams(self.names, max_bytes=self.config.stream_max_bytes)
        # A stream leader election after a NATS node dies answers 'no responders' at once for
        # 4-9 s (nats-server's fixed Raft election timeout), and a publish that reached the dead
        # leader is never acked. Short ack waits and a 0.25 s backoff cap retry soon after the new
        # leader is up; the 20 s window bounds the whole wait (same msg id: applied once).
        self.appender = jetstream.appender = Appender(js, timeout=1.5, attempts=1000,
                                                      backoff_max=0.25, retry_window=20.0)
        self.log = jetstream
        self.router_log = GroupCommit(self.appender, self.names.router_subject(self.replica_id),
                                      f"{self.replica_id}.{self._boot}",
                                      hold=lambda: self.outage.degraded_since is not None)
        cfg = self.config
        return SnapshotStore(js, self.names, keep=cfg.snapshot_keep) if cfg.durable else None

    # --- degraded mode (log_outage.LogOutage) --------------------------------------------------

    @property
    def outage(self) -> LogOutage:
        return self.dispatcher.outage

    async def _disconnected(self) -> None:
        self.outage.connection_lost(time.monotonic())

    async def _reconnected(self) -> None:
        self.outage.connection_back()

    async def _reopen_buckets(self) -> None:
        """NATS lost its storage and the log was re-seeded: the lease and heartbeat buckets are
        opened (so created) again."""
        if self.leader is not None:
            self.leader.lease.reopen()
        if self.liveness is not None:
            await self.liveness.reopen_bucket()

    def _divergence(self, d: object) -> None:
        if self.on_divergence is not None:
            self.on_divergence(d)

    def _health_checked(self, worker_id: str, seconds: float, outcome: str) -> None:
        if self.on_health_check is not None:
            self.on_health_check(worker_id, seconds, outcome)

    async def _start_projections(self, url: str) -> None:
        """Catalog + ledger: written by a child process (off this process's interpreter),
        read here for the admin API."""
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

    async def stop(self) -> None:
        self.ready = False
        if self.watchdog is not None:
            await self.watchdog.stop()
        if self.liveness is not None:
            with contextlib.suppress(Exception):
                await self.liveness.stop()
        if self.leader is not None:
            await self.leader.stop()
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
        await self.follower.stop()
        await self.dispatcher.stop()
        if self.router_log is not None:
            await self.router_log.flush()  # prefill completions and ends still lingering
        await self.background.wait(timeout=5)
        if self.nc is not None and not self.nc.is_closed:
            with contextlib.suppress(Exception):
                await self.nc.drain()

    # --- after each applied batch (follower.StreamListener) ----------------------------------

    def stream_applied(self, kind: str, messages: AppliedMessages) -> None:
        if kind == ROUTER:
            for _, batch in messages:
                for e in batch:
                    if isinstance(e, ev.RequestRouted):
                        self.dispatcher.settle(e.request_id)
            self.dispatcher.load_changed.set()
        elif kind == KV:
            now, heard = time.monotonic(), self.kv_heard
            for _, batch in messages:
                if batch and (worker_id := getattr(batch[0], "worker_id", None)) is not None:
                    heard[worker_id] = now
            if self.state.out_of_sync:  # once a slice of messages: after its last one
                self._ask_reannounce()
            if self.state.refused_workers.keys() != self._refused_logged:
                self._log_refusals()
        elif kind == CONTROL:
            self.dispatcher.load_changed.set()
        self._applied.set()
        if not self.ready:
            self._check_ready()

    def kv_heard_ago(self, worker_id: str) -> float | None:
        """Seconds since a KV message of ``worker_id`` was last applied here (None: none)."""
        heard = self.kv_heard.get(worker_id)
        return None if heard is None else time.monotonic() - heard

    def stream_rewound(self) -> None:
        self.dispatcher.forget_pending()

    def stream_blocked(self, kind: str, reason: str) -> None:
        # Routing on a state that stopped applying one stream would route on stale facts, and
        # a load balancer must send the traffic to replicas that read every message.
        self.ready = False

    def _log_refusals(self) -> None:
        """One clear line when a worker becomes refused (a bad block size in its registration)."""
        refused = self.state.refused_workers
        for worker_id in refused.keys() - self._refused_logged:
            info = refused[worker_id]
            log.error("worker %s (%s) refused: %s; it is never indexed nor routed to until it "
                      "registers again with --kv-cache-block-size %d", worker_id, info.url,
                      self.state.refusal_reason(worker_id), self.config.state.block_size)
        self._refused_logged = set(refused)

    def _ask_reannounce(self) -> None:
        nc = self.nc
        if nc is None:  # an event log without NATS: no engine to ask
            return
        out_of_sync = self.state.out_of_sync
        for worker_id in out_of_sync - self._reannounce_asked:
            self._reannounce_asked.add(worker_id)
            self.background.spawn(nc.publish(self.names.reannounce_subject(worker_id), b""))
        self._reannounce_asked &= out_of_sync

    # --- readiness -----------------------------------------------------------------------------

    def _check_ready(self) -> None:
        if self.draining or self._becoming_ready or self.follower.blocked or (
                not self.follower.caught_up(self.config.ready_lag)):
            return
        self._becoming_ready = True
        if self.replica_id in self.state.load.replicas():
            # A previous incarnation of this replica died with requests in flight and we came
            # back before anyone declared it lost: free them now, before routing anything new
            # (same connection, so our own ReplicaLost precedes our first RequestRouted).
            self.background.spawn(self._free_previous_incarnation())
        else:
            self._mark_ready()

    def _mark_ready(self) -> None:
        if self.follower.blocked:  # a stream blocked while the previous incarnation was freed
            return
        self.ready = True
        self._ready_event.set()

    async def _free_previous_incarnation(self) -> None:
        event = ev.ReplicaLost(self.replica_id, time.time())
        try:
            await self.append(self.names.router_subject(self.replica_id), event,
                              f"lost.{self.replica_id}.boot.{self._boot}")
            log.warning("replica %s freed the requests its previous incarnation left in flight",
                        self.replica_id)
        finally:
            self._mark_ready()

    # --- what the HTTP layer reads -------------------------------------------------------------

    @property
    def restores(self) -> int:
        return self.follower.restores

    @property
    def replication(self) -> ReplicationCost:
        """CPU spent decoding and applying other replicas' router messages."""
        return self.follower.replication

    @property
    def health_board(self) -> HealthBoard | None:
        canary = self.leader.canary if self.leader is not None else None
        return canary.board if canary is not None else None

    @property
    def decision_log(self) -> DecisionLogHealth:
        return self.dispatcher.decision_log

    @property
    def on_decision_refused(self) -> Callable[[str], None] | None:
        return self.dispatcher.on_decision_refused

    @on_decision_refused.setter
    def on_decision_refused(self, hook: Callable[[str], None] | None) -> None:
        self.dispatcher.on_decision_refused = hook

    def malformed_counts(self) -> dict[str, int]:
        """Malformed messages skipped per stream."""
        return self.follower.malformed_counts()

    def lag(self) -> dict[str, int]:
        return self.follower.lag()

    def seen(self, kind: str) -> int:
        """The last sequence of stream ``kind`` this replica knows to exist: delivered to it, or
        (the router stream) acknowledged to its own appends, which its answers already reflect."""
        written = self.router_log.last_seq if kind == ROUTER and self.router_log else 0
        return max(self.follower.stream_last[kind], written)

    def blocked_streams(self) -> dict[str, str]:
        """Streams stopped at a message in a newer format (kind -> why); see follower.py."""
        return dict(self.follower.blocked)

    def models(self) -> list[str]:
        return served_models(self.state)

    def thresholds_for(self, model: str) -> BusyThresholds:
        return self.dispatcher.thresholds_for(model)

    def is_disaggregated(self, model: str) -> bool:
        """The model has prefill engines, or decode engines whose prefill pool is empty (every
        prefill engine retired): its requests get a prefill decision first, which then finds
        no engine and serves them aggregated, counted as such (api/forward/prefill.py)."""
        return is_disaggregated(self.state, model) or any(
            w.role == ev.Role.DECODE for w in self.state.workers.values()
            if w.model == model or model in w.loras)

    def pending_decisions(self) -> int:
        """Decisions in the optimistic overlay: routed here, not yet applied from the stream."""
        return self.dispatcher.pending_decisions()

    def queue_depth(self) -> int:
        return self.dispatcher.queue_depth()

    async def peers_view(self) -> list[dict[str, object]]:
        """What /admin/replicas shows: every live replica's heartbeat."""
        if self.liveness is None:
            return [self._self_view()]
        return await self.liveness.view()

    def _self_view(self) -> dict[str, object]:
        return {"replica_id": self.replica_id, "ready": self.ready, "leader": self.is_leader,
                "positions": dict(self.state.positions),
                "digests": {k: f"{v:016x}" for k, v in self.state.digests().items()},
                "age_s": 0.0, "divergent": False, "version": release()[0],
                "formats": release()[1]}

    # --- requests ------------------------------------------------------------------------------

    async def route(self, req: RouteRequest) -> Routed:
        """Decide, count the decision in our load at once, submit its append, hand back the
        worker; :meth:`recorded` waits for the append before the client sees anything."""
        if self.tracer is None:
            return await self.dispatcher.route(req)
        return await self.tracer.route(req, self.dispatcher.route)

    async def recorded(self, routed: Routed) -> None:
        """Raises ``DecisionNotRecorded`` when JetStream refused the decision (then nothing may
        reach the client and the request ends ``not_routed``); returns once it is recorded or
        served unrecorded through a stream leader election."""
        await self.dispatcher.recorded(routed)

    async def store_response(self, response_id: str, routed: Routed, ttl: float) -> None:
        """Record on the router stream that ``routed``'s engine stored ``response_id``."""
        await self.dispatcher.store_response(response_id, routed, ttl)

    async def stored_response(self, response_id: str) -> tuple[WorkerKey | None, Lookup]:
        """The engine holding the stored response ``response_id``, and how the lookup went."""
        return await self.dispatcher.stored_response(response_id)

    def prefill_completed(self, request_id: str) -> None:
        self.dispatcher.prefill_completed(request_id)

    def output_progress(self, request_id: str, output_tokens: int) -> None:
        self.dispatcher.output_progress(request_id, output_tokens)

    def finished(self, request_id: str, outcome: str, output_tokens: int,
                 cached_tokens: int = -1) -> None:
        self.dispatcher.finished(request_id, outcome, output_tokens, cached_tokens)
        if self.tracer is not None:
            self.tracer.finished(request_id, outcome)

    # --- config changes through the control stream -------------------------------------------

    async def set_busy_thresholds(self, model: str, decode_blocks: float | None,
                                  prefill_tokens: int | None,
                                  prefill_tokens_frac: float | None) -> None:
        event = ev.BusyThresholdsSet(model, decode_blocks, prefill_tokens, prefill_tokens_frac,
                                     time.time())
        seq = await self.append(self.names.control_subject("thresholds"), event, None)
        await self.wait_applied(CONTROL, seq)

    def admit_tenant(self, request_id: str, tenant: str, tokens: int) -> Verdict:
        return self.dispatcher.admit_tenant(request_id, tenant, tokens)

    def tenant_not_routed(self, request_id: str) -> None:
        """An admitted request that was not routed after all: its admission stops counting."""
        self.dispatcher.tenant_pending.settle(request_id)

    async def set_tenant_limits(self, tenant: str, limits: TenantLimits) -> None:
        event = ev.TenantLimitsSet(tenant, limits.requests_per_minute, limits.tokens_per_minute,
                                   limits.max_concurrent, limits.weight, limits.isolated,
                                   time.time(), limits.cache_salt)
        seq = await self.append(self.names.control_subject("tenants"), event, None)
        await self.wait_applied(CONTROL, seq)

    async def delete_tenant(self, tenant: str) -> None:
        seq = await self.append(self.names.control_subject("tenants"),
                                ev.TenantDeleted(tenant, time.time()), None)
        await self.wait_applied(CONTROL, seq)

    async def set_api_key(self, key_sha256: str, tenant: str) -> None:
        seq = await self.append(self.names.control_subject("tenants"),
                                ev.ApiKeySet(key_sha256, tenant, time.time()), None)
        await self.wait_applied(CONTROL, seq)

    async def revoke_api_key(self, key_sha256: str) -> None:
        seq = await self.append(self.names.control_subject("tenants"),
                                ev.ApiKeyRevoked(key_sha256, time.time()), None)
        await self.wait_applied(CONTROL, seq)

    async def set_snapshot_threshold(self, threshold: int) -> None:
        seq = await self.append(self.names.control_subject("snapshot-threshold"),
                                ev.SnapshotThresholdSet(threshold, time.time()), None)
        await self.wait_applied(CONTROL, seq)


def _joined(futures: list[asyncio.Future[int]]) -> asyncio.Future[int]:
    """One future for several appends: the highest sequence once all are in, or the first
    failure."""
    joined: asyncio.Future[int] = futures[0].get_loop().create_future()
    seqs: list[int] = []

    def one_done(f: asyncio.Future[int]) -> None:
        if joined.done():
            return
        if f.cancelled():
            joined.set_exception(asyncio.CancelledError())
        elif (exc := f.exception()) is not None:
            joined.set_exception(exc)
        else:
            seqs.append(f.result())
            if len(seqs) == len(futures):
                joined.set_result(max(seqs))

    for f in futures:
        f.add_done_callback(one_done)
    return joined
