"""When JetStream says no to a routing decision: the request is refused with 503 (the engine
request it started meanwhile is cancelled), the refusal is visible in /ready, Prometheus metrics
and the log, the decision exists in no replica's state
(the deciding replica's optimistic overlay dropped it), and replicas stay equal.

Real processes on real nats-servers: a router stream that is full (a byte limit with "discard
new", the way `--stream-max-bytes` configures it), and a 3-node cluster that lost quorum.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import nats
import pytest
import pytest_asyncio
from nats.js.api import DiscardPolicy

from eventlog.names import CONTROL, ROUTER, Names
from launch.local_cluster import LocalCluster
from tests.waiting import until

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(180)]
MODEL = "jetrouter-sim"
BODY = {"model": MODEL, "prompt": "when JetStream says no", "max_tokens": 2}


def auth(c: LocalCluster) -> dict[str, str]:
    return {"authorization": f"Bearer {c.admin_token}"}


async def states(h: httpx.AsyncClient, c: LocalCluster) -> list[dict]:
    return [(await h.get(u + "/admin/state", headers=auth(c))).json() for u in c.router_urls]


async def converged(h: httpx.AsyncClient, c: LocalCluster) -> list[dict]:
    def ok(ss: list[dict]) -> bool:
        return (len({str(s["positions"]) for s in ss}) == 1
                and all(max(s["lag"].values()) == 0 and s["active_requests"] == 0 for s in ss))

    found: list[dict] = await until(lambda: states(h, c), ok, timeout=60,
                                    what="replicas idle at equal positions",
                                    tolerate=(httpx.HTTPError,))
    assert len({s["digests"]["state"] for s in found}) == 1, [s["digests"] for s in found]
    return found


async def metric(h: httpx.AsyncClient, url: str, name: str) -> float:
    text = (await h.get(url + "/metrics")).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


def assert_refused(r: httpx.Response) -> str:
    assert r.status_code == 503, r.text
    body = r.json()
    assert body["type"] == "service_unavailable" and body["code"] == 503
    assert "could not be recorded" in body["message"]
    assert r.headers["retry-after"] == "1"
    return r.headers["x-jetrouter-request-id"]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def cluster(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[LocalCluster]:
    data = tmp_path_factory.mktemp("refused")
    async with LocalCluster(replicas=2, workers=1, data_dir=Path(data), namespace="nj",
                            router_args=["--decision-append-timeout", "3"]) as c:
        async with httpx.AsyncClient() as h:
            await until(lambda: states(h, c), lambda ss: all(s["workers"] == 1 for s in ss),
                        what="engine registered")
        yield c


async def test_full_router_stream_refuses_with_503_and_nothing_diverges(
        cluster: LocalCluster) -> None:
    r0, r1 = cluster.router_urls
    stream = Names(cluster.namespace).stream(ROUTER)
    nc = await nats.connect(cluster.nats_url)
    js = nc.jetstream()
    async with httpx.AsyncClient(timeout=30) as h:
        try:
            assert (await h.post(r0 + "/v1/completions", json=BODY)).status_code == 200
            before = await converged(h, cluster)
            info = await js.stream_info(stream)
            assert info.config.discard == DiscardPolicy.NEW  # as ensure_streams sets it
            # Full: not one more byte fits.
            await js.update_stream(info.config.evolve(max_bytes=max(info.state.bytes, 1)))
            last_seq = info.state.last_seq
            engine = cluster.worker_urls[0]
            served = await metric(h, engine, 'jetrouter_worker_requests_total{endpoint="'
                                  'completions",outcome="ok"}')
            refused = []
            long_body = {**BODY, "max_tokens": 400}  # still running when the refusal is known
            for _ in range(3):
                # The engine request starts while the decision is on its way to JetStream.
                refused.append(assert_refused(await h.post(r0 + "/v1/completions",
                                                           json=long_body)))
            # ...and is cancelled when JetStream refuses it: the engine served none of them.
            await until(lambda: metric(h, engine, "jetrouter_worker_http_requests_in_flight"),
                        lambda n: n == 0, what="engine requests cancelled")
            assert await metric(h, engine, 'jetrouter_worker_requests_total{endpoint="'
                                'completions",outcome="ok"}') == served
            # Visible: /ready, metrics, admin state, the log.
            ready = await h.get(r0 + "/ready")
            assert ready.status_code == 503
            view = ready.json()["decision_log"]
            assert view["ok"] is False and view["failures"] == 3
            # A full stream is a limit, not a hiccup: the server's answer is the reason (it is
            # not retried until --decision-append-timeout runs out).
            assert "maximum bytes exceeded" in view["last_error"], view
            # To a balancer: alive, not ready (drain it, keep its streams), not down.
            balancer = await h.get(r0 + "/ready/balancer")
            assert balancer.status_code == 404 and balancer.json()["alive"] is True
            assert await metric(h, r0, "jetrouter_decisions_not_recorded_total") == 3
            assert await metric(h, r0, "jetrouter_decision_log_ok") == 0
            logged = cluster.children["r0"].log_path.read_text()
            assert "did not take the routing decision" in logged
            assert "maximum bytes exceeded" in logged  # the server's own reason
            # Nothing of them anywhere: not on the stream, not in any replica's state, not in
            # the deciding replica's overlay.
            assert (await js.stream_info(stream)).state.last_seq == last_seq
            after = await converged(h, cluster)
            assert [s["digests"] for s in after] == [s["digests"] for s in before]
            assert all(s["active_requests"] == 0 for s in after)
            assert after[0]["pending_decisions"] == 0
            for url in (r0, r1):
                for rid in refused:
                    r = await h.get(f"{url}/admin/requests/{rid}", headers=auth(cluster))
                    assert r.status_code == 404, r.text
            # A config change JetStream refuses is a 503 too, never a 500.
            control = Names(cluster.namespace).stream(CONTROL)
            cinfo = await js.stream_info(control)
            # (0 would mean "no limit": an empty stream gets 1 byte)
            await js.update_stream(cinfo.config.evolve(max_bytes=max(cinfo.state.bytes, 1)))
            try:
                r = await h.post(r0 + "/busy_threshold", json={
                    "model": MODEL, "active_decode_blocks_threshold": 0.9})
                assert r.status_code == 503 and r.json()["type"] == "service_unavailable", r.text
            finally:
                await js.update_stream(cinfo.config.evolve(max_bytes=-1))
            # Room again: the next decision is recorded and /ready recovers at once.
            await js.update_stream(info.config.evolve(max_bytes=-1))
            assert (await h.post(r0 + "/v1/completions", json=BODY)).status_code == 200
            assert (await h.get(r0 + "/ready")).status_code == 200
            assert (await h.get(r0 + "/ready/balancer")).status_code == 200
            assert await metric(h, r0, "jetrouter_decision_log_ok") == 1
            await converged(h, cluster)
        finally:
            info = await js.stream_info(stream)
            if info.config.max_bytes != -1:
                await js.update_stream(info.config.evolve(max_bytes=-1))
            await nc.close()


async def test_lost_quorum_refuses_after_the_timeout_and_recovers(
        tmp_path: Path) -> None:
    """A 3-node NATS cluster with two nodes SIGKILLed: the R3 router stream cannot commit, so
    decisions time out (--decision-append-timeout, strict: no --decision-record-grace) and are
    refused; once the nodes are back, decisions are recorded again and the replicas agree."""
    async with LocalCluster(replicas=2, workers=1, data_dir=tmp_path, namespace="nq",
                            nats_cluster=3,
                            router_args=["--decision-append-timeout", "2",
                                         "--decision-record-grace", "0"]) as c:
        r0 = c.router_urls[0]
        async with httpx.AsyncClient(timeout=30) as h:
            await until(lambda: states(h, c), lambda ss: all(s["workers"] == 1 for s in ss),
                        what="engine registered", timeout=60)
            assert (await h.post(r0 + "/v1/completions", json=BODY)).status_code == 200
            await converged(h, c)
            nodes = c._nats  # the embedded NatsCluster
            for node in (nodes[1], nodes[2]):
                node.proc.send_signal(signal.SIGKILL)
                node.proc.wait()
            rid = assert_refused(await h.post(r0 + "/v1/completions", json=BODY))
            ready = await h.get(r0 + "/ready")
            assert ready.status_code == 503, ready.text
            view = ready.json()["decision_log"]
            assert view["ok"] is False and "in time" in view["last_error"], view
            assert await metric(h, r0, "jetrouter_decisions_not_recorded_total") >= 1
            for node in (nodes[1], nodes[2]):
                await asyncio.to_thread(node.restart, 20.0, graceful=False)
            # Quorum is back: requests are served again (the first may still meet the leader
            # election), and the refused request exists in no replica's state.
            await until(lambda: h.post(r0 + "/v1/completions", json=BODY),
                        lambda resp: resp.status_code == 200, timeout=60,
                        what="served again", tolerate=(httpx.HTTPError,))
            after = await converged(h, c)
            assert all(s["active_requests"] == 0 for s in after)
            for url in c.router_urls:
                # Without quorum the decision's append may still be proposed and commit once the
                # nodes are back (its ack timed out, not the proposal): then the compensating
                # RequestFinished closes it as not_routed, and it never held load (above).
                got = await until(
                    lambda url=url: h.get(f"{url}/admin/requests/{rid}", headers=auth(c)),
                    lambda r: r.status_code == 404 or (
                        r.status_code == 200 and r.json().get("outcome") == "not_routed"),
                    timeout=60, what=f"{rid} absent or closed as not_routed on {url}")
                assert got.status_code in (404, 200), got.text
