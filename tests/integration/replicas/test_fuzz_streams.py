"""Fuzzing the streams: garbage, random msgpack and schema-valid-but-absurd events published on
every stream subject (``<ns>.kv.*``, ``<ns>.router.*``, ``<ns>.control.*``) of a running cluster.

Two replicas and one simulated engine run as real processes on a real nats-server, with a low
snapshot threshold so the leader also snapshots (encodes) whatever state the messages produce.
Each message must be counted and skipped, or applied harmlessly: both replicas apply it (their
positions pass it), stay alive (no process exit, no traceback in their logs) and ready, and at
equal positions their digests are equal. A replica that restarts from the snapshot plus the
tail must agree too.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import nats
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from nats.aio.client import Client as NATS

from eventlog.names import CONTROL, KV, ROUTER, Names
from launch.local_cluster import LocalCluster
from tests.fuzz_events import pack, payloads
from tests.loop_thread import LoopThread
from tests.waiting import until_sync

pytestmark = pytest.mark.timeout(180)
NS = "fs"
NAMES = Names(NS)

# No shrinking: every example costs a round trip through two replicas, and a failure is best
# read from the replicas' logs next to the example hypothesis prints.
FUZZ = settings(max_examples=int(os.environ.get("JETROUTER_FUZZ_EXAMPLES", "120")),
                deadline=None, database=None, print_blob=True,
                phases=[Phase.explicit, Phase.reuse, Phase.generate],
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])

# What a probe meets while a replica is restarting or not ready yet: not an answer, not yet.
NOT_YET = (httpx.HTTPError, KeyError, ValueError)


class Fleet:
    def __init__(self, cluster: LocalCluster, loop: LoopThread, nc: NATS) -> None:
        self.cluster = cluster
        self.loop = loop
        self.nc = nc
        self.js = nc.jetstream()
        self.http = httpx.Client(timeout=30)
        self.auth = {"authorization": f"Bearer {cluster.admin_token}"}
        self.published = 0

    def state(self, url: str) -> dict[str, Any]:
        return self.http.get(url + "/admin/state", headers=self.auth).json()

    def publish(self, subject: str, payload: bytes) -> int:
        self.published += 1
        msg_id = f"fuzz-{time.time_ns()}-{self.published}"
        ack = self.loop.run(self.js.publish(subject, payload, headers={"Nats-Msg-Id": msg_id},
                                            timeout=10))
        return int(ack.seq)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    loop = LoopThread()
    cluster = LocalCluster(replicas=2, workers=1, data_dir=Path(tmp_path_factory.mktemp("fuzzs")),
                           namespace=NS, router_args=["--router-snapshot-threshold", "40"],
                           worker_args=["--num-gpu-blocks", "256", "--speedup-ratio", "1000"])
    nc: NATS | None = None
    try:
        loop.run(cluster.start())
        nc = loop.run(nats.connect(cluster.nats_url))
        f = Fleet(cluster, loop, nc)
        until_sync(lambda: all(f.state(u)["workers"] == 1 for u in cluster.router_urls),
                   what="engine registered", tolerate=NOT_YET)
        yield f
        f.http.close()
    finally:
        if nc is not None:
            loop.run(nc.close())
        loop.run(cluster.stop())
        loop.close()


# --- generators ---------------------------------------------------------------------------------

subjects = st.tuples(st.sampled_from([KV, ROUTER, CONTROL]),
                     st.sampled_from(["w0", "r0", "r1", "ghost", "health", "reset",
                                      "thresholds", "snapshot"]))


# --- checks ------------------------------------------------------------------------------------


def applied_everywhere(f: Fleet, kind: str, seq: int) -> bool:
    return all(f.state(u)["positions"][kind] >= seq for u in f.cluster.router_urls)


def assert_alive_ready_equal(f: Fleet, killed: tuple[str, ...] = ()) -> None:
    for name, child in f.cluster.children.items():
        expected = 1 if name in killed else 0  # our own SIGKILL counts as one exit
        assert child.exits == expected, f"{name} exited (code {child.last_returncode})"
    for url in f.cluster.router_urls:
        until_sync(lambda url=url: f.http.get(url + "/ready").status_code == 200,
                   what=f"{url} ready", tolerate=NOT_YET)

    def equal() -> list[dict[str, Any]] | None:
        states = [f.state(u) for u in f.cluster.router_urls]
        same = (len({json.dumps(s["positions"], sort_keys=True) for s in states}) == 1
                and all(max(s["lag"].values()) == 0 for s in states))
        return states if same else None

    states = until_sync(equal, what="replicas at equal positions", tolerate=NOT_YET)
    digests = [s["digests"] for s in states]
    assert all(d == digests[0] for d in digests), digests


def tracebacks(f: Fleet) -> list[str]:
    found = []
    for child in f.cluster.children.values():
        if child.kind == "replica" and child.log_path.exists():
            text = child.log_path.read_text(errors="replace")
            if "Traceback" in text:
                found.append(f"{child.name}: ...{text[text.index('Traceback') - 300:][:3000]}")
    return found


# --- tests ------------------------------------------------------------------------------------


def test_absurd_and_garbage_stream_messages_are_skipped_or_harmless(fleet: Fleet) -> None:
    kinds_seen: set[str] = set()

    @FUZZ
    @given(messages=st.lists(st.tuples(subjects, payloads), min_size=1, max_size=3))
    def run(messages: list[tuple[tuple[str, str], bytes]]) -> None:
        last: dict[str, int] = {}
        for (kind, token), payload in messages:
            last[kind] = fleet.publish(f"{NS}.{kind}.{token}", payload)
            kinds_seen.add(kind)
        for kind, seq in last.items():
            until_sync(lambda kind=kind, seq=seq: applied_everywhere(fleet, kind, seq),
                       timeout=30, what=f"{kind} seq {seq} applied by every replica",
                       tolerate=NOT_YET)
        for name, child in fleet.cluster.children.items():
            assert child.exits == 0, f"{name} exited (code {child.last_returncode})"

    run()
    # A few huge messages too: many blocks, many hashes (near the NATS payload limit).
    huge = [{"type": "BlocksStored", "worker_id": "w0", "event_id": 2**62, "dp_rank": 0,
             "parent_hash": None, "blocks": [[i, i * 7919] for i in range(40_000)], "ts": 1.0},
            {"type": "RequestRouted", "request_id": "huge", "replica_id": "ghost",
             "worker_id": "w0", "dp_rank": 0, "isl_tokens": 2**40,
             "block_seq_hashes": list(range(60_000)), "overlap_blocks": 0, "expected_osl": 1,
             "priority": 0, "ts": 1.0}]
    for event, kind in zip(huge, (KV, ROUTER), strict=True):
        seq = fleet.publish(f"{NS}.{kind}.w0", pack([event]))
        until_sync(lambda kind=kind, seq=seq: applied_everywhere(fleet, kind, seq),
                   what="huge applied", tolerate=NOT_YET)
    assert kinds_seen == {KV, ROUTER, CONTROL}
    assert_alive_ready_equal(fleet)
    malformed = [fleet.state(u)["malformed_messages"] for u in fleet.cluster.router_urls]
    assert all(sum(m.values()) > 0 for m in malformed), malformed
    assert tracebacks(fleet) == []


def test_a_restarted_replica_agrees_after_the_fuzz(fleet: Fleet) -> None:
    """Snapshot + tail replay of whatever the fuzz left gives the same state (decode of the
    snapshot the leader encoded, then the same skips)."""
    child = fleet.cluster.children["r1"]
    old = child.pid
    fleet.cluster.kill("r1", signal.SIGKILL)
    until_sync(lambda: child.pid not in (None, old) and child.running, what="r1 restarted",
               tolerate=NOT_YET)
    assert_alive_ready_equal(fleet, killed=("r1",))
    assert tracebacks(fleet) == []
