"""api.metrics.RouterMetrics and the replica's collector (api/replica_metrics.py): private
registries, names, the replica's figures read at scrape time, parseable output."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from api.metrics import RouterMetrics
from api.replica_metrics import FAMILIES, ReplicaCollector
from eventlog.events import WorkerRegistered
from eventlog.memory import MemoryLog
from replicas.runtime.replica import Replica, ReplicaConfig


def families(m: RouterMetrics) -> dict[str, object]:
    payload, content_type = m.render()
    assert content_type.startswith("text/plain")
    return {f.name: f for f in text_string_to_metric_families(payload.decode())}


def samples(m: RouterMetrics, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    payload, _ = m.render()
    out = {}
    for fam in text_string_to_metric_families(payload.decode()):
        for s in fam.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


EXPECTED = {
    "jetrouter_requests", "jetrouter_time_to_first_token_seconds",
    "jetrouter_inter_token_latency_seconds", "jetrouter_input_tokens", "jetrouter_output_tokens",
    "jetrouter_kv_hit_rate", "jetrouter_router_overhead_seconds",
    "jetrouter_worker_active_decode_blocks", "jetrouter_worker_active_prefill_tokens",
    "jetrouter_rejections", "jetrouter_queue_depth", "jetrouter_events_applied",
    "jetrouter_stream_lag", "jetrouter_migrations", "jetrouter_inflight_requests",
}


def exercise(m: RouterMetrics) -> None:
    m.requests.labels(endpoint="chat", outcome="ok").inc()
    m.ttft.observe(0.12)
    m.itl.observe(0.004)
    m.input_tokens.observe(900)
    m.output_tokens.observe(64)
    m.kv_hit_rate.observe(0.5)
    for stage in ("hashing", "matching", "selection", "total"):
        m.overhead.labels(stage=stage).observe(0.0001)
    m.rejections.labels(reason="all_busy").inc()
    m.migrations.labels(reason="stream_broken").inc()


def replica_metrics(level: int = 0) -> tuple[Replica, RouterMetrics]:
    replica = Replica(ReplicaConfig("r1", "", durable=False, canary_interval=0), log=MemoryLog())
    m = RouterMetrics()
    m.attach(ReplicaCollector(replica, lambda: level))
    return replica, m


def test_render_parses_and_every_family_is_present() -> None:
    replica, m = replica_metrics()
    exercise(m)
    replica.state.apply("kv", 1, [WorkerRegistered("w1", "http://w1", "m", 16, 64, 2048, 1.0)])
    fams = families(m)
    assert EXPECTED <= set(fams)
    assert {name.removesuffix("_total") for name in FAMILIES} <= set(fams)
    assert all(name.startswith("jetrouter_") for name in fams)
    assert samples(m, "jetrouter_requests_total") == {
        (("endpoint", "chat"), ("outcome", "ok")): 1.0}
    assert samples(m, "jetrouter_events_applied_total") == {
        (("event_type", "WorkerRegistered"), ("status", "ok"), ("stream", "kv")): 1.0}
    overhead = samples(m, "jetrouter_router_overhead_seconds_count")
    assert {dict(k)["stage"] for k in overhead} == {"hashing", "matching", "selection", "total"}
    assert samples(m, "jetrouter_queue_depth") == {(): 0.0}
    assert samples(m, "jetrouter_kv_hit_rate_count") == {(): 1.0}


def test_two_instances_do_not_collide() -> None:
    a, b = RouterMetrics(), RouterMetrics()
    a.ttft.observe(1.0)
    assert samples(a, "jetrouter_time_to_first_token_seconds_count") == {(): 1.0}
    assert samples(b, "jetrouter_time_to_first_token_seconds_count") == {(): 0.0}
    (_, c), (_, d) = replica_metrics(1), replica_metrics(3)
    assert samples(c, "jetrouter_degradation_level") == {(): 1.0}
    assert samples(d, "jetrouter_degradation_level") == {(): 3.0}


def test_the_replica_is_read_at_each_scrape_and_departed_workers_are_forgotten() -> None:
    replica, m = replica_metrics()
    assert samples(m, "jetrouter_worker_active_decode_blocks") == {}
    replica.state.apply("kv", 1, [WorkerRegistered("w1", "http://w1", "m", 16, 64, 2048, 1.0),
                                  WorkerRegistered("w2", "http://w2", "m", 16, 64, 2048, 1.0)])
    assert samples(m, "jetrouter_worker_active_decode_blocks") == {
        (("worker", "w1"),): 0.0, (("worker", "w2"),): 0.0}
    assert samples(m, "jetrouter_worker_status") == {
        (("worker", "w1"),): 0.0, (("worker", "w2"),): 0.0}
    del replica.state.workers["w1"]
    assert samples(m, "jetrouter_worker_active_prefill_tokens") == {(("worker", "w2"),): 0.0}


def test_counters_never_go_down_when_the_state_starts_counting_again() -> None:
    replica, m = replica_metrics()
    key = (("event_type", "WorkerRegistered"), ("status", "ok"), ("stream", "kv"))
    replica.state.apply("kv", 1, [WorkerRegistered("w1", "http://w1", "m", 16, 64, 2048, 1.0)])
    assert samples(m, "jetrouter_events_applied_total") == {key: 1.0}
    replica.state.stats.counts.clear()  # as a state loaded from a snapshot starts
    assert samples(m, "jetrouter_events_applied_total") == {key: 1.0}
