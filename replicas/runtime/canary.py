"""Canary health checks and passive health reports: the adapter around ``health.py``.

Only the leader checks. Every ``interval`` it sends each worker the same deterministic completion
(token-id prompt, temperature 0, ``max_tokens`` 8, non-streaming) and judges the answer against the
model's reference (:class:`~replicas.core.health.ReferenceAnswers`, or a known expected text), and
its latency against the worker's baseline. A check that times out while the engine's own token
counters (its /metrics) advance, or that already had requests in flight and still answers
``/health``, is *busy*, not failed: a real engine on a loaded host is slow for seconds at a time
(long prompts, kernels compiled for new shapes, a first KV transfer) without being dead, and is not
judged by that attempt. So is a right but slow answer from an engine that had other requests in
flight when the check was sent: they share its steps, so its latency says nothing of the engine's
own speed (an idle engine's slow answer still makes it SUSPICIOUS). A failed check is retried at
once up to ``max_retries`` times (2 by default), each attempt counting on the breaker, so a worker
returning wrong tokens goes HEALTHY → SUSPICIOUS → UNHEALTHY within one round, while a one-off blip
(failure, then success) only costs a brief SUSPICIOUS. A timeout is not retried at once: asking a
slow engine again only adds to its load, and three timeouts in one round would condemn an engine
for a few seconds of slowness; it takes timeouts in three rounds (the breaker's threshold) to mark
an engine that answers nothing and makes no progress unhealthy.

Passive signals: any replica's proxy that sees an engine fail (connection refused or reset,
5xx, idle timeout) calls :func:`report_passive`, a core-NATS publish of
``{"worker_id", "reason"}`` on ``<ns>.health.report``; the leader's checker feeds them to the same
breakers. Status changes are appended to the control stream through the replica port while this
replica leads; an append that fails is retried at the start of the next round.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum

import httpx
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from eventlog.names import Names
from replicas.core.health import HealthBoard, HealthStatus, ReferenceAnswers, StatusChange
from replicas.runtime.port import ReplicaPort

log = logging.getLogger("jetrouter.canary")

# A fixed multi-token prompt: a single token would not exercise attention.
# Ids stay under 1100 so every real vocabulary has them: vLLM answers 400 to an id beyond the
# model's vocabulary, which made every engine of a small model look unhealthy.
CANARY_PROMPT: tuple[int, ...] = tuple(100 + (i * 7919) % 1000 for i in range(24))
CANARY_MAX_TOKENS = 8
TIMEOUT = "timeout"  # Attempt.reason of a check that got no answer in time

class CanaryVerdict(StrEnum):
    """How one canary went: the ``outcome`` label of the health-check-duration metric."""

    OK = "ok"
    SLOW = "slow"          # right tokens, latency above slow_factor x the worker's baseline
    MISMATCH = "mismatch"  # an answer, but not the reference tokens
    ERROR = "error"        # no answer (connection, status, timeout, malformed body)
    BUSY = "busy"          # timed out while the engine was working: not judged


# Observer for the health-check-duration metric: (worker_id, seconds, verdict).
OnCheck = Callable[[str, float, str], None]


async def report_passive(nc: NatsClient, names: Names, worker_id: str, reason: str) -> None:
    """Tell the leader a real request to ``worker_id`` failed (fire and forget; best effort)."""
    body = json.dumps({"worker_id": worker_id, "reason": reason}).encode()
    try:
        await nc.publish(names.health_report_subject, body)
    except Exception:  # a health hint must never fail the request path
        log.debug("could not publish a passive health report for %s", worker_id, exc_info=True)


@dataclass(frozen=True, slots=True)
class Attempt:
    ok: bool            # a 200 with a parsable completion
    latency: float      # seconds, request sent → full answer
    text: str = ""
    reason: str = ""    # why not ok
    # Timed out, but the engine's own token counters moved meanwhile: it is slow because it is
    # busy (long prompts, a first KV transfer), not dead, so the attempt is not judged.
    busy: bool = False
    # The engine had other requests in flight when the check was sent: a slow answer is their
    # doing (they share its steps), not a slow engine's, so its latency is not judged.
    loaded: bool = False


# Counters an engine's /metrics advances as it makes progress: output tokens (vLLM, SGLang and
# the simulated engine) and vLLM's prompt tokens (counted when a prompt's prefill completes).
# Not a counter of requests received: an engine that takes a request and then hangs must not
# look busy.
PROGRESS_SUFFIXES = ("generation_tokens_total",)
PROGRESS_NAMES = frozenset({"vllm:prompt_tokens_total"})
# A real engine's own count of requests it is running or has queued (vLLM, SGLang). A step can
# take many seconds with no counter moving (the first requests after a start compile kernels
# for new shapes on a CPU engine), so requests in flight before the check, together with the
# engine's own /health, also explain a timeout.
IN_FLIGHT_NAMES = frozenset(f"{engine}:num_requests_{state}" for engine in ("vllm", "sglang")
                            for state in ("running", "waiting"))


@dataclass(frozen=True, slots=True)
class Progress:
    tokens: float | None  # the progress counters summed; None: the engine has none
    in_flight: float      # requests the engine runs or queues (0 when it does not say)


def progress_of(metrics_text: str) -> Progress:
    """The progress counters and in-flight gauges of a Prometheus text page."""
    total, seen, in_flight = 0.0, False, 0.0
    for line in metrics_text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        counter = name in PROGRESS_NAMES or name.endswith(PROGRESS_SUFFIXES)
        if not counter and name not in IN_FLIGHT_NAMES:
            continue
        try:
            value = float(line.rsplit(" ", 1)[1])
        except ValueError:
            continue
        if counter:
            total, seen = total + value, True
        else:
            in_flight += value
    return Progress(total if seen else None, in_flight)


class CanaryChecker:
    def __init__(
        self,
        client: httpx.AsyncClient,
        board: HealthBoard,
        replica: ReplicaPort,
        *,
        interval: float = 30.0,
        timeout: float = 5.0,
        expected_of: Callable[[str], str | None] | None = None,
        nc: NatsClient | None = None,
        max_retries: int = 2,
        on_check: OnCheck | None = None,
        clock: Callable[[], float] = time.time,
        prompt: tuple[int, ...] = CANARY_PROMPT,
        max_tokens: int = CANARY_MAX_TOKENS,
    ) -> None:
        """``replica``: the registered workers, their models and the replicated health map
        (adopted when this replica becomes leader) come from its state; status changes are
        appended through it to the control stream while it leads. ``expected_of(model)`` → a
        known right answer (text) or None to learn it; ``nc`` enables the passive-report
        subscriber."""
        self.client = client
        self.board = board
        self.interval = interval
        self.timeout = timeout
        self.replica = replica
        self.expected_of = expected_of
        self.nc = nc
        self.names: Names = replica.names
        self.max_retries = max_retries
        self.on_check = on_check
        self.clock = clock
        self.prompt = list(prompt)
        self.max_tokens = max_tokens
        self.references = ReferenceAnswers()
        self.rounds = 0          # rounds started (tests count detection in rounds, not seconds)
        self.ticks = 0           # loop iterations, leader or not
        self.reports = 0         # passive reports received, leader or not
        self.busy = 0            # attempts that timed out on an engine making progress
        self._leading = False
        self._published: dict[str, str] = {}  # worker -> last status emit() accepted
        self._emit_lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self._sub: Subscription | None = None

    # --- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        if self.nc is not None:
            self._sub = await self.nc.subscribe(self.names.health_report_subject,
                                                cb=self._on_report)
        self._task = asyncio.create_task(self._loop(), name="canary-checker")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None

    async def _loop(self) -> None:
        while True:
            started = time.monotonic()
            self.ticks += 1
            try:
                if self._lead():
                    await self.check_all()
            except Exception:  # one bad round must not end health checking
                log.exception("canary round failed")
            await asyncio.sleep(max(0.0, self.interval - (time.monotonic() - started)))

    def _lead(self) -> bool:
        """Track leadership; on gaining it, adopt the replicated statuses as the starting point."""
        leading = self.replica.is_leader
        if leading and not self._leading:
            current = self.replica.state.health
            ids = set(self.workers())
            self.board.adopt(current, ids, self.clock())
            self._published = {w: current.get(w, HealthStatus.HEALTHY) for w in ids}
        self._leading = leading
        return leading

    def workers(self) -> dict[str, str]:
        """Registered worker id → its base URL."""
        return {w: info.url for w, info in self.replica.state.workers.items()}

    def model_of(self, worker_id: str) -> str:
        return self.replica.state.workers[worker_id].model

    async def emit(self, change: StatusChange) -> None:
        """Announce a change on the control stream, only while leading (leadership may have
        moved during the round)."""
        if self.replica.is_leader:
            await self.replica.append(
                self.names.control_subject("health"), change.event(),
                f"health.{change.worker_id}.{change.ts}.{change.new}")

    # --- one round ------------------------------------------------------------------------------

    async def check_all(self) -> list[StatusChange]:
        """One round over every registered worker; returns the status changes it emitted."""
        self.rounds += 1
        workers = dict(self.workers())
        self._forget_gone(workers)
        emitted = await self._republish()
        due = [w for w in sorted(workers) if self.board.should_check(w, self.clock())]
        first = await asyncio.gather(*(self._attempt(w, workers[w]) for w in due))
        attempts = dict(zip(due, first, strict=True))
        self._pin_first_answers(attempts)
        retry: list[str] = []
        for worker_id, attempt in attempts.items():
            if not await self._judge(worker_id, attempt, emitted) and \
                    attempt.reason != TIMEOUT:
                retry.append(worker_id)
        await asyncio.gather(*(self._retry(w, workers[w], emitted) for w in retry))
        return emitted

    def _forget_gone(self, workers: Mapping[str, str]) -> None:
        for worker_id in set(self.board.workers()) - set(workers):
            self.board.forget(worker_id)
            self.references.forget(worker_id)
            self._published.pop(worker_id, None)

    async def _republish(self) -> list[StatusChange]:
        """Restate, from the board's current view, any status whose emit failed earlier."""
        out: list[StatusChange] = []
        for worker_id in self.board.workers():
            now_status = self.board.status(worker_id)
            was = self._published.get(worker_id, HealthStatus.HEALTHY)
            if now_status != was:
                reason = self.board.worker(worker_id).last_reason
                await self._publish(StatusChange(worker_id, was, now_status, reason,
                                                 self.clock()), out)
        return out

    def _pin_first_answers(self, attempts: Mapping[str, Attempt]) -> None:
        by_model: dict[str, dict[str, str]] = {}
        for worker_id, a in attempts.items():
            w = self.board.worker(worker_id)
            if (a.ok and w.status == HealthStatus.HEALTHY
                    and self.references.pinned(worker_id) is None):
                by_model.setdefault(self.model_of(worker_id), {})[worker_id] = a.text
        for model, answers in by_model.items():
            self.references.settle(model, answers)

    async def _retry(self, worker_id: str, url: str, emitted: list[StatusChange]) -> None:
        for _ in range(self.max_retries):
            if not self.board.should_check(worker_id, self.clock()):
                return
            attempt = await self._attempt(worker_id, url)
            if await self._judge(worker_id, attempt, emitted) or attempt.reason == TIMEOUT:
                return

    async def _judge(self, worker_id: str, a: Attempt, emitted: list[StatusChange]) -> bool:
        """Feed one attempt to the board and publish any change. True when it passed; a slow
        answer passes (it is not retried: only a correctness failure is)."""
        model = self.model_of(worker_id)
        expected = self.expected_of(model) if self.expected_of is not None else None
        if expected is None:
            expected = self.references.expected(worker_id, model)
        match = a.ok and (expected is None or a.text == expected)
        if a.busy or (match and a.loaded and self.board.worker(worker_id).is_slow(a.latency)):
            self.busy += 1
            log.info("worker %s: canary %s after %.1f s while the engine %s (busy, not judged)",
                     worker_id, "timed out" if a.busy else "answered right but slowly",
                     a.latency, "made progress" if a.busy else "had other requests in flight")
            if self.on_check is not None:
                self.on_check(worker_id, a.latency, CanaryVerdict.BUSY)
            return True  # not retried: another request would only add to the load
        if self.on_check is not None:
            slow = match and self.board.worker(worker_id).is_slow(a.latency)
            verdict = CanaryVerdict.ERROR if not a.ok else CanaryVerdict.MISMATCH if not match \
                else CanaryVerdict.SLOW if slow else CanaryVerdict.OK
            self.on_check(worker_id, a.latency, verdict)
        change = self.board.on_canary(worker_id, a.ok, a.latency, match, self.clock(), a.reason)
        if change is not None:
            await self._publish(change, emitted)
        return match

    async def _attempt(self, worker_id: str, url: str) -> Attempt:
        body = {"model": self.model_of(worker_id), "prompt": self.prompt,
                "max_tokens": self.max_tokens, "temperature": 0.0, "stream": False}
        before = await self._progress(url)
        started = time.monotonic()
        try:
            r = await self.client.post(url.rstrip("/") + "/v1/completions", json=body,
                                       headers={"x-request-id": f"canary-{self.rounds}"},
                                       timeout=self.timeout)
        except httpx.TimeoutException:
            latency = time.monotonic() - started
            return Attempt(False, latency, reason=TIMEOUT,
                           busy=await self._busy(url, before))
        except (httpx.HTTPError, httpx.InvalidURL) as exc:  # InvalidURL: a registered url
            return Attempt(False, time.monotonic() - started, reason=type(exc).__name__)
        latency = time.monotonic() - started
        if r.status_code != 200:
            return Attempt(False, latency, reason=f"HTTP {r.status_code}")
        try:
            text = r.json()["choices"][0]["text"]
            if not isinstance(text, str):
                raise TypeError("text is not a string")
        except (ValueError, KeyError, IndexError, TypeError):
            return Attempt(False, latency, reason="malformed completion")
        return Attempt(True, latency, text, loaded=before is not None and before.in_flight > 0)

    async def _progress(self, url: str) -> Progress | None:
        """The engine's progress now (``progress_of`` its /metrics), or None."""
        try:
            r = await self.client.get(url.rstrip("/") + "/metrics", timeout=self.timeout)
        except (httpx.HTTPError, httpx.InvalidURL):
            return None
        return progress_of(r.text) if r.status_code == 200 else None

    async def _busy(self, url: str, before: Progress | None) -> bool:
        """After a timeout: whether the engine is working rather than dead. Its token counters
        moved since ``before``; or it already had requests in flight then and its own /health
        still answers (vLLM's fails once its engine core is gone)."""
        if before is None:
            return False
        after = await self._progress(url)
        if after is None:
            return False
        if before.tokens is not None and after.tokens is not None and after.tokens > before.tokens:
            return True
        if before.in_flight <= 0:
            return False
        try:
            r = await self.client.get(url.rstrip("/") + "/health", timeout=self.timeout)
        except (httpx.HTTPError, httpx.InvalidURL):
            return False
        return r.status_code == 200

    async def _publish(self, change: StatusChange,
                       emitted: list[StatusChange] | None = None) -> None:
        # One emit at a time, in the order the board produced the changes (the lock is FIFO and
        # every caller asks for it before any other await), so the log's last word per worker is
        # the board's.
        async with self._emit_lock:
            try:
                await self.emit(change)
            except Exception:
                log.warning("could not publish %s → %s for %s; retrying next round",
                            change.old, change.new, change.worker_id, exc_info=True)
                return
        self._published[change.worker_id] = change.new
        if emitted is not None:
            emitted.append(change)
        log.warning("worker %s: %s → %s (%s)", change.worker_id, change.old, change.new,
                    change.reason)

    # --- passive reports ------------------------------------------------------------------------

    async def _on_report(self, msg: Msg) -> None:
        self.reports += 1
        if not self._lead():
            return
        try:
            doc = json.loads(msg.data)
            worker_id, reason = doc["worker_id"], doc.get("reason", "error")
            if not isinstance(worker_id, str) or not isinstance(reason, str):
                raise TypeError("worker_id and reason must be strings")
        except (ValueError, KeyError, TypeError):
            log.debug("ignoring a malformed health report: %r", msg.data[:200])
            return
        if worker_id not in self.workers():
            return  # stale: the worker is gone
        change = self.board.on_passive_failure(worker_id, reason, self.clock())
        if change is not None:
            await self._publish(change)
