"""What one replica is configured with (built by ``jetrouter serve`` from its flags)."""

from __future__ import annotations

from dataclasses import dataclass, field

from eventlog.connect import NatsOptions
from replicas.core.queue import QueuePolicy
from replicas.core.selection import BusyThresholds, RoutingConfig
from replicas.core.state import StateConfig
from replicas.core.tenant_headroom import DEFAULT_HEADROOM


@dataclass(frozen=True, slots=True)
class ReplicaConfig:
    replica_id: str
    nats_url: str
    namespace: str = "jr"
    state: StateConfig = field(default_factory=StateConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig.dynamo)
    default_thresholds: BusyThresholds = field(default_factory=BusyThresholds)
    queue_threshold: float | None = None
    queue_policy: str = QueuePolicy.FCFS
    queue_timeout: float = 30.0
    # Tenants are configured: the router queue serves them by weighted fair share
    # (replicas/core/fair_queue.py) instead of the policy alone.
    tenant_fair_queue: bool = False
    # With the fair queue: the most of the engines (a fraction, at least one when above 0) an
    # over-share tenant leaves free for active tenants under their share
    # (replicas/core/tenant_headroom.py); 0: nothing held.
    tenant_headroom: float = DEFAULT_HEADROOM
    # Recorded on each decision this replica routes, so every replica accounts that request
    # alike (replicas/core/load.py): output blocks tracked, prefill load model.
    track_output_blocks: bool = False
    prefill_load_model: str = "none"
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
    # A request whose decision is neither acknowledged nor refused this long is served anyway,
    # its append retried under the same msg id (a stream leader election); 0: wait for the
    # acknowledgement up to decision_append_timeout, else 503 (replicas/runtime/decision_log.py).
    decision_record_grace: float = 1.0
    # Cost rows a decision's RequestRouted carries (the chosen engine's and the cheapest
    # others'; 0: every candidate's). Only the ledger, traces and `admin request` read them, and
    # with every row a decision costs each replica more with every engine in the fleet.
    decision_candidates: int = 8
    # Seconds without any NATS connection after which the event log counts as unavailable and
    # the replica routes in degraded mode (replicas/runtime/log_outage.py). Losing one node of
    # a NATS cluster costs a reconnect to another within a second, well under this.
    log_outage_after: float = 3.0
    stream_max_bytes: int | None = None  # per stream; None leaves the streams' limit as it is
    # Credentials and TLS (eventlog/connect.py); its servers are ignored: nats_url names them.
    nats: NatsOptions = field(default_factory=NatsOptions)
    # Decode engines reuse transferred blocks they already hold (--no-router-assume-kv-reuse).
    assume_kv_reuse: bool = True

    @property
    def nats_options(self) -> NatsOptions:
        return self.nats.with_servers(self.nats_url)
