"""Whole-NATS outage scenarios of `jetrouter chaos`: every nats-server SIGKILLed at once.

* ``nats-outage`` — every node down for ``Timing.nats_outage_s`` (longer than the replicas'
  3 s before degraded mode), then started again on the same ports with their data. Judged like
  every scenario (no failure outside the fault's instant, digests equal, no phantom load), plus:
  every replica said ``degraded`` while NATS was down and stopped saying it after.
* ``nats-wipe`` — the same, but the nodes come back with their store directories emptied (the
  volumes lost): streams, buckets and snapshots are gone. See :func:`fault_nats_wipe` for what
  is expected of the replicas then.

Requests served in degraded mode have no ``RequestRouted`` on the stream by design (their
decisions are counted by each replica as ``decisions_not_appended``): the scenario reads those
counts, and `run_scenario` counts a served request without a decision as lost only beyond them.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Awaitable, Callable

from cluster.chaos_scenarios import (
    Probe,
    ScenarioResult,
    Timing,
    nats_cluster_of,
    wait_for,
)
from eventlog import events as ev
from eventlog.names import KV
from eventlog.streams import stream_bounds

OUTAGE_SCENARIOS = ("nats-outage", "nats-wipe")


async def _event_logs(probe: Probe) -> dict[str, dict | None]:
    return {n: (s["event_log"] if s is not None else None)
            for n, s in (await probe.states()).items()}


async def _not_appended(probe: Probe) -> int:
    return sum(int(v["decisions_not_appended"]) for v in (await _event_logs(probe)).values()
               if v is not None)


async def _all_degraded(probe: Probe) -> bool:
    views = (await _event_logs(probe)).values()
    return all(v is not None and v["degraded"] for v in views)


async def _none_degraded(probe: Probe) -> bool:
    views = (await _event_logs(probe)).values()
    return all(v is not None and not v["degraded"] for v in views)


async def _reannounced(probe: Probe) -> bool:
    """Every engine re-announced its cache on the re-created KV stream (an AllBlocksCleared
    from each): routing runs on what the engines hold again, not on what the seed remembered."""
    stream = probe.names.stream(KV)
    first, last = await stream_bounds(probe.js, stream)
    seen: set[str] = set()
    for seq in range(max(first, last - 2000), last + 1):  # a wiped stream holds little
        msg = await probe.js.get_msg(stream, seq)
        seen.update(e.worker_id for e in ev.decode_batch(msg.data)
                    if isinstance(e, ev.AllBlocksCleared))
    return set(probe.workers) <= seen


async def _ready_codes(probe: Probe) -> list[int]:
    codes = []
    for name in probe.replicas:
        r = await probe.http.get(probe.c.children[name].url + "/ready", timeout=2.0)
        codes.append(r.status_code)
    return codes


async def _outage(probe: Probe, t: Timing, res: ScenarioResult, *, wipe: bool) -> Callable[
        [], Awaitable[bool]]:
    nats = nats_cluster_of(probe.c)
    before = await _not_appended(probe)
    res.victim = f"all {len(nats.servers)} nats-servers" + (" (stores wiped)" if wipe else "")
    t0 = res.fault_at = res.fault_end = time.monotonic()
    for server in nats.servers:
        await asyncio.to_thread(server.kill)  # SIGKILL, every node
    degraded = await wait_for(lambda: _all_degraded(probe), t.nats_outage_s + 10.0)
    if degraded is None:
        res.failures.append("not every replica reported degraded while NATS was down")
    else:
        res.notes.append(f"every replica degraded {degraded:.1f}s after the kill")
        codes = await _ready_codes(probe)
        if any(code != 200 for code in codes):
            res.failures.append(f"/ready while degraded: {codes} (expected 200)")
    remaining = t.nats_outage_s - (time.monotonic() - t0)
    if remaining > 0:
        await asyncio.sleep(remaining)  # keep NATS down for the scenario's duration
    if wipe:
        for server in nats.servers:
            shutil.rmtree(server.store_dir, ignore_errors=True)
            server.store_dir.mkdir(parents=True)
    for server in nats.servers:
        server.launch()
    await asyncio.to_thread(nats.wait_ready, 60.0)
    t_back = time.monotonic()
    res.notes.append(f"NATS down {t_back - t0:.1f}s (until its cluster was ready again)")

    async def back() -> bool:
        if not await _none_degraded(probe):
            return False
        if wipe and not await _reannounced(probe):
            return False
        if not res.notes[-1].startswith("degraded mode left"):
            res.notes.append(f"degraded mode left {time.monotonic() - t_back:.1f}s after "
                             "NATS was back" + (" (and every engine re-announced its cache)"
                                                if wipe else ""))
        res.decisions_not_appended = await _not_appended(probe) - before
        return True

    return back


async def fault_nats_outage(probe: Probe, t: Timing, res: ScenarioResult) -> Callable[
        [], Awaitable[bool]]:
    """All of NATS SIGKILLed, then back with its data: replicas reconnect and catch up."""
    return await _outage(probe, t, res, wipe=False)


async def fault_nats_wipe(probe: Probe, t: Timing, res: ScenarioResult) -> Callable[
        [], Awaitable[bool]]:
    """All of NATS SIGKILLed, then back empty: the replicas re-create the streams and buckets,
    re-seed them from their in-memory state, and engines re-announce their caches."""
    return await _outage(probe, t, res, wipe=True)


OUTAGE_FAULTS: dict[str, Callable[[Probe, Timing, ScenarioResult],
                                  Awaitable[Callable[[], Awaitable[bool]]]]] = {
    "nats-outage": fault_nats_outage,
    "nats-wipe": fault_nats_wipe,
}
