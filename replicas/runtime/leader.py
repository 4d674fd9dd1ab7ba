"""Leader-only work: the lease, snapshots, safe purge, coordinated reset (design.md §8), and the
canary checker (it runs on every replica and acts only while this one leads).

One replica holds the lease; it alone snapshots, purges and resets, always in this order:
write blob → append `SnapshotTaken` → purge up to the *previous* snapshot's positions. So the
newest snapshot is ahead of the purge point and the one before it sits exactly at it: restore can
fall back one snapshot (a corrupt newest blob) and still replay without a gap.

Other replicas reach the leader through core-NATS requests (`<ns>.admin.snapshot`,
`<ns>.admin.reset`), so `POST /admin/snapshot` works on any replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from typing import Any

import httpx
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext

from errors.root import JetrouterError
from eventlog import events as ev
from eventlog.names import CONTROL, KV, ROUTER, STREAM_KINDS, Names
from eventlog.streams import stream_bounds
from replicas.core.health import HealthBoard, HealthConfig
from replicas.runtime.canary import CanaryChecker, OnCheck
from replicas.runtime.port import ReplicaPort
from snapshots.lease import LeaderLease
from snapshots.store import SnapshotStore

log = logging.getLogger("jetrouter.durability")

# Longest the snapshot's capture runs on the event loop before letting it run
# (``Leader._copy_in_slices``); a slice ends after the step that crosses it (a step: ~1-3 ms).
_CAPTURE_SLICE = 0.005


class NoLeader(JetrouterError):
    """No replica holds the lease (or it did not answer) — try again shortly."""


class LeaderOperationFailed(JetrouterError, RuntimeError):
    """The leader took a snapshot or reset request and it failed there (JetStream timed out or
    refused a write, the bucket is gone, ...): the message names the operation and the cause."""

    def __init__(self, verb: str, cause: str) -> None:
        super().__init__(f"the {verb} failed on the leader: {cause}")
        self.verb = verb
        self.cause = cause


class Leader:
    """Every durable replica has one: it runs for the lease, and does the work below only while
    it holds it (other replicas' admin requests reach the holder over core NATS)."""

    def __init__(self, replica: ReplicaPort, nc: NatsClient, js: JetStreamContext,
                 store: SnapshotStore, *, hold_kv: Callable[[], Callable[[], None]],
                 snapshot_threshold: int, lease_ttl: float = 5.0,
                 check_interval: float = 1.0) -> None:
        self.replica = replica
        # The follower's hold on the KV stream (follower.py): called, no KV message applies
        # until the function it returns is called.
        self.hold_kv = hold_kv
        self.nc = nc
        self.js = js
        self.names: Names = replica.names
        self.default_threshold = snapshot_threshold
        self.store = store
        # The holder names this process, not just the replica id: a replica restarted under the
        # same id must not believe it still holds the lease its previous incarnation took.
        self.lease = LeaderLease(js, self.names, f"{replica.replica_id}.{secrets.token_hex(4)}",
                                 ttl=lease_ttl)
        self.check_interval = check_interval
        self.snapshots_taken = 0
        self.last_snapshot_at: float | None = None
        # The newest snapshot's capture: seconds the KV stream was held, slices of the loop
        self.last_capture: dict[str, float] = {}
        self._lock = asyncio.Lock()  # one snapshot/reset at a time on this replica
        self._tasks: list[asyncio.Task[None]] = []
        self._subs: list[Subscription] = []
        self._inflight: set[asyncio.Task[None]] = set()
        self.on_leader_change: Callable[[bool], Awaitable[None] | None] | None = None
        self.canary: CanaryChecker | None = None
        self._canary_client: httpx.AsyncClient | None = None

    @property
    def is_leader(self) -> bool:
        return self.lease.is_leader

    @property
    def threshold(self) -> int:
        t = self.replica.state.snapshot_threshold
        return t if t is not None else self.default_threshold

    async def start(self) -> None:
        self._tasks.append(asyncio.create_task(self._run_lease(), name="lease"))
        self._tasks.append(asyncio.create_task(self._leader_loop(), name="snapshot-policy"))
        self._subs.append(await self.nc.subscribe(self._subject("snapshot"),
                                                  cb=self._on_snapshot_request))
        self._subs.append(await self.nc.subscribe(self._subject("reset"),
                                                  cb=self._on_reset_request))

    async def start_canaries(self, *, interval: float, timeout: float, recovery_timeout: float,
                             on_check: OnCheck | None) -> None:
        """Canary checks of every worker: judged and announced only while this replica leads
        (leadership may move during a round: the announcement is checked again)."""
        self._canary_client = httpx.AsyncClient()
        self.canary = CanaryChecker(
            self._canary_client, HealthBoard(HealthConfig(recovery_timeout=recovery_timeout)),
            self.replica, interval=interval, timeout=timeout, nc=self.nc,
            on_check=on_check)
        await self.canary.start()

    async def stop(self) -> None:
        if self.canary is not None:
            with contextlib.suppress(Exception):
                await self.canary.stop()
        if self._canary_client is not None:
            await self._canary_client.aclose()
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        with contextlib.suppress(Exception):
            await self.lease.stop()
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        with contextlib.suppress(Exception):
            await self.lease.release()

    async def _run_lease(self) -> None:
        # Only a caught-up replica runs for leader: a replica replaying a long tail is busy and
        # would renew late, and it could not snapshot anything current anyway.
        await self.replica.wait_ready()
        await self.lease.run(self._leader_changed)

    def _subject(self, verb: str) -> str:
        return self.names.admin_subject(verb)

    async def _leader_changed(self, leader: bool) -> None:
        log.warning("replica %s %s the leader lease", self.replica.replica_id,
                    "took" if leader else "lost")
        if self.on_leader_change is not None:
            result = self.on_leader_change(leader)
            if asyncio.iscoroutine(result):
                await result

    # --- the policy: snapshot when enough has been appended since the last one -------------

    def messages_since_snapshot(self) -> int:
        state = self.replica.state
        last = state.last_snapshot.positions if state.last_snapshot else {}
        return sum(max(state.positions[k] - last.get(k, 0), 0) for k in (KV, ROUTER))

    async def _leader_loop(self) -> None:
        while True:
            await asyncio.sleep(self.check_interval)
            if not (self.is_leader and self.replica.ready):
                continue
            if self.messages_since_snapshot() > self.threshold:
                try:
                    await self.take_snapshot("threshold")
                except Exception:
                    log.exception("scheduled snapshot failed; will retry")

    # --- snapshot ------------------------------------------------------------------------------

    async def take_snapshot(self, trigger: str) -> dict[str, Any]:
        """Leader only. Blob first, then the event, then the purge."""
        async with self._lock:
            state = self.replica.state
            release = self.hold_kv()
            try:
                # Read and captured with no await between: the snapshot and its positions agree.
                positions = dict(state.positions)
                epoch, state_format = state.epoch, state.snapshot_format
                taken = state.capture()
                await self._copy_in_slices(taken.steps)
            finally:
                release()  # on every path: copied, failed, cancelled, the lease lost
            # Encoded, checksummed and written off the loop (SnapshotStore.put).
            meta = await self.store.put(taken.encode, positions=positions, epoch=epoch,
                                        created_by=self.replica.replica_id, trigger=trigger,
                                        format=state_format)
            if not self.is_leader:  # lost the lease while writing: leave it to the new leader
                raise NoLeader("lost the leader lease while writing the snapshot")
            event = ev.SnapshotTaken(meta.snapshot_id, positions, meta.size, meta.sha256,
                                     self.replica.replica_id, trigger, time.time())
            seq = await self._append_control(event, f"snap.{meta.snapshot_id}", "snapshot")
            await self._purge_to_previous(meta.snapshot_id)
            self.snapshots_taken += 1
            self.last_snapshot_at = time.time()
            held = self.last_capture["held_s"]
            log.info("snapshot %s at %s (%d bytes, trigger %s; KV held %.3f s)",
                     meta.snapshot_id, positions, meta.size, trigger, held)
            return {"snapshot_id": meta.snapshot_id, "positions": positions, "epoch": epoch,
                    "size": meta.size, "sha256": meta.sha256, "trigger": trigger,
                    "created_by": self.replica.replica_id, "control_seq": seq,
                    "kv_held_s": round(held, 4)}

    async def _copy_in_slices(self, steps: Iterator[None]) -> None:
        """Run the capture's steps (copies of the index's tables, ~1-3 ms each) in slices of
        ``_CAPTURE_SLICE`` seconds, letting the event loop run between slices: requests are
        routed (decisions read the index, they do not change it), the router and control
        streams applied, the lease renewed. A capture at once held the loop ~2 s at 25.6 M
        pairs, close to what the lease survives (renewed every ttl/3, trusted for 0.9 ttl:
        a stall past ~2.8 s of the default 5 s loses it). Stops if the lease is lost."""
        started = time.perf_counter()
        slices = 1
        deadline = started + _CAPTURE_SLICE
        for _ in steps:
            if time.perf_counter() >= deadline:
                await asyncio.sleep(0)
                if not self.is_leader:
                    raise NoLeader("lost the leader lease while capturing the snapshot")
                slices += 1
                deadline = time.perf_counter() + _CAPTURE_SLICE
        self.last_capture = {"held_s": time.perf_counter() - started, "slices": slices}

    async def _purge_to_previous(self, newest_id: str) -> None:
        metas = await self.store.list()
        older = [m for m in metas if m.snapshot_id != newest_id]
        if not older:
            return
        cut = older[0].positions  # the previous snapshot: purge exactly up to it
        for kind in STREAM_KINDS:
            upto = int(cut.get(kind, 0))
            if upto > 0:
                await self._purge(kind, upto)

    async def _purge(self, kind: str, upto: int) -> None:
        """Remove messages with sequence <= upto (JetStream keeps `seq` and above)."""
        stream = self.names.stream(kind)
        first, _ = await stream_bounds(self.js, stream)
        if first > upto:
            return
        await self.js.purge_stream(stream, seq=upto + 1)

    # --- reset ---------------------------------------------------------------------------------

    async def reset(self, reason: str) -> dict[str, Any]:
        """Leader only: cut every stream at its current end, start a new epoch, drop old blobs,
        snapshot the new epoch, and ask engines to re-announce their caches."""
        async with self._lock:
            cut = {}
            for kind in (KV, ROUTER):
                _, last = await stream_bounds(self.js, self.names.stream(kind))
                cut[kind] = last
            epoch = self.replica.state.epoch + 1
            event = ev.StateReset(epoch, reason, time.time(), cut)
            seq = await self._append_control(event, f"reset.{epoch}", "reset")
            await self.replica.wait_applied(CONTROL, seq)
            for kind in (KV, ROUTER):
                if cut[kind] > 0:
                    await self._purge(kind, cut[kind])
            if seq > 1:
                await self._purge(CONTROL, seq - 1)
            deleted = await self.store.delete_all()
        # A fresh snapshot of the new epoch, so a replica starting now has something to load.
        snap = await self.take_snapshot("reset")
        await self.nc.publish(self.names.reannounce_subject("all"), b"")
        return {"epoch": epoch, "cut": cut, "control_seq": seq, "blobs_deleted": deleted,
                "snapshot": snap}

    async def _append_control(self, event: ev.Event, msg_id: str, control_kind: str) -> int:
        return await self.replica.append(self.names.control_subject(control_kind), event, msg_id)

    # --- reaching the leader from any replica ----------------------------------------------------

    async def request(self, verb: str, payload: dict[str, Any], timeout: float = 30.0
                      ) -> dict[str, Any]:
        if self.is_leader:
            try:
                return await self._run(verb, payload)
            except (NoLeader, asyncio.CancelledError):
                raise
            except Exception as exc:
                log.exception("%s request failed", verb)
                raise LeaderOperationFailed(verb, f"{type(exc).__name__}: {exc}") from exc
        try:
            msg = await self.nc.request(self._subject(verb), json.dumps(payload).encode(),
                                        timeout=timeout)
        except (NoRespondersError, NatsTimeout) as exc:
            raise NoLeader(f"no leader answered the {verb} request: {type(exc).__name__}") from None
        answer = json.loads(msg.data)
        if "error" in answer:
            raise LeaderOperationFailed(verb, str(answer["error"]))
        return answer

    async def _run(self, verb: str, payload: dict[str, Any]) -> dict[str, Any]:
        if verb == "snapshot":
            return await self.take_snapshot(payload.get("trigger", "admin"))
        if verb == "reset":
            return await self.reset(payload.get("reason", "admin"))
        raise ValueError(verb)

    async def _answer(self, msg: Msg, verb: str) -> None:
        if not self.is_leader or not msg.reply:
            return  # only the leader answers; others stay silent so the request reaches it
        try:
            answer = await self._run(verb, json.loads(msg.data or b"{}"))
        except Exception as exc:  # reported to the asking replica (LeaderOperationFailed)
            log.exception("%s request failed", verb)
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        await msg.respond(json.dumps(answer).encode())

    async def _on_snapshot_request(self, msg: Msg) -> None:
        self._spawn(self._answer(msg, "snapshot"))

    async def _on_reset_request(self, msg: Msg) -> None:
        self._spawn(self._answer(msg, "reset"))

    def _spawn(self, coro: Coroutine[object, object, None]) -> None:
        # Answer off the subscription callback (a snapshot takes a while); keep a reference.
        task = asyncio.create_task(coro)
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)
