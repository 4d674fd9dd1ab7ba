"""Serving through a stream leader election: SIGKILL of the router stream leader's NATS node (one
of three) leaves no leader for nats-server's 4-9 s election, and no routing decision can be
acknowledged meanwhile. With the default `--decision-record-grace`, the replicas keep answering:
each request waits at most the grace, is served, and its `RequestRouted` is appended once the
new leader is up — exactly once (same msg id), in stream order — and the replicas end equal.

Real processes: a 3-node nats-server cluster, two replicas and one simulated engine.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import httpx
import nats
import pytest

from eventlog import events as ev
from eventlog.names import ROUTER, Names
from eventlog.reader import StreamReader
from eventlog.streams import stream_bounds
from launch.local_cluster import LocalCluster
from tests.integration.replicas.test_append_refused import BODY, converged, states
from tests.waiting import until

pytestmark = pytest.mark.timeout(240)
SERVED_DURING_ELECTION = 6


async def router_stream(urls: list[str], stream: str) -> list[ev.Event]:
    """Every event on the router stream, in stream order."""
    nc = await nats.connect(servers=urls)
    try:
        js = nc.jetstream()
        _, last = await stream_bounds(js, stream)
        events: list[ev.Event] = []
        reader = StreamReader(js, stream, start_seq=1)
        try:
            async for seq, batch in reader:
                events.extend(batch)
                if seq >= last:
                    break
        finally:
            await reader.close()
        return events
    finally:
        await nc.close()


async def test_requests_are_answered_during_the_election_and_recorded_once_after(
        tmp_path: Path) -> None:
    async with LocalCluster(replicas=2, workers=1, data_dir=tmp_path, namespace="ne",
                            nats_cluster=3) as c:
        urls = c.router_urls
        stream = Names(c.namespace).stream(ROUTER)
        async with httpx.AsyncClient(timeout=60) as h:
            await until(lambda: states(h, c), lambda ss: all(s["workers"] == 1 for s in ss),
                        what="engine registered", timeout=60)
            assert (await h.post(urls[0] + "/v1/completions", json=BODY)).status_code == 200
            await converged(h, c)
            nodes = c._nats  # the embedded NatsCluster
            nc = await nats.connect(servers=nodes.urls)
            try:
                info = await nc.jetstream().stream_info(stream)
            finally:
                await nc.close()
            assert info.cluster is not None
            victim = next(i for i in range(len(nodes))
                          if nodes[i].server_name == info.cluster.leader)
            await asyncio.to_thread(nodes[victim].kill)
            # No leader for 4-9 s: every request is still answered, alternating replicas.
            served = []
            for i in range(SERVED_DURING_ELECTION):
                r = await h.post(urls[i % len(urls)] + "/v1/completions", json=BODY)
                assert r.status_code == 200, r.text
                served.append(r.headers["x-jetrouter-request-id"])
            views = [s["decision_log"] for s in await states(h, c)]
            # Served before JetStream acknowledged their decisions: during the election.
            assert sum(v["served_unrecorded"] for v in views) >= 1, views
            assert all(v["failures"] == 0 and v["lost"] == 0 for v in views), views
            # Once the new leader is up, every one of them lands.
            await until(lambda: states(h, c), lambda ss: all(
                s["decision_log"]["recorded_late"] == s["decision_log"]["served_unrecorded"]
                and s["decision_log"]["unrecorded_for_s"] is None for s in ss),
                what="late decisions recorded", timeout=90, tolerate=(httpx.HTTPError,))
            await asyncio.to_thread(nodes[victim].start, 30.0)
            after = await converged(h, c)  # equal digests, nothing left active
            assert all(s["active_requests"] == 0 and s["pending_decisions"] == 0
                       for s in after)
            events = await router_stream(nodes.urls, stream)
            routed = Counter(e.request_id for e in events if isinstance(e, ev.RequestRouted))
            assert {rid: routed[rid] for rid in served} == {rid: 1 for rid in served}
            # Each closed as served, after its decision (same subject, in order).
            for rid in served:
                kinds = [(type(e).__name__, getattr(e, "outcome", None)) for e in events
                         if getattr(e, "request_id", None) == rid]
                assert kinds == [("RequestRouted", None), ("RequestFinished", "ok")], kinds
