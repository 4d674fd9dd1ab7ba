"""Replica and worker liveness (design.md §7): heartbeats and the leader's
``ReplicaLost`` / ``WorkerRetired`` declarations.

An adapter (NATS, HTTP, clocks), kept apart from the pure state machine:

* Every replica publishes a :class:`Heartbeat` (positions, digests, ready, leader) on the
  core-NATS subject ``<ns>.heartbeat.<replica_id>`` each ``heartbeat_interval``, marked
  ``<boot>.<counter>`` (a per-process token and a count), and subscribes to everyone else's.
  Core NATS needs no stream leader, so heartbeats keep flowing while one NATS server is dead
  and a JetStream stream elects a new leader (4-9 s): reading peers through a KV watch stalled
  then and made live peers look stale for longer than ``replica_timeout``. A peer's liveness
  is judged by its mark changing, timed with this process's monotonic clock: no two clocks are
  ever compared. Every replica tracks every peer, so a new leader acts on what it has already
  watched instead of starting its timers from scratch. The heartbeat is also put into the KV
  bucket ``<ns>-replicas`` (best effort, in the background, never holding a round up) so
  operators can read the last one of every replica.
* While leader, a replica whose mark has not moved for ``replica_timeout`` and that still
  owns in-flight requests gets one ``ReplicaLost``. Its msg id names the last mark seen, so
  two leaders overlapping in a hand-over append it once (the stream's duplicate window), and a
  replica that comes back under the same id (new boot token) is a new lapse, never the old one.
* Workers are judged by their core-NATS load gauges (``<ns>.load.<worker_id>``) *and* their HTTP
  ``/health``: retired only when the gauges have stopped for ``worker_timeout`` and ``/health``
  does not answer 2xx. A worker that answers ``/health`` has a NATS problem, not a death.

The bucket's TTL (``max(5 * interval, 2 * replica_timeout)``) clears entries of replicas gone
for good; peers are forgotten after the same time plus ``replica_timeout`` once they own nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.metadata
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import msgspec
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import APIError, BucketNotFoundError
from nats.js.kv import KeyValue

from eventlog import events as ev
from eventlog import wire
from eventlog.appender import is_transient
from eventlog.names import Names
from eventlog.streams import cluster_size_hint, create_placed
from replicas.core.divergence import (
    Divergence,
    DivergenceDetector,
    Heartbeat,
    compare,
    decode_heartbeat,
    encode_heartbeat,
)
from replicas.core.state_codec import SNAPSHOT_FORMAT
from replicas.runtime.port import ReplicaPort

__all__ = ["Heartbeat", "Liveness", "PeerStatus", "heartbeat_subject", "liveness_subject"]

MARK_HEADER = "Jr-Heartbeat-Mark"


def release() -> tuple[str, dict[str, int]]:
    """This process's package version and the event and snapshot formats it writes: what
    ``jetrouter admin replicas`` shows for each replica during a rolling upgrade."""
    try:
        version = importlib.metadata.version("jetrouter")
    except importlib.metadata.PackageNotFoundError:  # run from a tree that was never installed
        version = "unknown"
    return version, {"events": wire.EVENT_FORMAT, "snapshots": SNAPSHOT_FORMAT}


_RELEASE = release()


def heartbeat_subject(names: Names, replica_id: str = "*") -> str:
    """Core-NATS subject of a replica's heartbeats (not a stream subject: never stored)."""
    return names.heartbeat_subject(replica_id)


log = logging.getLogger("jetrouter.liveness")

# How long a starting replica keeps asking JetStream for its heartbeat bucket (longer than a
# stream leader election, 4-9 s, and a fresh cluster's settling), and its backoff bounds.
BUCKET_BIND_WINDOW = 60.0
BUCKET_RETRY_MIN, BUCKET_RETRY_MAX = 0.1, 2.0


def liveness_subject(names: Names, event: ev.Event) -> str:
    """Where the leader's declarations go: a lost replica's own router subject, a retired
    worker's own KV subject (so every event about one party shares its subject)."""
    if isinstance(event, ev.ReplicaLost):
        return names.router_subject(event.replica_id)
    if isinstance(event, ev.WorkerRetired):
        return names.kv_subject(event.worker_id)
    raise TypeError(f"liveness appends only ReplicaLost / WorkerRetired, not {type(event)}")


@dataclass(slots=True)
class PeerStatus:
    """What this process knows of one replica's heartbeats."""

    replica_id: str
    revision: int  # heartbeat counter last seen (0: never seen a heartbeat, only its load)
    changed_at: float  # monotonic time the mark last moved (or we first noticed it)
    heartbeat: Heartbeat | None
    declared_lost: bool = False  # for the current mark (a new heartbeat clears it)
    mark: str = ""  # "<boot>.<counter>" of the last heartbeat seen ("": none)

    def age(self, now: float) -> float:
        return now - self.changed_at


@dataclass(slots=True)
class _WorkerWatch:
    first_known: float  # monotonic: a worker just registered gets a full timeout of grace
    last_gauge: float | None = None
    incarnation: str = ""
    retired: bool = False
    warned_nats_only: bool = False

    def silent_since(self) -> float:
        return self.first_known if self.last_gauge is None else max(self.first_known,
                                                                     self.last_gauge)


class Liveness:
    def __init__(
        self,
        replica: ReplicaPort,
        js: JetStreamContext,
        nc: NatsClient,
        *,
        heartbeat_interval: float = 1.0,
        replica_timeout: float = 10.0,
        worker_timeout: float = 10.0,
        on_divergence: Callable[[Divergence], None] | None = None,
        health_timeout: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        if heartbeat_interval <= 0 or replica_timeout <= 0 or worker_timeout <= 0:
            raise ValueError("heartbeat_interval and the timeouts must be positive")
        self.replica = replica
        self.js, self.nc, self.names, self.replica_id = js, nc, replica.names, replica.replica_id
        self.heartbeat_interval = heartbeat_interval
        self.replica_timeout = replica_timeout
        self.worker_timeout = worker_timeout
        self.bucket_ttl = max(5 * heartbeat_interval, 2 * replica_timeout)
        self.health_timeout = health_timeout or min(2.0, worker_timeout / 2)
        self._on_divergence = on_divergence
        self._clock = clock
        self._wall = wall_clock
        self.divergence = DivergenceDetector()
        self.peers_status: dict[str, PeerStatus] = {}
        self.workers_status: dict[str, _WorkerWatch] = {}
        self.last_sent: Heartbeat | None = None
        self.rounds = 0  # completed heartbeat rounds (tests and /admin poll this)
        self.worker_rounds = 0
        self.declared_lost: list[str] = []  # replica ids this instance appended ReplicaLost for
        self.retired: list[str] = []  # worker ids this instance appended WorkerRetired for
        self._kv: KeyValue | None = None
        self._boot = secrets.token_hex(4)  # a restarted replica's marks never repeat old ones
        self._sent = 0
        self._hb_sub: Subscription | None = None
        self._kv_put: asyncio.Task[None] | None = None
        self._gauges: dict[str, float] = {}  # worker id -> monotonic time of its last gauge
        self._sub: Subscription | None = None
        self._http: httpx.AsyncClient | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._bad_entries: set[tuple[str, str]] = set()
        self._last_poll: float | None = None
        self._last_worker_check: float | None = None
        self._reconnects_seen: dict[str, int] = {}

    # --- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        self._kv = await self._bucket_when_reachable()
        self._sub = await self.nc.subscribe(self.names.load_subject(), cb=self._on_gauge)
        self._hb_sub = await self.nc.subscribe(heartbeat_subject(self.names),
                                               cb=self._on_heartbeat)
        self._http = httpx.AsyncClient(timeout=self.health_timeout)
        self._tasks = [
            asyncio.create_task(self._heartbeat_loop(), name=f"heartbeat-{self.replica_id}"),
            asyncio.create_task(self._worker_loop(), name=f"worker-liveness-{self.replica_id}"),
        ]

    async def stop(self, *, delete_key: bool = True) -> None:
        """Stop heartbeating. ``delete_key`` removes our entry at once (a clean shutdown);
        without it the entry just stops moving, which is what a crash looks like to peers."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks = []
        if self._kv_put is not None:
            self._kv_put.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._kv_put
            self._kv_put = None
        for sub in (self._sub, self._hb_sub):
            if sub is not None:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
        self._sub = self._hb_sub = None
        if self._http is not None:
            await self._http.aclose()
            self._http = None
        if delete_key and self._kv is not None:
            with contextlib.suppress(Exception):
                await self._kv.delete(self.replica_id)

    async def reopen_bucket(self) -> None:
        """NATS lost its storage: bind (and so create) the heartbeat bucket again."""
        self._kv = await self._bucket()

    async def _bucket_when_reachable(self) -> KeyValue:
        """`_bucket`, asked again while JetStream's answer is a transient failure: a cluster
        that has just started (or lost a node) times its API requests out for a few seconds
        while it settles, and a replica that exited over that would only be restarted into it."""
        delay = BUCKET_RETRY_MIN
        deadline = time.monotonic() + BUCKET_BIND_WINDOW
        while True:
            try:
                return await self._bucket()
            except Exception as exc:
                if not is_transient(exc) or time.monotonic() + delay > deadline:
                    raise
                log.warning("binding heartbeat bucket %s failed (%s); retrying in %.2fs",
                            self.names.replicas_bucket, type(exc).__name__, delay)
            await asyncio.sleep(delay)  # backoff between attempts, not a synchronisation
            delay = min(delay * 2, BUCKET_RETRY_MAX)

    async def _bucket(self) -> KeyValue:
        """Bind to the heartbeat bucket, creating it if absent. Whoever creates it first sets
        its TTL; others bind to it as it is (a config mismatch is not worth failing over)."""
        name = self.names.replicas_bucket
        with contextlib.suppress(BucketNotFoundError):
            return await self.js.key_value(name)
        config = KeyValueConfig(bucket=name, history=1, ttl=self.bucket_ttl,
                                storage=StorageType.FILE,
                                description="jetrouter replica heartbeats")
        try:
            return await create_placed(
                self.js, lambda replicas: self.js.create_key_value(dataclasses.replace(
                    config, replicas=replicas)),
                cluster_size_hint(self.js), what=f"KV bucket {name}", step_down=True)
        except APIError as exc:
            log.warning("creating bucket %s failed: %s", name, exc)
            with contextlib.suppress(BucketNotFoundError):
                return await self.js.key_value(name)  # created meanwhile by a peer
            raise

    # --- what the replica port tells ------------------------------------------------------------

    def _snapshot(self) -> Heartbeat:
        r = self.replica
        state = r.state
        return Heartbeat(self.replica_id, self._wall(), dict(state.positions), state.digests(),
                         r.ready, r.is_leader, *_RELEASE)

    def _is_leader(self) -> bool:
        """Leader duties wait until the replica is caught up: it judges from applied state."""
        return self.replica.ready and self.replica.is_leader

    def _known_workers(self) -> dict[str, str]:
        return {w: info.url for w, info in self.replica.state.workers.items()}

    def _known_replicas_with_load(self) -> set[str]:
        return self.replica.state.load.replicas()

    async def _append(self, event: ev.Event, msg_id: str) -> int:
        return await self.replica.append(liveness_subject(self.names, event), event, msg_id)

    # --- heartbeats and peers ------------------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        while True:
            started = self._clock()
            try:
                await self._round()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # NATS away: warn, no stack trace every interval
                log.warning("heartbeat round failed (%r); retrying next interval", exc)
            await asyncio.sleep(max(0.0, self.heartbeat_interval - (self._clock() - started)))

    async def _round(self) -> None:
        hb = self._snapshot()
        self._sent += 1
        try:
            # Core NATS: buffered by the client while reconnecting, needs no stream leader.
            await self.nc.publish(heartbeat_subject(self.names, self.replica_id),
                                  encode_heartbeat(hb),
                                  headers={MARK_HEADER: f"{self._boot}.{self._sent}"})
            self.last_sent = hb
        except Exception as exc:  # connection closed: peers will see us lapse, the truth
            log.warning("heartbeat publish failed: %r", exc)
        self._put_in_bucket(hb)
        live = await self.peers()
        for d in self.divergence.observe(hb, live):
            log.error("state divergence: %s", d.describe())
            if self._on_divergence is not None:
                self._on_divergence(d)
        if self._is_leader() and self.nc.is_connected:
            await self._declare_lost_replicas()
        self.rounds += 1

    def _put_in_bucket(self, hb: Heartbeat) -> None:
        """Keep the bucket's copy current, in the background: a put waits for a stream leader
        (seconds while one is elected), and liveness must not wait with it."""
        if self._kv is None or (self._kv_put is not None and not self._kv_put.done()):
            return

        async def put() -> None:
            assert self._kv is not None
            try:
                await asyncio.wait_for(self._kv.put(self.replica_id, encode_heartbeat(hb)),
                                       max(2.0, 2 * self.heartbeat_interval))
            except Exception as exc:
                log.info("heartbeat copy into the bucket failed: %r", exc)

        self._kv_put = asyncio.create_task(put(), name=f"heartbeat-put-{self.replica_id}")

    async def peers(self) -> dict[str, Heartbeat]:
        """Other replicas whose heartbeat moved within ``replica_timeout``. While this process's
        own NATS connection is down nobody's lapse can be judged: timers restart instead, so a
        caller never mistakes an unreachable NATS for dead peers."""
        self._refresh(blind=not self.nc.is_connected)
        now = self._clock()
        return {rid: p.heartbeat for rid, p in self.peers_status.items()
                if rid != self.replica_id and p.heartbeat is not None
                and p.age(now) < self.replica_timeout}

    async def _on_heartbeat(self, msg: Msg) -> None:
        rid = msg.subject.rsplit(".", 1)[-1]
        if rid == self.replica_id:
            return
        mark = (msg.headers or {}).get(MARK_HEADER, "")
        status = self.peers_status.get(rid)
        if status is not None and status.mark == mark:
            return  # not moved
        try:
            hb = decode_heartbeat(msg.data or b"")
            counter = int(mark.rsplit(".", 1)[-1]) if mark else 0
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            if (rid, mark) not in self._bad_entries and len(self._bad_entries) < 1000:
                self._bad_entries.add((rid, mark))
                log.warning("skipping malformed heartbeat from %s (%s): %s", rid, mark, exc)
            return
        self.peers_status[rid] = PeerStatus(rid, counter, self._clock(), hb, mark=mark)

    def _refresh(self, *, blind: bool = False) -> None:
        """Restart timers after a blind spell, discount a shorter stall, and forget replicas
        gone for good."""
        now = self._clock()
        last = self._last_poll
        if self._was_blind(now, "_last_poll", self.replica_timeout) or blind:
            # We could not observe (NATS away, our loop stalled): peers' heartbeats may have been
            # lost on their way too, so nobody's lapse can be judged across the gap.
            for status in self.peers_status.values():
                status.changed_at = max(status.changed_at, now)
        elif last is not None and now - last > 2 * self.heartbeat_interval:
            # A stall shorter than that (our loop starved): heartbeats that came meanwhile wait
            # unread in our socket while this round runs first, so the time we were not reading
            # does not count toward anyone's silence. Without this, a peer already late (its own
            # NATS server just died, it is reconnecting) crossed the timeout during our stall
            # and was declared lost with its heartbeat queued behind the declaration.
            unread = now - last - self.heartbeat_interval
            for status in self.peers_status.values():
                status.changed_at = min(now, status.changed_at + unread)
        # Forget replicas gone for good: silent long past the timeout and nothing left owned
        # (one that still owns requests keeps its record, and so its last mark for the
        # ReplicaLost msg id).
        owning = self._known_replicas_with_load()
        for rid, status in list(self.peers_status.items()):
            if (rid not in owning and rid != self.replica_id
                    and status.age(now) > self.bucket_ttl + self.replica_timeout):
                del self.peers_status[rid]

    def _was_blind(self, now: float, attr: str, timeout: float) -> bool:
        """True when this process could not observe since its previous successful round of the
        same kind: the gap exceeded half the timeout, or the NATS connection was re-established
        meanwhile (core-NATS gauges and heartbeats in that window are gone for good)."""
        last: float | None = getattr(self, attr)
        setattr(self, attr, now)
        reconnects = int(self.nc.stats.get("reconnects", 0))
        seen = self._reconnects_seen.get(attr, reconnects)
        self._reconnects_seen[attr] = reconnects
        blind = last is not None and (now - last > timeout / 2 or reconnects != seen)
        if blind:
            log.info("liveness (%s): not observing for %.1fs or reconnected; restarting timers",
                     attr.strip("_"), now - (last or now))
        return blind

    async def view(self) -> list[dict[str, object]]:
        """Rows for ``/admin/replicas``: this replica (fresh) and every peer tracked, live or
        not, with ``age_s`` since its heartbeat last moved and ``divergent`` when it sits at our
        positions with another state digest. A failed bucket read shows the last known view."""
        with contextlib.suppress(Exception):
            self._refresh()
        mine = self._snapshot()
        now = self._clock()
        owned = self.replica.state.load.owned
        rows: list[dict[str, object]] = [
            _row(mine, 0.0, False) | {"self": True, "owned_requests": owned(self.replica_id)}]
        for rid, p in sorted(self.peers_status.items()):
            if rid == self.replica_id or p.heartbeat is None:
                continue
            divergent = bool(compare(mine, {rid: p.heartbeat}))
            rows.append(_row(p.heartbeat, p.age(now), divergent) | {
                "live": p.age(now) < self.replica_timeout, "revision": p.revision,
                "declared_lost": p.declared_lost, "owned_requests": owned(rid)})
        return rows

    # --- leader duty: replicas -----------------------------------------------------------------

    async def _declare_lost_replicas(self) -> None:
        now = self._clock()
        for rid in sorted(self._known_replicas_with_load() - {self.replica_id}):
            status = self.peers_status.get(rid)
            if status is None:
                # Owns requests but never heartbeated while we watched: time it from now.
                status = self.peers_status[rid] = PeerStatus(rid, 0, now, None)
            if status.declared_lost or status.age(now) < self.replica_timeout:
                continue
            event = ev.ReplicaLost(rid, self._wall())
            try:
                await self._append(event, f"lost.{rid}.{status.mark or status.revision}")
            except Exception as exc:
                log.error("appending ReplicaLost(%s) failed, retrying next round: %r", rid, exc)
                continue
            status.declared_lost = True
            self.declared_lost.append(rid)
            log.warning("replica %s lost: no heartbeat for %.1fs (last mark %s)",
                        rid, status.age(now), status.mark or "-")

    # --- leader duty: workers ------------------------------------------------------------------

    async def _on_gauge(self, msg: Msg) -> None:
        worker_id = msg.subject.rsplit(".", 1)[-1]
        self._gauges[worker_id] = self._clock()

    def gauge_age(self, worker_id: str) -> float | None:
        """Seconds since this replica last received the worker's load gauge (None: none yet).
        Every replica listens, leader or not; the request path asks it whether an engine whose
        connect timed out is still alive (api/forward/connect_retry.py)."""
        seen = self._gauges.get(worker_id)
        return None if seen is None else self._clock() - seen

    async def _worker_loop(self) -> None:
        interval = min(self.heartbeat_interval, self.worker_timeout / 3)
        while True:
            started = self._clock()
            try:
                await self._check_workers()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("worker liveness round failed; retrying next interval")
            self.worker_rounds += 1
            await asyncio.sleep(max(0.0, interval - (self._clock() - started)))

    def _incarnation(self, worker_id: str, url: str) -> str:
        """Part of the WorkerRetired msg id: a worker re-registered under the same id is a new
        incarnation whose retirement must not be swallowed by the duplicate window."""
        info = self.replica.state.workers.get(worker_id)
        return url if info is None else str(info.registered_ts)

    async def _check_workers(self) -> None:
        now = self._clock()
        if self._was_blind(now, "_last_worker_check", self.worker_timeout):
            for watch in self.workers_status.values():
                watch.first_known = max(watch.first_known, now)
        known = dict(self._known_workers())
        for wid in list(self.workers_status):
            if wid not in known:  # retired (applied) or never ours: forget it
                del self.workers_status[wid]
        for wid, url in known.items():
            inc = self._incarnation(wid, url)
            watch = self.workers_status.get(wid)
            if watch is None or watch.incarnation != inc:
                watch = self.workers_status[wid] = _WorkerWatch(first_known=now, incarnation=inc)
            watch.last_gauge = self._gauges.get(wid)
        for wid in list(self._gauges):
            if wid not in known and now - self._gauges[wid] > 10 * self.worker_timeout:
                del self._gauges[wid]  # gauges of workers we never knew: don't grow forever
        if not self._is_leader():
            return
        silent = [wid for wid, w in self.workers_status.items()
                  if not w.retired and now - w.silent_since() >= self.worker_timeout]
        if not silent:
            return
        answers = await asyncio.gather(*(self._healthy(known[wid]) for wid in silent))
        # Waiting on a hung worker's /health is not blindness: restart the gap clock here.
        self._last_worker_check = self._clock()
        for wid, healthy in zip(silent, answers, strict=True):
            watch = self.workers_status[wid]
            if healthy:
                if not watch.warned_nats_only:
                    watch.warned_nats_only = True
                    log.warning("worker %s: no load gauges for %.1fs but /health answers; "
                                "not retiring it (a NATS problem, not a dead engine)",
                                wid, now - watch.silent_since())
                continue
            await self._retire(wid, watch)

    async def _healthy(self, url: str) -> bool:
        assert self._http is not None
        try:
            r = await self._http.get(f"{url.rstrip('/')}/health")
        except (httpx.HTTPError, httpx.InvalidURL, OSError):
            # InvalidURL: the url came from a WorkerRegistered event; one that is not a URL must
            # fail this worker's check, not the whole round (every other worker's included).
            return False
        return 200 <= r.status_code < 300

    async def _retire(self, worker_id: str, watch: _WorkerWatch) -> None:
        event = ev.WorkerRetired(worker_id, "heartbeat timeout", self._wall())
        msg_id = f"retired.{worker_id}.{watch.incarnation}"
        try:
            await self._append(event, msg_id)
        except Exception as exc:
            log.error("appending WorkerRetired(%s) failed, retrying next round: %r",
                      worker_id, exc)
            return
        watch.retired = True
        self.retired.append(worker_id)
        log.warning("worker %s retired: no load gauges and no /health answer for %.1fs",
                    worker_id, self._clock() - watch.silent_since())


def _row(hb: Heartbeat, age: float, divergent: bool) -> dict[str, object]:
    return {"replica_id": hb.replica_id, "ready": hb.ready, "leader": hb.leader,
            "positions": dict(hb.positions),
            "digests": {k: f"{v:016x}" for k, v in hb.digests.items()},
            "age_s": round(age, 3), "divergent": divergent, "live": True,
            # "" / {}: a replica of a release from before versions were published
            "version": hb.version, "formats": dict(hb.formats)}
