"""A hop whose connect to its engine timed out: another engine, or the same one again.

A refused connection means nothing listens there: the engine is gone, and the hop fails at once
like any failed hop (migration, a passive health report). A connect that *timed out* means no
such thing (:mod:`api.upstream`): the engine's accept queue was full while it was busy, or this
process's own loop ran late. So when the engine is **alive** — its load gauges, which an engine
(or its bridge, only while the engine answers ``/metrics``) publishes every second or so, are
more recent than ``--worker-timeout``, the judgement the leader retires engines by
(replicas/runtime/liveness.py) — the hop runner (:class:`api.forward.run.Run`,
:class:`api.forward.passthrough.Passthrough`):

1. moves the request to another engine when one can take it: the ordinary migration, under
   reason ``connect_timeout``; else
2. connects to the same engine again — same hop, same decision, same body (a decode hop keeps
   its KV hand-off) — after a backoff that doubles from ``first_backoff`` to ``max_backoff``
   (half of it jittered), as long as the hop's connects have not gone on for ``window`` seconds
   (the stream idle timeout: as long as the router waits to hear from an engine anyway) and the
   engine is still alive; else
3. fails the hop as before (502 when nothing else can take the request).

Such a timeout is not reported to the circuit breakers (:class:`api.forward.forwarder.Forwarder`
filters it): a busy engine is judged by its canary, not by a request that could not get in.
Every connect timeout of a hop is counted by what followed in
``jetrouter_engine_connect_timeouts_total{action}``: ``retried``, ``migrated`` or ``failed``.

:class:`ConnectRetryPolicy` is the pure part (times and counts in, a decision out; no clock);
:class:`ConnectRetries` applies it with the clock, the liveness lookup and a sleep. Nothing here
runs while connects succeed.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum

log = logging.getLogger("jetrouter.forward")

# worker id -> seconds since this replica last heard the engine's load gauge, None if never.
HeardAgo = Callable[[str], float | None]


class TimeoutAction(StrEnum):
    """What followed a hop's connect timeout: the ``action`` label of the metric."""

    RETRIED = "retried"    # the same engine again, after a backoff
    MIGRATED = "migrated"  # another engine took the request
    FAILED = "failed"      # neither: the hop failed (the engine silent, or out of time)


@dataclass(frozen=True, slots=True)
class Retry:
    """Connect again after ``wait`` seconds, giving that connect ``timeout`` seconds."""

    wait: float
    timeout: float


@dataclass(frozen=True, slots=True)
class ConnectRetryPolicy:
    """When to connect to a live engine again after a connect timed out. Pure."""

    connect_timeout: float = 5.0   # one connect's timeout (the pool's)
    window: float = 30.0           # a hop's connects end this long after its first began
    alive_within: float = 10.0     # an engine heard from this recently is alive
    first_backoff: float = 0.1
    max_backoff: float = 2.0
    max_retries: int = 20          # a bound of its own when connects time out quickly
    # A last connect with less time than this left in the window is not worth making: the
    # kernel resends an unanswered SYN only after 1 s.
    shortest_connect: float = 1.0

    def __post_init__(self) -> None:
        if min(self.connect_timeout, self.window, self.first_backoff) <= 0:
            raise ValueError("connect_timeout, window and first_backoff must be > 0")
        if self.max_backoff < self.first_backoff or self.alive_within < 0 \
                or self.max_retries < 0 or self.shortest_connect < 0:
            raise ValueError("max_backoff must be >= first_backoff; alive_within, "
                             "max_retries and shortest_connect >= 0")

    def alive(self, heard_ago: float | None) -> bool:
        """Whether an engine last heard from ``heard_ago`` seconds ago (None: never) is alive."""
        return heard_ago is not None and heard_ago <= self.alive_within

    def backoff(self, retries: int, jitter: float) -> float:
        """The wait before retry number ``retries + 1``; ``jitter`` in [0, 1) spreads its second
        half, so requests that timed out together do not connect again together."""
        base = min(self.max_backoff, self.first_backoff * 2.0 ** min(retries, 30))
        return base * (0.5 + 0.5 * jitter)

    def next_try(self, *, retries: int, elapsed: float, heard_ago: float | None,
                 jitter: float) -> Retry | None:
        """After a connect timed out: ``retries`` made so far on this hop, ``elapsed`` seconds
        since its first connect began, the engine heard from ``heard_ago`` seconds ago. None:
        stop (the engine is not alive, or the hop is out of retries or time)."""
        if not self.alive(heard_ago) or retries >= self.max_retries:
            return None
        wait = self.backoff(retries, jitter)
        left = self.window - elapsed - wait
        if left < min(self.connect_timeout, self.shortest_connect):
            return None
        return Retry(wait, min(self.connect_timeout, left))


@dataclass(slots=True)
class ConnectTries:
    """One hop's connects so far: when the first began, the retries made, the next timeout."""

    started: float
    retries: int = 0
    timeout: float | None = None


class ConnectRetries:
    """The policy applied, one per app: ``heard_ago`` is the replica's liveness view (None:
    it has none, e.g. without JetStream, and no engine counts as alive); ``record(action)``
    counts what followed each connect timeout."""

    def __init__(self, policy: ConnectRetryPolicy, heard_ago: HeardAgo | None, *,
                 record: Callable[[TimeoutAction], None] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 jitter: Callable[[], float] = random.random,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        self.policy = policy
        self.heard_ago = heard_ago
        self._record = record
        self._clock = clock
        self._jitter = jitter
        self._sleep = sleep

    def alive(self, worker_id: str) -> bool:
        return self.heard_ago is not None and self.policy.alive(self.heard_ago(worker_id))

    def record(self, action: TimeoutAction) -> None:
        if self._record is not None:
            self._record(action)

    async def again_if_alive(self, tries: ConnectTries | None, worker_id: str,
                             request_id: str) -> ConnectTries | None:
        """:meth:`again` for an engine still alive, counted as ``retried``; None when it is not
        alive or the policy says stop (what a hop runner asks once no other engine takes it)."""
        if not self.alive(worker_id):
            return None
        tries = await self.again(tries, worker_id, request_id)
        if tries is not None:
            self.record(TimeoutAction.RETRIED)
        return tries

    async def again(self, tries: ConnectTries | None, worker_id: str,
                    request_id: str) -> ConnectTries | None:
        """After a connect of the hop ``request_id`` to ``worker_id`` timed out and no other
        engine takes it: wait the backoff and return the hop's tries with the next connect's
        timeout, or None when the policy says stop. ``tries`` None: the hop's first connect."""
        now = self._clock()
        if tries is None:
            tries = ConnectTries(started=now - self.policy.connect_timeout)
        heard = self.heard_ago(worker_id) if self.heard_ago is not None else None
        retry = self.policy.next_try(retries=tries.retries, elapsed=now - tries.started,
                                     heard_ago=heard, jitter=self._jitter())
        if retry is None:
            log.warning("request %s: connecting to %s timed out again (%d retries over %.1fs, "
                        "last heard from %s); giving up", request_id, worker_id, tries.retries,
                        now - tries.started, "never" if heard is None else f"{heard:.1f}s ago")
            return None
        log.warning("request %s: connecting to %s timed out, but it was heard from %.1fs ago "
                    "and no other engine can take the request; connecting again in %.2fs",
                    request_id, worker_id, heard, retry.wait)
        await self._sleep(retry.wait)
        tries.retries += 1
        tries.timeout = retry.timeout
        return tries
