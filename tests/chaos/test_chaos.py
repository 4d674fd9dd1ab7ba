"""The short chaos suite in CI (a subset of `jetrouter chaos`): a replica SIGKILLed, then one of
three NATS servers SIGKILLed, under steady load through all replicas, on one 3+3+4 cluster of real
processes. Bounds are generous: a loaded 2-core machine must still pass."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from cluster.chaos import ChaosSession, chaos_cluster, format_row
from cluster.chaos_scenarios import ScenarioResult, Timing

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(240)]
chaos_test = pytest.mark.asyncio(loop_scope="module")
TIMING = Timing.short()
RECOVERY_BOUND = 60.0


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def session(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[ChaosSession]:
    data = Path(tmp_path_factory.mktemp("chaos"))
    async with chaos_cluster(data, TIMING, namespace="cch") as cluster, \
            ChaosSession(cluster) as s:
        yield s


def check(res: ScenarioResult, *, phantom: bool = True) -> None:
    detail = format_row(res) + f" notes={res.notes} failures={res.failures}"
    assert res.events_lost == 0, detail
    assert res.stream_holes == {"kv": 0, "router": 0, "control": 0}, detail
    assert res.converged and res.digests_equal, detail
    assert res.failed_not_in_flight == 0, detail
    assert res.requests_failed <= res.in_flight_at_fault, detail
    assert res.requests_ok >= TIMING.warmup_requests, detail
    assert res.recovery_s is not None and res.recovery_s < RECOVERY_BOUND, detail
    if phantom:
        assert res.phantom_cleared_s is not None, detail


@chaos_test
async def test_replica_sigkill_under_load(session: ChaosSession) -> None:
    res = await session.run("replica-kill", TIMING)
    # Restarted within --replica-timeout, the replica frees its dead incarnation's requests
    # itself (ReplicaLost before its first new decision): no phantom load either way.
    check(res, phantom=True)
    assert session.cluster.children[res.victim].restarts >= 1


@chaos_test
async def test_nats_node_sigkill_under_load_replicas_resume_without_restart(
        session: ChaosSession) -> None:
    restarts = {n: c.restarts for n, c in session.cluster.children.items()}
    res = await session.run("nats-kill", TIMING)
    check(res)
    assert res.resume_s is not None, "replicas kept applying while the node was down"
    # Reconnected and resumed in place: no replica (or worker) process was restarted.
    assert {n: c.restarts for n, c in session.cluster.children.items()} == restarts
