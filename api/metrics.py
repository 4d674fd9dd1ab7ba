"""The router replica's Prometheus metrics, all named ``jetrouter_*``.

Each :class:`RouterMetrics` owns a private ``CollectorRegistry`` instead of the process-global
one, so several replicas (and several tests) can live in one process without "duplicated
timeseries" errors. The families mirror Dynamo's router metrics (overhead per stage, per-worker
active load, KV hit rate, rejections, migrations, events applied) plus what an event-sourced
router adds: per-stream lag and event outcomes. The figures the replica keeps itself (load per
worker, lag, leadership, health, ...) are not set here but read at scrape time by the collector
of :mod:`api.replica_metrics`, attached with :meth:`RouterMetrics.attach`.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.registry import Collector

from api.lean_histogram import LeanHistogram

PREFIX = "jetrouter"
OVERHEAD_STAGES = ("hashing", "matching", "selection", "total")

# Latencies seen by clients: 1 ms .. 60 s.
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0, 30.0, 60.0)
# Time between streamed tokens: 0.5 ms .. 2.5 s.
_ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# Router's own work per request: 5 us .. 100 ms (the figures to beat are ~0.1-0.2 ms).
_OVERHEAD_BUCKETS = (0.000005, 0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001,
                     0.0025, 0.005, 0.01, 0.025, 0.1)
_TOKEN_BUCKETS = tuple(float(2**k) for k in range(4, 18))  # 16 .. 131072 tokens
_FRACTION_BUCKETS = tuple(i / 10 for i in range(11))        # 0.0, 0.1, .. 1.0
# Predicted minus engine-reported cached tokens: 0 is exact, a block either way is the usual
# miss (an eviction not yet seen, a fully cached prompt recomputing its last block).
_ERROR_BUCKETS = tuple(sorted({0.0, *(s * float(2**k) for k in range(0, 15) for s in (-1, 1))}))


class Rejection(StrEnum):
    """Why a request was refused before any engine saw it: the ``reason`` label of
    ``jetrouter_rejections``."""

    SHED = "shed"                                    # priority shedding (degraded fleet)
    NO_WORKERS = "no_workers"
    DECISION_NOT_RECORDED = "decision_not_recorded"  # JetStream did not take the decision
    BUSY = "busy"                                    # every worker over its busy threshold


class RouterMetrics:
    """Every metric one router replica exports; attribute names are what the app uses."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        reg = self.registry
        p = PREFIX
        # What every request observes is a LeanHistogram (the library's exposition, without its
        # locks: api/lean_histogram.py); the rest are the library's own.
        self.requests = Counter(f"{p}_requests", "HTTP inference requests by final outcome",
                                ["endpoint", "outcome"], registry=reg)
        self.ttft = LeanHistogram(f"{p}_time_to_first_token_seconds",
                                  "Time from request arrival to the first token sent to the client",
                                  buckets=_LATENCY_BUCKETS, registry=reg)
        self.itl = LeanHistogram(f"{p}_inter_token_latency_seconds",
                                 "Time between consecutive streamed tokens",
                                 buckets=_ITL_BUCKETS, registry=reg)
        self.input_tokens = LeanHistogram(f"{p}_input_tokens",
                                          "Prompt length in tokens per request",
                                          buckets=_TOKEN_BUCKETS, registry=reg)
        self.output_tokens = LeanHistogram(f"{p}_output_tokens",
                                           "Generated tokens per finished request",
                                           buckets=_TOKEN_BUCKETS, registry=reg)
        self.kv_hit_rate = LeanHistogram(
            f"{p}_kv_hit_rate", "Fraction of the prompt's blocks cached on the chosen worker",
            buckets=_FRACTION_BUCKETS, registry=reg)
        self.kv_prediction_error = LeanHistogram(
            f"{p}_kv_prediction_error_tokens",
            "Predicted minus engine-reported cached prompt tokens per request hop "
            "(engine: usage.prompt_tokens_details.cached_tokens)",
            buckets=_ERROR_BUCKETS, registry=reg)
        self.overhead = LeanHistogram(
            f"{p}_router_overhead_seconds",
            "Router decision time by stage: hashing, matching, selection, total (the three "
            "together), record (JetStream's acknowledgement of the decision)", ["stage"],
            buckets=_OVERHEAD_BUCKETS, registry=reg)
        self.rejections = Counter(f"{p}_rejections", "Requests refused, by reason",
                                  ["reason"], registry=reg)
        # Tenants (api/tenancy.py): the label is a tenant with limits, else "other", so the
        # label set stays as small as the configured tenants however many keys clients send.
        self.tenant_requests = Counter(
            f"{p}_tenant_requests", "Tenant admissions by outcome (admitted, limited_<limit>)",
            ["tenant", "outcome"], registry=reg)
        self.tenant_tokens = Counter(
            f"{p}_tenant_tokens", "Tokens reserved by admitted tenant requests (prompt + "
            "max_tokens)", ["tenant"], registry=reg)
        self.tenant_queue_wait = Histogram(
            f"{p}_tenant_queue_wait_seconds", "Time a tenant's request waited in the router "
            "queue", ["tenant"], buckets=_LATENCY_BUCKETS, registry=reg)
        self.decisions_not_recorded = Counter(
            f"{p}_decisions_not_recorded",
            "Routing decisions JetStream refused or did not acknowledge in time; each one's "
            "request was answered 503 (reason: refused | timeout)", ["reason"], registry=reg)
        self.disaggregated = Counter(
            f"{p}_disaggregated_requests",
            "Requests of models with prefill engines, by outcome: disaggregated, or why they "
            "were served aggregated (no_prefill_engine, prefill_failed); pull_failed counts "
            "the disaggregated ones whose decode engine could not pull the KV and computed "
            "the prompt", ["outcome"],
            registry=reg)
        # The KV hand-off of disaggregated requests (api/forward/prefill.py): what moved, and
        # how long the decode engine took from the prefill answer to its first token (the
        # transfer plus one decode step; a first NIXL transfer after an engine start is slow).
        self.kv_transfer_blocks = Histogram(
            f"{p}_kv_transfer_blocks",
            "KV blocks a prefill engine handed to a decode engine, per disaggregated request",
            buckets=tuple(float(2**k) for k in range(0, 14)), registry=reg)
        self.kv_handoff_seconds = Histogram(
            f"{p}_kv_handoff_seconds",
            "Disaggregated requests: seconds from the prefill engine's answer to the decode "
            "engine's first token", buckets=_LATENCY_BUCKETS, registry=reg)
        self.migrations = Counter(f"{p}_migrations",
                                  "Requests replayed on another worker after a failure, by reason",
                                  ["reason"], registry=reg)
        self.connect_timeouts = Counter(
            f"{p}_engine_connect_timeouts",
            "Connects to an engine that timed out, by what followed: retried (the same engine, "
            "alive, again after a backoff), migrated (another engine took the request), failed",
            ["action"], registry=reg)
        self.first_byte_waits = Counter(
            f"{p}_engine_first_byte_waits",
            "Idle timeouts before the first byte of an engine's answer, by what followed: "
            "waited (the engine alive, the request kept waiting) or failed",
            ["action"], registry=reg)
        self.divergence = Counter(f"{p}_replica_divergence",
                                  "Peers found at equal positions with a different digest",
                                  registry=reg)
        self.health_check_duration = Histogram(
            f"{p}_health_check_duration_seconds", "Canary health check latency by outcome",
            ["worker", "outcome"], buckets=_LATENCY_BUCKETS, registry=reg)
        self.session_routes = Counter(
            f"{p}_session_routes",
            "Session turns routed here: pinned (to its engine), open (first turn or after its "
            "pin lapsed), repin (its engine was retired, unhealthy or failed)", ["how"],
            registry=reg)
        self._collector: Collector | None = None
        # Label children looked up once, not per request (a .labels() call costs a lock and a
        # few dict operations; the request path used to make five of them per request).
        self._request_children: dict[tuple[str, str], Any] = {}
        self._overhead_children: dict[str, Any] = {}

    def count_request(self, endpoint: str, outcome: str) -> None:
        """``requests{endpoint, outcome} += 1`` through a cached child."""
        child = self._request_children.get((endpoint, outcome))
        if child is None:
            child = self._request_children[(endpoint, outcome)] = self.requests.labels(
                endpoint=endpoint, outcome=outcome)
        child.inc()

    def observe_overhead(self, timings: Mapping[str, float]) -> None:
        """One ``router_overhead_seconds{stage}`` observation per stage, cached children."""
        children = self._overhead_children
        for stage, seconds in timings.items():
            child = children.get(stage)
            if child is None:
                child = children[stage] = self.overhead.labels(stage=stage)
            child.observe(seconds)

    def attach(self, collector: Collector) -> None:
        """Register ``collector`` (read at every scrape; :mod:`api.replica_metrics`), in place
        of the one attached before, if any."""
        if self._collector is not None:
            self.registry.unregister(self._collector)
        self.registry.register(collector)
        self._collector = collector

    def render(self) -> tuple[bytes, str]:
        """(payload, content type) for ``GET /metrics``."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
