"""Worker health: a circuit breaker per worker and the HEALTHY → SUSPICIOUS → UNHEALTHY machine.

Pure (the canary checks and circuit breaker of Dynamo's fault-tolerance guide): no clock, no I/O.
Every method takes ``now`` (float seconds since the epoch); the adapter
(``replicas/runtime/canary.py``) feeds it canary results and passive signals and turns the
returned :class:`StatusChange` into ``WorkerHealthChanged`` events. Nothing here is applied to
routing directly: the control stream is the only way a status reaches the replicas, so every
replica routes by the same view.

Transitions, per the seed:

* a failure (wrong tokens, no answer, error, passive proxy error/timeout) counts on the breaker;
  the first one makes a HEALTHY worker SUSPICIOUS (weight halved); the breaker opening
  (``failure_threshold`` consecutive failures) makes it UNHEALTHY (no new requests);
* a canary success makes a SUSPICIOUS worker HEALTHY again and resets the failure count;
* an UNHEALTHY worker is not probed until ``recovery_timeout`` has passed; then the breaker is
  half-open and exactly one trial canary goes through: success → closed → HEALTHY, failure → open
  again for another ``recovery_timeout``.

One deliberate difference from that guide: a *slow* but correct canary (latency above
``slow_factor`` * the worker's EWMA baseline) makes the worker SUSPICIOUS without counting as a
breaker failure. Its own failure table answers a thermal throttle with "weight reduction",
not removal: a slow engine still serves right tokens, and halving its weight is the right lever.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum

from eventlog import events as ev


class HealthStatus(StrEnum):
    """A worker's health as the control stream records it (``WorkerHealthChanged.status``)."""

    HEALTHY = "healthy"
    SUSPICIOUS = "suspicious"
    UNHEALTHY = "unhealthy"


class BreakerState(StrEnum):
    """A worker's circuit breaker (this replica's own, never replicated)."""

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


# Dynamo's gauge: 0=healthy, 1=suspicious, 2=unhealthy, 3=draining, 4=dead. The last two belong
# to worker lifecycle (graceful shutdown, retirement), not to this machine, but share the scale.
STATUS_GAUGE: dict[str, int] = {HealthStatus.HEALTHY: 0, HealthStatus.SUSPICIOUS: 1,
                                 HealthStatus.UNHEALTHY: 2, "draining": 3, "dead": 4}
ROUTING_WEIGHT: dict[str, float] = {HealthStatus.HEALTHY: 1.0, HealthStatus.SUSPICIOUS: 0.5,
                                    HealthStatus.UNHEALTHY: 0.0}

BREAKER_GAUGE = {BreakerState.CLOSED: 0, BreakerState.OPEN: 1, BreakerState.HALF_OPEN: 2}


class CircuitBreaker:
    """closed → (``failure_threshold`` consecutive failures) → open → (``recovery_timeout``) →
    half-open, which lets ``half_open_max_calls`` trial calls through: success closes, failure
    re-opens."""

    def __init__(self, failure_threshold: int = 3, recovery_timeout: float = 60.0,
                 half_open_max_calls: int = 1) -> None:
        if failure_threshold < 1 or half_open_max_calls < 1 or recovery_timeout < 0:
            raise ValueError("failure_threshold and half_open_max_calls must be >= 1, "
                             "recovery_timeout >= 0")
        self.failure_threshold = failure_threshold
        self.recovery_timeout = recovery_timeout
        self.half_open_max_calls = half_open_max_calls
        self.state = BreakerState.CLOSED
        self.failures = 0          # consecutive failures while closed
        self.opened_at = 0.0       # time of the failure that (re-)opened the circuit
        self.trials = 0            # trial calls let through since going half-open
        self.trial_started = 0.0

    def allow(self, now: float) -> bool:
        """May a call go to the worker now? In half-open each True hands out one trial."""
        if self.state == BreakerState.CLOSED:
            return True
        if self.state == BreakerState.OPEN:
            if now - self.opened_at < self.recovery_timeout:
                return False
            self.state = BreakerState.HALF_OPEN
            self.trials = 0
        # Half-open. A trial that never reported back (its caller was cancelled) must not wedge
        # the breaker: after another recovery_timeout a fresh trial is allowed.
        if self.trials >= self.half_open_max_calls:
            if now - self.trial_started < self.recovery_timeout:
                return False
            self.trials = 0
        self.trials += 1
        self.trial_started = now
        return True

    def record_success(self, now: float) -> None:
        if self.state == BreakerState.HALF_OPEN:
            self.state = BreakerState.CLOSED
            self.trials = 0
        if self.state == BreakerState.CLOSED:
            self.failures = 0
        # While open, a success did not come through a trial (e.g. an in-flight request that
        # drained fine): it proves nothing about new requests, so the circuit stays open.

    def record_failure(self, now: float) -> None:
        if self.state == BreakerState.CLOSED:
            self.failures += 1
            if self.failures >= self.failure_threshold:
                self._open(now)
        else:
            # A failed trial re-opens; a failure while open restarts the recovery clock (seed).
            self._open(now)

    def force_open(self, now: float) -> None:
        """Adopt an UNHEALTHY status from the log (a new leader): probe again after the timeout."""
        self._open(now)

    def reset(self) -> None:
        self.state, self.failures, self.trials = BreakerState.CLOSED, 0, 0

    def _open(self, now: float) -> None:
        self.state = BreakerState.OPEN
        self.opened_at = now
        self.trials = 0
        self.failures = max(self.failures, self.failure_threshold)


@dataclass(frozen=True, slots=True)
class HealthConfig:
    failure_threshold: int = 3
    recovery_timeout: float = 60.0
    slow_factor: float = 3.0        # "slow" = latency > slow_factor * baseline ...
    slow_min_excess: float = 0.05   # ... and > baseline + this (seconds): ignores jitter on tiny
    baseline_alpha: float = 0.1     # EWMA weight of a new healthy latency sample (seed: 0.1)


@dataclass(frozen=True, slots=True)
class StatusChange:
    worker_id: str
    old: str
    new: str
    reason: str
    ts: float

    def event(self) -> ev.WorkerHealthChanged:
        """The control-stream event announcing this change."""
        return ev.WorkerHealthChanged(worker_id=self.worker_id, status=self.new,
                                      reason=self.reason, ts=self.ts)


class WorkerHealth:
    """One worker's status, breaker, and latency baseline."""

    def __init__(self, worker_id: str, config: HealthConfig) -> None:
        self.worker_id = worker_id
        self.config = config
        self.status = HealthStatus.HEALTHY
        self.breaker = CircuitBreaker(config.failure_threshold, config.recovery_timeout)
        self.baseline: float | None = None  # EWMA of canary latency (s) while healthy
        self.last_latency: float | None = None
        self.last_reason = ""

    def is_slow(self, latency: float) -> bool:
        b = self.baseline
        c = self.config
        return b is not None and latency > c.slow_factor * b and latency - b > c.slow_min_excess

    def failure(self, reason: str, now: float) -> StatusChange | None:
        self.breaker.record_failure(now)
        if self.breaker.state == BreakerState.OPEN:
            return self._set(HealthStatus.UNHEALTHY, reason, now)
        if self.status == HealthStatus.HEALTHY:
            return self._set(HealthStatus.SUSPICIOUS, reason, now)
        return None

    def canary_success(self, latency: float, now: float) -> StatusChange | None:
        self.last_latency = latency
        was = self.breaker.state
        if was == BreakerState.OPEN:
            return None  # not a trial (the caller skipped should_check): proves nothing
        self.breaker.record_success(now)
        trial = " (half-open trial passed)" if was == BreakerState.HALF_OPEN else ""
        if self.is_slow(latency):
            assert self.baseline is not None
            return self._set(HealthStatus.SUSPICIOUS, f"slow: canary {latency:.3f}s vs "
                                                      f"baseline {self.baseline:.3f}s{trial}", now)
        a = self.config.baseline_alpha
        self.baseline = latency if self.baseline is None else a * latency + (1 - a) * self.baseline
        return self._set(HealthStatus.HEALTHY, f"canary ok{trial}", now)

    def passive_success(self, now: float) -> None:
        # Only resets the consecutive-failure count of a closed breaker. It never changes the
        # status: the canary is the judge of recovery, and a success drained from an UNHEALTHY
        # worker must not close its circuit.
        if self.breaker.state == BreakerState.CLOSED:
            self.breaker.record_success(now)

    def adopt(self, status: str, now: float) -> None:
        """Take over a status from the replicated log (this replica just became leader)."""
        if status not in tuple(HealthStatus):
            raise ValueError(f"unknown health status {status!r}")
        self.status = HealthStatus(status)
        self.breaker.reset()
        if status == HealthStatus.UNHEALTHY:
            self.breaker.force_open(now)

    def _set(self, status: HealthStatus, reason: str, now: float) -> StatusChange | None:
        self.last_reason = reason
        if status == self.status:
            return None
        old, self.status = self.status, status
        return StatusChange(self.worker_id, old, status, reason, now)


class HealthBoard:
    """Health of every worker the leader knows. Methods return the status change, if any; the
    caller publishes it."""

    def __init__(self, config: HealthConfig | None = None) -> None:
        self.config = config or HealthConfig()
        self._workers: dict[str, WorkerHealth] = {}

    def worker(self, worker_id: str) -> WorkerHealth:
        w = self._workers.get(worker_id)
        if w is None:
            w = self._workers[worker_id] = WorkerHealth(worker_id, self.config)
        return w

    def workers(self) -> list[str]:
        return sorted(self._workers)

    def should_check(self, worker_id: str, now: float) -> bool:
        """Ask before sending a canary: False while the circuit is open; in half-open, True for
        exactly one trial."""
        return self.worker(worker_id).breaker.allow(now)

    def on_canary(self, worker_id: str, ok: bool, latency: float, tokens_match: bool,
                  now: float, reason: str = "") -> StatusChange | None:
        """One canary result. ``ok`` False = no usable answer (``reason`` says why: timeout,
        refused, HTTP status); ``tokens_match`` False = answered with the wrong tokens."""
        w = self.worker(worker_id)
        if not ok:
            w.last_latency = latency
            return w.failure(f"canary failed: {reason or 'no response'}", now)
        if not tokens_match:
            w.last_latency = latency
            return w.failure("canary token mismatch", now)
        return w.canary_success(latency, now)

    def on_passive_failure(self, worker_id: str, reason: str, now: float) -> StatusChange | None:
        """A proxy error or timeout some replica saw while serving a real request."""
        return self.worker(worker_id).failure(f"passive: {reason}", now)

    def on_passive_success(self, worker_id: str, now: float) -> StatusChange | None:
        self.worker(worker_id).passive_success(now)
        return None

    def status(self, worker_id: str) -> HealthStatus:
        w = self._workers.get(worker_id)
        return w.status if w is not None else HealthStatus.HEALTHY

    def status_gauge(self, worker_id: str) -> int:
        return STATUS_GAUGE[self.status(worker_id)]

    def breaker_state(self, worker_id: str) -> BreakerState:
        w = self._workers.get(worker_id)
        return w.breaker.state if w is not None else BreakerState.CLOSED

    def breaker_gauge(self, worker_id: str) -> int:
        return BREAKER_GAUGE[self.breaker_state(worker_id)]

    def adopt(self, statuses: Mapping[str, str], worker_ids: Iterable[str], now: float) -> None:
        """Align the board with the replicated statuses (missing = healthy) for ``worker_ids``.
        Entries that already agree keep their breaker and baseline."""
        for worker_id in worker_ids:
            status = statuses.get(worker_id, HealthStatus.HEALTHY)
            w = self.worker(worker_id)
            if w.status != status:
                w.adopt(status, now)

    def forget(self, worker_id: str) -> None:
        """The worker is gone (retired, re-registered): a new incarnation starts clean."""
        self._workers.pop(worker_id, None)


class ReferenceAnswers:
    """What a healthy engine of each model answers to the canary prompt.

    Each worker's answer is pinned on its first healthy check. Engines of one model must agree
    at temperature 0, so the reference for a model is the strict majority of its workers' pins;
    with no majority (one worker, or a 1-1 split) a worker is held to its own pin. A worker that
    is wrong from its very first check is therefore caught as soon as the others outvote it.
    """

    def __init__(self) -> None:
        self._pins: dict[str, tuple[str, str]] = {}  # worker -> (model, answer)

    def pinned(self, worker_id: str) -> str | None:
        pin = self._pins.get(worker_id)
        return pin[1] if pin is not None else None

    def majority(self, model: str, extra: Mapping[str, str] | None = None) -> str | None:
        """The answer held by more than half of the model's pinned workers (plus ``extra``
        worker → answer candidates), if any."""
        answers = {w: a for w, (m, a) in self._pins.items() if m == model}
        answers.update(extra or {})
        if not answers:
            return None
        answer, votes = Counter(answers.values()).most_common(1)[0]
        return answer if votes * 2 > len(answers) else None

    def settle(self, model: str, candidates: Mapping[str, str]) -> None:
        """Pin first answers of healthy, not yet pinned workers of ``model``. With a majority
        (counting the candidates), only the answers agreeing with it are pinned."""
        fresh = {w: a for w, a in candidates.items() if w not in self._pins}
        majority = self.majority(model, fresh)
        for worker_id, answer in fresh.items():
            if majority is None or answer == majority:
                self._pins[worker_id] = (model, answer)

    def expected(self, worker_id: str, model: str) -> str | None:
        majority = self.majority(model)
        return majority if majority is not None else self.pinned(worker_id)

    def forget(self, worker_id: str) -> None:
        self._pins.pop(worker_id, None)
