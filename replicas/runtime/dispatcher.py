"""The request dispatcher: decide → count in the overlay → append the decision → hand back.

Routing decisions are appended to the router stream before the request is proxied, so a replica
killed mid-request leaves a trace every peer can account for (design.md §7). A decision counts
in this replica's load at once (`replicas.core.overlay`) and is reconciled when it comes back
from the stream, when JetStream refuses it, or when the request finishes first. With a queue
threshold, requests wait in the router queue while every worker is busy and are released in
policy order as load frees up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from eventlog import events as ev
from eventlog.appender import AppendFailed
from eventlog.names import ROUTER
from replicas.core import disagg
from replicas.core.candidates import (
    HEALTH_WEIGHT,
    build_candidates,
    check_routable,
    request_hashes,
    served_models,
)
from replicas.core.index import WorkerKey
from replicas.core.overlay import Overlay, pending_decision
from replicas.core.queue import RequestQueue, should_queue
from replicas.core.routing_errors import AllWorkersBusy, RoutingError
from replicas.core.selection import BusyThresholds, Candidate, Decision, Overloaded, Selector
from replicas.core.sticky import SessionRequest, StickyOverlay, session_events, sticky_target
from replicas.runtime.background import Background
from replicas.runtime.config import ReplicaConfig
from replicas.runtime.port import ReplicaPort

log = logging.getLogger("jetrouter.replica")


class DecisionNotRecorded(RoutingError):
    """JetStream refused the routing decision's append or did not ack it in time: the request
    is not served (docs/design-notes.md, "when JetStream says no")."""

    def __init__(self, request_id: str, cause: BaseException) -> None:
        super().__init__(f"the routing decision could not be recorded ({describe(cause)})")
        self.request_id = request_id
        self.cause = cause


def describe(exc: BaseException) -> str:
    cause = getattr(exc, "cause", None) or exc  # AppendFailed carries the server's answer
    if isinstance(cause, TimeoutError):
        return "no acknowledgement from JetStream in time"
    text = str(cause).strip() or type(cause).__name__
    return f"{type(cause).__name__}: {text}"[:300]


@dataclass(slots=True)
class DecisionLogHealth:
    """What /ready, metrics and logs say about recording routing decisions on this replica."""

    failures: int = 0          # decisions refused or timed out since start
    last_error: str | None = None
    last_failure_at: float | None = None  # time.monotonic()
    failing_since: float | None = None    # wall time of the first failure of the current run
    recent_window: float = 5.0  # seconds a failure keeps /ready at 503 without a success

    def failing(self, now: float) -> bool:
        return self.last_failure_at is not None and now - self.last_failure_at < self.recent_window

    def view(self, now: float) -> dict[str, object]:
        return {"ok": not self.failing(now), "failures": self.failures,
                "last_error": self.last_error, "failing_since": self.failing_since}


@dataclass(frozen=True, slots=True)
class RouteRequest:
    request_id: str
    model: str
    token_ids: Sequence[int]
    expected_osl: int = 128
    osl_hint: int = 0  # nvext.agent_hints.osl as the client gave it (0: none)
    priority: int = 0
    overlap_weight: float | None = None
    latency_sensitivity: float = 0.0
    exclude: frozenset[str] = frozenset()  # worker ids not to use (e.g. one that just failed)
    # Disaggregated serving (replicas/core/disagg.py): the prefill or decode decision, or an
    # aggregated one (never sent to a prefill-only engine of a disaggregated model).
    phase: disagg.Phase = disagg.AGGREGATED
    # nvext.session_control / X-Dynamo-Session-ID; a prefill decision ignores it (the session
    # is pinned to the engine that decodes, which holds the conversation's blocks).
    session: SessionRequest | None = None


@dataclass(slots=True)
class Routed:
    request_id: str
    worker_id: str
    worker_url: str
    dp_rank: int
    isl_tokens: int
    overlap_blocks: int
    total_blocks: int
    decision: Decision
    event: ev.RequestRouted
    timings: dict[str, float] = field(default_factory=dict)  # seconds per stage
    # SessionPinned / SessionReleased appended in the decision's own message.
    session_events: list[ev.Event] = field(default_factory=list)
    sticky: str | None = None  # "pinned" (went to its session's engine), "open", "repin"
    session: SessionRequest | None = None  # the request's session, for its migrated hops


_Queued = tuple[RouteRequest, "asyncio.Future[Routed]"]


class Dispatcher:
    def __init__(self, port: ReplicaPort, config: ReplicaConfig, rng: random.Random,
                 background: Background) -> None:
        self.port = port
        self.config = config
        self.rng = rng
        self.selector = Selector(config.routing)
        self.overlay = Overlay()
        self.sticky = StickyOverlay()  # pins routed here and not yet applied from the stream
        self.decision_log = DecisionLogHealth()
        # Set when the load may have dropped (a router or control event applied): the queue
        # dispatcher re-judges then.
        self.load_changed = asyncio.Event()
        # (reason) -> None: the HTTP layer's counter of decisions JetStream did not take.
        self.on_decision_refused: Callable[[str], None] | None = None
        self._queue: RequestQueue[_Queued] = RequestQueue(config.queue_policy)
        # Output counts waiting to be appended as OutputProgress, per request: one append in
        # flight per request at a time, carrying the newest count when it goes.
        self._progress: dict[str, int] = {}
        self._background = background
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._dispatch_queue(), name="queue-dispatcher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task

    # --- deciding --------------------------------------------------------------------------

    def thresholds_for(self, model: str) -> BusyThresholds:
        return self.port.state.thresholds_for(model) or self.config.default_thresholds

    def settle(self, request_id: str) -> None:
        """The decision is in the state now (or never will be): stop counting it here."""
        self.overlay.reconcile(request_id)
        self.sticky.settled(request_id)

    def forget_pending(self) -> None:
        """A reset re-reads the streams from its cut: nothing pending survives it."""
        self.overlay.clear()
        self.sticky.clear()

    def candidates(self, model: str, seq_hashes: Sequence[int],
                   exclude: frozenset[str] = frozenset(),
                   phase: disagg.Phase = disagg.AGGREGATED) -> list[Candidate]:
        routing = self.config.routing
        return build_candidates(self.port.state, model, seq_hashes, exclude=exclude,
                                overlay=self.overlay, phase=phase,
                                assume_kv_reuse=self.config.assume_kv_reuse,
                                track_active_blocks=routing.track_active_blocks,
                                track_prefill_tokens=routing.track_prefill_tokens)

    def decide(
        self, req: RouteRequest, only: WorkerKey | None = None
    ) -> tuple[Decision | Overloaded, list[int], dict[str, float]]:
        state = self.port.state
        check_routable(state, req.model)
        t0 = time.perf_counter()
        seq_hashes = request_hashes(state, req.model, req.token_ids,
                                    self.config.state.block_size)
        t1 = time.perf_counter()
        cands = self.candidates(req.model, seq_hashes, req.exclude, req.phase)
        if only is not None:
            cands = [c for c in cands if c.worker == only]
        t2 = time.perf_counter()
        weight = disagg.DECODE_TRANSFER_WEIGHT if req.phase == disagg.DECODE \
            else req.overlap_weight
        result = self.selector.select(cands, len(req.token_ids), self.rng,
                                      overlap_weight=weight,
                                      thresholds=self.thresholds_for(req.model))
        if only is not None and isinstance(result, Overloaded) and cands:
            # A session stays on its engine even when that engine is over a busy threshold:
            # its cache holds the conversation, and the pin bypasses scoring (as in Dynamo).
            result = Decision(only, cands[0].overlap_blocks, result.costs)
        t3 = time.perf_counter()
        return result, seq_hashes, {"hashing": t1 - t0, "matching": t2 - t1,
                                    "selection": t3 - t2, "total": t3 - t0}

    def _prepare(self, req: RouteRequest) -> Routed:
        """Synchronous part of routing: select and add the decision to the overlay."""
        state = self.port.state
        session = req.session if req.phase != disagg.PREFILL else None
        target, sticky = (sticky_target(state, self.sticky, session.session_id, req.model,
                                        req.exclude, HEALTH_WEIGHT)
                          if session is not None else (None, None))
        result, seq_hashes, timings = self.decide(req, only=target)
        if isinstance(result, Overloaded):
            raise AllWorkersBusy(result.reason)
        worker_id, dp_rank = result.worker
        info = state.workers[worker_id]
        now = time.time()
        event = ev.RequestRouted(
            request_id=req.request_id, replica_id=self.port.replica_id, worker_id=worker_id,
            dp_rank=dp_rank, isl_tokens=len(req.token_ids), block_seq_hashes=list(seq_hashes),
            overlap_blocks=result.overlap_blocks, expected_osl=req.expected_osl,
            priority=req.priority, ts=now, candidates=result.costs.rows(),
            model=req.model, block_size=self.config.state.block_size,
            phase=req.phase, kv_reuse=self.config.assume_kv_reuse,
            track_output_blocks=self.config.track_output_blocks, osl_hint=req.osl_hint,
            prefill_load_model=self.config.prefill_load_model)
        extra: list[ev.Event] = []
        if session is not None:
            extra = session_events(session, req.request_id, result.worker, req.model, sticky,
                                   now)
            self.sticky.routed(req.request_id, session, result.worker)
        self.overlay.add(req.request_id, pending_decision(
            state.load, result.worker, isl_tokens=len(req.token_ids),
            overlap_blocks=result.overlap_blocks, block_size=info.block_size,
            seq_hashes=seq_hashes, phase=req.phase, kv_reuse=self.config.assume_kv_reuse))
        return Routed(req.request_id, worker_id, info.url, dp_rank, len(req.token_ids),
                      result.overlap_blocks, len(seq_hashes), result, event, timings, extra,
                      sticky, session)

    # --- routing ---------------------------------------------------------------------------

    async def route(self, req: RouteRequest) -> Routed:
        """Decide, count the decision in our load at once, append it, hand back the worker."""
        if self.config.queue_threshold is not None and self._must_queue(req):
            fut: asyncio.Future[Routed] = asyncio.get_running_loop().create_future()
            self._queue.push((req, fut), arrival=time.monotonic(),
                             priority_jump=req.latency_sensitivity,
                             uncached_isl_tokens=len(req.token_ids))
            self.load_changed.set()
            try:
                routed = await asyncio.wait_for(asyncio.shield(fut), self.config.queue_timeout)
            except TimeoutError:
                with contextlib.suppress(ValueError):
                    self._queue.remove((req, fut))
                if fut.done() and not fut.cancelled() and fut.exception() is None:
                    self.settle(req.request_id)
                raise AllWorkersBusy("waited too long in the router queue") from None
        else:
            if req.session is not None:
                await self._catch_up_router()
            routed = self._prepare(req)
        recording = time.perf_counter()
        try:
            # A timeout scope rather than wait_for: no extra task per routed request.
            async with asyncio.timeout(self.config.decision_append_timeout):
                await self._append([routed.event, *routed.session_events]
                                   if routed.session_events else routed.event,
                                   f"{req.request_id}.routed")
        except (AppendFailed, TimeoutError) as exc:
            self.settle(req.request_id)  # the overlay must not keep what the log refused
            self._decision_refused(req.request_id, exc)
            raise DecisionNotRecorded(req.request_id, exc) from exc
        except BaseException:
            self.settle(req.request_id)
            raise
        # Time for JetStream to acknowledge the decision (not part of "total", the decision).
        routed.timings["record"] = time.perf_counter() - recording
        if self.decision_log.last_failure_at is not None:
            log.warning("replica %s records routing decisions again (after %d refused)",
                        self.port.replica_id, self.decision_log.failures)
            self.decision_log.last_failure_at = None
            self.decision_log.failing_since = None
        return routed

    def _decision_refused(self, request_id: str, exc: BaseException) -> None:
        """Count and log a decision JetStream did not take, and make sure it never counts:
        an append that timed out may still land later, so a RequestFinished follows it (same
        subject and connection, hence after it on the stream); if the decision never landed,
        that finish is a no-op for every replica."""
        health = self.decision_log
        why = describe(exc)
        reason = "timeout" if isinstance(exc, TimeoutError) or isinstance(
            getattr(exc, "cause", None), TimeoutError) else "refused"
        health.failures += 1
        health.last_error = why
        health.last_failure_at = time.monotonic()
        rid = self.port.replica_id
        if health.failing_since is None:
            health.failing_since = time.time()
            log.error("replica %s: JetStream did not take the routing decision of %s (%s); "
                      "refusing requests with 503 until it does", rid, request_id, why)
        else:
            log.warning("replica %s: routing decision of %s not recorded (%s)", rid,
                        request_id, why)
        if self.on_decision_refused is not None:
            self.on_decision_refused(reason)
        self._background.spawn(self._append(
            ev.RequestFinished(request_id, ev.Outcome.NOT_ROUTED, 0, time.time()),
            f"{request_id}.finished"))

    def prefill_completed(self, request_id: str) -> None:
        self._append_later(ev.PrefillCompleted(request_id, time.time()))

    def output_progress(self, request_id: str, output_tokens: int) -> None:
        """A tracked request crossed an output block boundary. Appends coalesce: while one is
        on its way, later counts wait and only the newest follows it."""
        waiting = request_id in self._progress
        self._progress[request_id] = output_tokens
        if not waiting:
            self._background.spawn(self._send_progress(request_id))

    async def _send_progress(self, request_id: str) -> None:
        sent = 0
        try:
            while (count := self._progress.get(request_id, sent)) > sent:
                sent = count
                await self._append(ev.OutputProgress(request_id, count, time.time()),
                                   f"{request_id}.out{count}")
        finally:
            if self._progress.get(request_id, sent) <= sent:
                self._progress.pop(request_id, None)

    def finished(self, request_id: str, outcome: str, output_tokens: int,
                 cached_tokens: int = -1) -> None:
        self.settle(request_id)
        self._progress.pop(request_id, None)  # the finish frees the output blocks anyway
        self._append_later(
            ev.RequestFinished(request_id, outcome, output_tokens, time.time(), cached_tokens))

    def _append_later(self, event: ev.Event) -> None:
        port = self.port
        port.append_later(port.names.router_subject(port.replica_id), event)

    async def _append(self, event: ev.Event | list[ev.Event], msg_id: str) -> int:
        port = self.port
        return await port.append(port.names.router_subject(port.replica_id), event, msg_id)

    async def _catch_up_router(self, timeout: float = 2.0) -> None:
        """Apply the router stream up to its current end before a session's turn is routed, so
        a pin another replica appended for the previous turn (acknowledged before that turn's
        answer reached the client) is seen here. One stream-info round trip; on failure or
        timeout the turn is routed with what this replica has."""
        try:
            last = await asyncio.wait_for(self.port.stream_end(ROUTER), timeout)
            await self.port.wait_applied(ROUTER, last, timeout)
        except Exception as exc:  # a slow or unreachable server must not fail the request
            log.info("session routing without a catch-up read: %s", describe(exc))

    # --- the router queue --------------------------------------------------------------------

    def _must_queue(self, req: RouteRequest) -> bool:
        threshold = self.config.queue_threshold
        assert threshold is not None
        if len(self._queue):
            return True  # keep arrival order: nobody overtakes the queue
        cands = self.candidates(req.model, ())
        return bool(cands) and should_queue(cands, threshold)

    async def _dispatch_queue(self) -> None:
        """Release queued requests in policy order while some worker has capacity. The decision
        is made here, synchronously, so each release already counts in the load the next
        release is judged by."""
        threshold = self.config.queue_threshold
        while True:
            await self.load_changed.wait()
            self.load_changed.clear()
            if threshold is None:
                continue
            while len(self._queue):
                state = self.port.state
                cands = [c for m in served_models(state) for c in self.candidates(m, ())]
                if cands and should_queue(cands, threshold):
                    break
                item = self._queue.pop()
                if item is None:
                    break
                req, fut = item
                if fut.done():
                    continue
                try:
                    fut.set_result(self._prepare(req))
                except RoutingError as exc:
                    fut.set_exception(exc)

    def pending_decisions(self) -> int:
        """Decisions in the optimistic overlay: routed here, not yet applied from the stream."""
        return len(self.overlay)

    def queue_depth(self) -> int:
        return len(self._queue)
