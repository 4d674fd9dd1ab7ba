"""api.metrics.RouterMetrics: private registries, names, worker gauges, parseable output."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from api.metrics import RouterMetrics


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
    m.queue_depth.set(3)
    m.events_applied.labels(stream="kv", event_type="BlocksStored", status="ok").inc(5)
    m.stream_lag.labels(stream="kv").set(7)
    m.migrations.labels(reason="stream_broken").inc()
    m.inflight.inc()
    m.set_worker_load({"w1": (10, 200)})


def test_render_parses_and_every_family_is_present() -> None:
    m = RouterMetrics()
    exercise(m)
    fams = families(m)
    assert EXPECTED <= set(fams)
    assert all(name.startswith("jetrouter_") for name in fams)
    assert samples(m, "jetrouter_requests_total") == {
        (("endpoint", "chat"), ("outcome", "ok")): 1.0}
    assert samples(m, "jetrouter_events_applied_total") == {
        (("event_type", "BlocksStored"), ("status", "ok"), ("stream", "kv")): 5.0}
    overhead = samples(m, "jetrouter_router_overhead_seconds_count")
    assert {dict(k)["stage"] for k in overhead} == {"hashing", "matching", "selection", "total"}
    assert samples(m, "jetrouter_queue_depth") == {(): 3.0}
    assert samples(m, "jetrouter_kv_hit_rate_count") == {(): 1.0}


def test_two_instances_do_not_collide() -> None:
    a, b = RouterMetrics(), RouterMetrics()
    a.inflight.set(2)
    b.inflight.set(5)
    assert samples(a, "jetrouter_inflight_requests") == {(): 2.0}
    assert samples(b, "jetrouter_inflight_requests") == {(): 5.0}


def test_set_worker_load_updates_and_forgets_departed_workers() -> None:
    m = RouterMetrics()
    m.set_worker_load({"w1": (10, 200), "w2": (3, 0)})
    assert samples(m, "jetrouter_worker_active_decode_blocks") == {
        (("worker", "w1"),): 10.0, (("worker", "w2"),): 3.0}
    m.set_worker_load({"w2": (4, 50), "w3": (1, 1)})
    assert samples(m, "jetrouter_worker_active_decode_blocks") == {
        (("worker", "w2"),): 4.0, (("worker", "w3"),): 1.0}
    assert samples(m, "jetrouter_worker_active_prefill_tokens") == {
        (("worker", "w2"),): 50.0, (("worker", "w3"),): 1.0}
    m.set_worker_load({})
    assert samples(m, "jetrouter_worker_active_decode_blocks") == {}
    assert samples(m, "jetrouter_worker_active_prefill_tokens") == {}
