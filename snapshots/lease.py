"""The leader lease: key ``leader`` in the KV bucket ``<ns>-leases`` (design.md §7).

The bucket's max age is the lease TTL: a holder that stops renewing loses the key when the
server expires it, and only then can another replica create it. Every write is conditional
(create-if-absent, or compare-and-set on the revision we last wrote), so JetStream — not the
clients — decides who holds it: exactly one holder at a time.

Our own view is kept on the safe side of the server's: a successful write made at local time
``t`` (taken *before* sending) keeps us leader until ``t + ttl * SAFETY``, which is before the
server can expire that write (it was stored after ``t``). ``is_leader`` checks that deadline on
every read, so a stalled loop or a NATS outage longer than the TTL steps us down by itself.

A write that timed out may still have been applied; the next conditional write then fails on
a revision that is ours after all. Before concluding we lost, the current value is read: if it
names us, we adopt its revision (nobody else can have written in between).

Contenders also listen (core NATS) on the key's subject, where JetStream publishes every KV
write: a release (delete marker) wakes them at once, so a graceful handover takes milliseconds
rather than a renewal period.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from collections.abc import Awaitable, Callable

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, StorageType, StreamConfig
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError
from nats.js.kv import KeyValue

from eventlog.names import Names
from eventlog.streams import cluster_size_hint, ensure_stream, lookup_stream

log = logging.getLogger("jetrouter.lease")

LEASE_KEY = "leader"
KV_OPERATION_HEADER = "KV-Operation"
SAFETY = 0.9  # fraction of the TTL we trust a write for (clock rate and scheduling slack)

OnChange = Callable[[bool], Awaitable[None] | None]


class LeaderLease:
    """One contender for the lease. ``holder`` must be unique per process (the replica id)."""

    def __init__(self, js: JetStreamContext, names: Names, holder: str, *,
                 ttl: float = 5.0) -> None:
        if ttl <= 0:
            raise ValueError(f"ttl must be positive, got {ttl}")
        if not holder:
            raise ValueError("holder must be a non-empty id")
        self.js = js
        self.names = names
        self.holder = holder
        self.ttl = float(ttl)
        self.bucket = names.leases_bucket
        self._kv: KeyValue | None = None
        self._open_lock = asyncio.Lock()
        self._revision: int | None = None  # revision of our last successful write
        self._valid_until = 0.0  # monotonic deadline of that write
        self._stopping: asyncio.Event | None = None
        self._wake: asyncio.Event | None = None  # set by stop() and by a release we observe
        self._stopped = False
        self.transitions = 0

    # --- bucket -------------------------------------------------------------------------------

    async def _bucket(self) -> KeyValue:
        async with self._open_lock:
            if self._kv is None:
                stream = f"KV_{self.bucket}"
                try:
                    info = await lookup_stream(self.js, stream)
                except NotFoundError:
                    info = await ensure_stream(self.js, self._stream_config(stream),
                                               replicas_given=False)
                bucket_ttl = info.config.max_age or 0.0
                if bucket_ttl and abs(bucket_ttl - self.ttl) > 1e-3:
                    # The server expires keys at the bucket's age: time ourselves by it, or we
                    # would renew too slowly (two leaders) or step down needlessly early.
                    log.warning("lease bucket %s has ttl %.3fs, not %.3fs: using the bucket's",
                                self.bucket, bucket_ttl, self.ttl)
                    self.ttl = bucket_ttl
                self._kv = KeyValue(name=self.bucket, stream=stream, pre=f"$KV.{self.bucket}.",
                                    js=self.js, direct=bool(info.config.allow_direct))
            return self._kv

    def reopen(self) -> None:
        """NATS lost its storage (the bucket is gone): open, and so create, it again on next use
        instead of writing to a bucket that no longer exists."""
        self._kv = None

    def _stream_config(self, stream: str) -> StreamConfig:
        """The KV layout nats-py's ``create_key_value`` builds, with history 1 and max age TTL."""
        return StreamConfig(
            name=stream,
            description="jetrouter leader lease",
            subjects=[f"$KV.{self.bucket}.>"],
            allow_direct=True,
            allow_rollup_hdrs=True,
            deny_delete=True,
            discard=DiscardPolicy.NEW,
            duplicate_window=min(self.ttl, 120.0),
            max_age=self.ttl,
            max_msgs_per_subject=1,
            max_consumers=-1,
            max_msgs=-1,
            storage=StorageType.FILE,
            num_replicas=cluster_size_hint(self.js),
        )

    # --- state --------------------------------------------------------------------------------

    @property
    def is_leader(self) -> bool:
        return (not self._stopped and self._revision is not None
                and time.monotonic() < self._valid_until)

    @property
    def revision(self) -> int | None:
        return self._revision

    def _won(self, revision: int, sent_at: float) -> None:
        self._revision = revision
        self._valid_until = sent_at + self.ttl * SAFETY

    def _lost(self) -> None:
        self._revision = None
        self._valid_until = 0.0

    async def _adopt_if_ours(self, kv: KeyValue) -> bool:
        """If the key names us (a write of ours whose answer we missed, or our previous life
        under the same id), take it over by compare-and-set on its current revision."""
        try:
            entry = await kv.get(LEASE_KEY)
        except KeyNotFoundError:
            return False
        if (entry.value or b"").decode() != self.holder or entry.revision is None:
            return False
        sent_at = time.monotonic()
        try:
            revision = await kv.update(LEASE_KEY, self.holder.encode(), last=entry.revision)
        except KeyWrongLastSequenceError:
            return False
        self._won(revision, sent_at)
        return True

    # --- operations ---------------------------------------------------------------------------

    async def try_acquire(self) -> bool:
        """Create the key if absent (or expired, or released); renew if it is already ours.
        True when we hold the lease afterwards."""
        kv = await self._bucket()
        if self._revision is not None:
            return await self.renew()
        self._stopped = False
        sent_at = time.monotonic()
        try:
            revision = await kv.create(LEASE_KEY, self.holder.encode())
        except KeyWrongLastSequenceError:
            if await self._adopt_if_ours(kv):
                log.info("lease %s: %s resumed its lease", self.bucket, self.holder)
                return True
            return False
        except KeyNotFoundError:
            # nats-py's create, refused because the key exists, reads the key back to see whether
            # it is only a delete marker; a key that expired in between makes that read fail.
            # The key is gone now, so nobody holds the lease: the caller's next round may win it.
            return False
        self._won(revision, sent_at)
        return True

    async def renew(self) -> bool:
        """Compare-and-set on our revision. False = we do not hold it (any more). A transport
        error (NATS down, timeout) keeps us leader until our deadline, then steps us down."""
        if self._revision is None:
            return False
        kv = await self._bucket()
        sent_at = time.monotonic()
        try:
            revision = await kv.update(LEASE_KEY, self.holder.encode(), last=self._revision)
        except KeyWrongLastSequenceError:
            if await self._adopt_if_ours(kv):
                return True
            log.warning("lease %s: %s lost the lease (expired or taken)", self.bucket,
                        self.holder)
            self._lost()
            return False
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if time.monotonic() >= self._valid_until:
                log.warning("lease %s: renew failed past the deadline (%s: %s): stepping down",
                            self.bucket, self.holder, type(exc).__name__)
                self._lost()
                return False
            log.warning("lease %s: renew failed (%s), still valid for %.2fs", self.bucket,
                        type(exc).__name__, self._valid_until - time.monotonic())
            return True
        self._won(revision, sent_at)
        return True

    async def release(self) -> None:
        """Give the lease up for good: stop :meth:`run` and delete the key if it is still ours,
        so another contender can take it at once instead of waiting for the TTL."""
        await self.stop()
        revision, self._revision = self._revision, None
        self._valid_until = 0.0
        if revision is None:
            return
        kv = await self._bucket()
        try:
            await kv.delete(LEASE_KEY, last=revision)
        except KeyWrongLastSequenceError:
            pass  # not ours any more: someone else holds it, leave it alone
        else:
            log.info("lease %s: %s released the lease", self.bucket, self.holder)

    async def current(self) -> str | None:
        """Who holds the lease now (None when nobody does)."""
        kv = await self._bucket()
        try:
            entry = await kv.get(LEASE_KEY)
        except KeyNotFoundError:
            return None
        return (entry.value or b"").decode() or None

    # --- the loop -----------------------------------------------------------------------------

    async def run(self, on_change: OnChange | None = None) -> None:
        """Every ``ttl/3``: renew if leader, else try to acquire; call ``on_change(is_leader)``
        on each transition. NATS errors are logged and retried (the client reconnects). Returns
        after :meth:`stop` or :meth:`release`, reporting a step-down first if we were leader."""
        self._stopped = False
        self._stopping = asyncio.Event()
        self._wake = asyncio.Event()
        reported = False
        failing = False
        watch = await self._watch_releases()
        try:
            while not self._stopping.is_set():
                self._wake.clear()
                try:
                    if self._revision is not None:
                        await asyncio.wait_for(self.renew(), timeout=self.ttl / 3)
                    else:
                        await asyncio.wait_for(self.try_acquire(), timeout=self.ttl / 3)
                    failing = False
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # reconnecting, timeouts: try again next round
                    if not failing:
                        log.warning("lease %s: %s for %s: %s", self.bucket, type(exc).__name__,
                                    self.holder, exc)
                    failing = True
                if self._revision is not None and time.monotonic() >= self._valid_until:
                    self._lost()  # the deadline passed without a successful renew
                now = self.is_leader  # False once stop() was called (the revision is kept
                # so that release() can still delete the key)
                if now != reported:
                    reported = now
                    await self._notify(on_change, now)
                with contextlib.suppress(asyncio.TimeoutError):
                    # Pacing between rounds; stop() or an observed release wakes us early.
                    await asyncio.wait_for(self._wake.wait(), timeout=self.ttl / 3)
        finally:
            self._stopped = True
            if watch is not None:
                with contextlib.suppress(Exception):
                    await watch.unsubscribe()
            if reported:
                with contextlib.suppress(Exception):
                    await self._notify(on_change, False)

    async def _watch_releases(self) -> Subscription | None:
        """Core-NATS interest in the lease key's subject: every KV write is published there, so
        a contender sees a release (a delete marker) at once instead of at its next round."""
        nc = getattr(self.js, "_nc", None)
        if nc is None:
            return None

        async def on_write(msg: Msg) -> None:
            operation = (msg.headers or {}).get(KV_OPERATION_HEADER)
            if operation in ("DEL", "PURGE") and self._wake is not None:
                self._wake.set()

        try:
            return await nc.subscribe(f"$KV.{self.bucket}.{LEASE_KEY}", cb=on_write)
        except Exception:  # not connected right now: the loop still works, only slower
            log.warning("lease %s: cannot watch for releases", self.bucket, exc_info=True)
            return None

    async def _notify(self, on_change: OnChange | None, leader: bool) -> None:
        self.transitions += 1
        log.info("lease %s: %s is %s", self.bucket, self.holder,
                 "now the leader" if leader else "no longer the leader")
        if on_change is None:
            return
        try:
            result = on_change(leader)
            if inspect.isawaitable(result):
                await result
        except Exception:
            log.exception("lease on_change(%s) callback failed", leader)

    async def stop(self) -> None:
        """Stop renewing (the key stays until it expires or :meth:`release`); from now on
        ``is_leader`` is False."""
        self._stopped = True
        if self._stopping is not None:
            self._stopping.set()
        if self._wake is not None:
            self._wake.set()
