"""Prometheus metrics of one simulated worker, in a registry of its own (one app = one registry,
so several workers in one test process never share or clash)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from workers.engine import Engine

PREFIX = "jetrouter_worker"


class _EngineCollector(Collector):
    """Reads the engines' own counters and gauges at scrape time (no bookkeeping twice)."""

    def __init__(self, engines: Sequence[Engine], worker_id: str) -> None:
        self._engines = engines
        self._worker_id = worker_id

    def collect(self):  # type: ignore[no-untyped-def]
        labels = ["worker_id", "dp_rank"]
        counters: dict[str, tuple[str, Callable[[Engine], float]]] = {
            "prompt_tokens": ("Prompt tokens received", lambda e: e.prompt_tokens_total),
            "cached_tokens": ("Prompt tokens served from the prefix cache",
                              lambda e: e.cached_tokens_total),
            "generation_tokens": ("Output tokens produced", lambda e: e.output_tokens_total),
            "steps": ("Scheduler steps run", lambda e: e.steps),
            "busy_seconds": ("Simulated seconds spent in steps", lambda e: e.busy_seconds),
            "step_wall_seconds": ("Wall-clock seconds the engine spent stepping (achieved step "
                                  "time = this / steps)", lambda e: e.wall_seconds),
        }
        for name, (doc, read) in counters.items():
            family = CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=labels)
            for engine in self._engines:
                family.add_metric([self._worker_id, str(engine.dp_rank)], read(engine))
            yield family
        gauges = {
            "num_requests_running": ("Requests being computed", "num_running"),
            "num_requests_waiting": ("Requests queued for KV blocks or batch room", "num_waiting"),
            "kv_blocks_used": ("KV blocks pinned by running requests", "active_decode_blocks"),
            "kv_blocks_cached": ("KV blocks holding a committed prefix", "kv_cached_blocks"),
            "kv_blocks_total": ("KV blocks in the cache", "kv_total_blocks"),
            "active_prefill_tokens": ("Prompt tokens still to prefill", "active_prefill_tokens"),
        }
        loads = [(engine.dp_rank, engine.load()) for engine in self._engines]
        for name, (doc, key) in gauges.items():
            family = GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=labels)
            for rank, load in loads:
                family.add_metric([self._worker_id, str(rank)], load[key])
            yield family
        usage = GaugeMetricFamily(f"{PREFIX}_kv_usage", "Share of KV blocks pinned (0..1)",
                                  labels=labels)
        for rank, load in loads:
            usage.add_metric([self._worker_id, str(rank)],
                             load["active_decode_blocks"] / max(1, load["kv_total_blocks"]))
        yield usage


class WorkerMetrics:
    def __init__(self, engines: Sequence[Engine], worker_id: str) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(f"{PREFIX}_requests", "HTTP inference requests by outcome",
                                ["endpoint", "outcome"], registry=self.registry)
        self.in_flight = Gauge(f"{PREFIX}_http_requests_in_flight",
                               "Inference requests being served", registry=self.registry)
        self.registry.register(_EngineCollector(engines, worker_id))
        # Children bound once per label pair: ``labels()`` takes a lock and builds a key on
        # every call, twice per request otherwise.
        self._counts: dict[tuple[str, str], Callable[[], None]] = {}

    def count(self, endpoint: str, outcome: str) -> None:
        """One more inference request with this outcome."""
        inc = self._counts.get((endpoint, outcome))
        if inc is None:
            inc = self._counts[endpoint, outcome] = self.requests.labels(endpoint, outcome).inc
        inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
