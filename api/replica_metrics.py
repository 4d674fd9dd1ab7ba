"""The replica's own figures as Prometheus metrics, read when ``/metrics`` is scraped.

:class:`ReplicaCollector` is a ``prometheus_client`` custom collector registered once on the
app's :class:`api.metrics.RouterMetrics` registry (:func:`api.app.create_app`): per-worker load,
stream lag, events applied, leadership, snapshots, worker health, sessions, the decision log's
state, the degradation level. Nothing on the request path or a timer keeps these up to date;
each scrape reads the replica as it is then. Counters are the replica's running totals, never
lower than a scrape already reported (a state reloaded from a snapshot starts its own counts
again; the exported counter waits until they pass what it said), and a counter series once
exported stays.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from api.metrics import PREFIX
from replicas.core.health import STATUS_GAUGE
from replicas.runtime.replica import Replica

p = PREFIX
# name -> (kind, help, labels); "counter" names are exported with a _total suffix.
FAMILIES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    f"{p}_worker_active_decode_blocks": (
        "gauge", "KV blocks held by requests decoding on each worker, as this replica sees it",
        ("worker",)),
    f"{p}_worker_active_prefill_tokens": (
        "gauge", "Prompt tokens still to prefill on each worker, as this replica sees it",
        ("worker",)),
    f"{p}_decisions_served_unrecorded": (
        "counter", "Requests served before JetStream acknowledged their routing decision (past "
        "--decision-record-grace, e.g. during a stream leader election): state=served counts "
        "them all, recorded_late those whose decision landed afterwards, lost those whose "
        "append failed for good", ("state",)),
    f"{p}_decision_log_ok": (
        "gauge", "0 while recent routing decisions could not be recorded (/ready is 503), else 1",
        ()),
    f"{p}_event_log_degraded": (
        "gauge", "1 while the event log (NATS JetStream) is unavailable and this replica routes "
        "in degraded mode on the state it has (/ready stays 200 with degraded: true), else 0",
        ()),
    f"{p}_decisions_not_appended": (
        "counter", "Routing decisions served in degraded mode without being appended to the "
        "event log; their load was counted on this replica only", ()),
    f"{p}_queue_depth": (
        "gauge", "Requests held in the priority queue waiting for capacity", ()),
    f"{p}_events_applied": (
        "counter", "Events applied to router state, by stream, type and status",
        ("stream", "event_type", "status")),
    f"{p}_replication_apply_seconds": (
        "counter", "Seconds spent decoding and applying other replicas' router-stream messages",
        ()),
    f"{p}_stream_lag": (
        "gauge", "Messages in each stream not yet applied by this replica", ("stream",)),
    f"{p}_stream_blocked": (
        "gauge", "1 while this replica has stopped applying a stream at a message in a format "
        "newer than its release reads (upgrade it)", ("stream",)),
    f"{p}_inflight_requests": ("gauge", "Requests this replica is currently serving", ()),
    f"{p}_is_leader": ("gauge", "1 while this replica holds the leader lease", ()),
    f"{p}_snapshots": ("counter", "Snapshots this replica has taken as leader", ()),
    f"{p}_snapshot_restores": (
        "gauge", "Times this replica loaded its state from a snapshot", ()),
    f"{p}_epoch": ("gauge", "State epoch (bumped by every reset)", ()),
    f"{p}_worker_status": (
        "gauge", "Worker health: 0 healthy, 1 suspicious, 2 unhealthy, 3 draining, 4 dead",
        ("worker",)),
    f"{p}_circuit_breaker_state": (
        "gauge", "Leader's circuit breaker per worker: 0 closed, 1 open, 2 half-open",
        ("worker",)),
    f"{p}_degradation_level": (
        "gauge", "Graceful degradation level (0 normal .. 4 critical)", ()),
    f"{p}_sticky_sessions": (
        "gauge", "Sticky sessions pinned to an engine (replicated state)", ()),
}


def _family(name: str) -> GaugeMetricFamily | CounterMetricFamily:
    kind, doc, labels = FAMILIES[name]
    if kind == "counter":
        return CounterMetricFamily(name, doc, labels=labels)
    return GaugeMetricFamily(name, doc, labels=labels)


def families() -> list[Metric]:
    """Every family the collector exports, without samples (what it describes)."""
    return [_family(name) for name in FAMILIES]


class ReplicaCollector(Collector):
    """Reads ``replica`` (and the door's degradation level) at every scrape."""

    def __init__(self, replica: Replica, degradation_level: Callable[[], int] = lambda: 0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.replica = replica
        self.degradation_level = degradation_level
        self.clock = clock
        self._reported: dict[tuple[str, tuple[str, ...]], float] = {}

    def describe(self) -> Iterable[Metric]:
        return families()

    def _counter(self, name: str, labels: tuple[str, ...], value: float) -> float:
        key = (name, labels)
        reported = max(self._reported.get(key, 0.0), value)
        self._reported[key] = reported
        return reported

    def collect(self) -> Iterator[Metric]:
        replica, state, now = self.replica, self.replica.state, self.clock()
        fams = {name: _family(name) for name in FAMILIES}
        counted: set[tuple[str, tuple[str, ...]]] = set()

        def add(name: str, value: float, *labels: str) -> None:
            if FAMILIES[name][0] == "counter":
                value = self._counter(name, labels, value)
                counted.add((name, labels))
            fams[name].add_metric(list(labels), value)

        for w in state.workers.values():
            for rank in range(w.dp_size):
                key = (w.worker_id, rank)
                label = w.worker_id if w.dp_size == 1 else f"{w.worker_id}/{rank}"
                add(f"{p}_worker_active_decode_blocks", state.load.active_decode_blocks(key),
                    label)
                add(f"{p}_worker_active_prefill_tokens",
                    state.load.active_prefill_tokens(key, state.now), label)
        for (stream, etype, status), n in state.stats.counts.items():
            add(f"{p}_events_applied", n, stream, etype, status)
        blocked = replica.blocked_streams()
        for stream, lag in replica.lag().items():
            add(f"{p}_stream_lag", lag, stream)
            add(f"{p}_stream_blocked", 1 if stream in blocked else 0, stream)
        add(f"{p}_replication_apply_seconds", replica.replication.seconds)
        add(f"{p}_queue_depth", replica.queue_depth())
        leader = replica.leader
        leading = leader is not None and leader.is_leader
        add(f"{p}_is_leader", 1 if leading else 0)
        add(f"{p}_snapshots", leader.snapshots_taken if leader is not None else 0)
        add(f"{p}_snapshot_restores", replica.restores)
        add(f"{p}_epoch", state.epoch)
        board = replica.health_board
        for w in state.workers:
            add(f"{p}_worker_status", STATUS_GAUGE.get(state.health.get(w, "healthy"), 0), w)
            if board is not None and leading:
                add(f"{p}_circuit_breaker_state", board.breaker_gauge(w), w)
        add(f"{p}_inflight_requests", len(state.load))
        add(f"{p}_sticky_sessions", len(state.sessions))
        decisions = replica.decision_log
        for label, n in (("served", decisions.served_unrecorded),
                         ("recorded_late", decisions.recorded_late), ("lost", decisions.lost)):
            add(f"{p}_decisions_served_unrecorded", n, label)
        add(f"{p}_decision_log_ok", 0 if decisions.failing(now) else 1)
        outage = replica.outage
        add(f"{p}_event_log_degraded", 1 if outage.degraded(now) else 0)
        add(f"{p}_decisions_not_appended", outage.not_appended)
        add(f"{p}_degradation_level", self.degradation_level())
        for (name, labels), value in self._reported.items():
            if (name, labels) not in counted:  # a series once exported stays, at its total
                fams[name].add_metric(list(labels), value)
        yield from fams.values()
