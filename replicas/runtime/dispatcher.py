"""The request dispatcher: decide → count in the overlay → submit the decision's append → hand back.

Routing decisions are appended to the router stream before anything of the request reaches its
client, so a replica killed mid-request leaves a trace every peer can account for (design.md
§7). `route` does not wait for the append: the request goes to its engine at once and waits for
its decision (`recorded`, `replicas.runtime.decision_log`) only before it answers the client. A
decision counts in this replica's load at once (`replicas.core.overlay`) and is reconciled when
it comes back from the stream, when JetStream refuses it, or when the request finishes first.
With a queue threshold, requests wait in the router queue while every worker is busy and are
released in policy order as load frees up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from eventlog import events as ev
from eventlog.appender import AppendFailed
from eventlog.names import ROUTER
from replicas.core import disagg
from replicas.core.candidate_columns import COLUMNS_FROM_ROWS, select_columns
from replicas.core.candidates import (
    HEALTH_WEIGHT,
    CandidateRowCache,
    build_candidate_columns,
    build_candidates,
    check_routable,
    request_hashes,
    served_models,
)
from replicas.core.fair_queue import FairQueue
from replicas.core.index import WorkerKey
from replicas.core.overlay import Overlay, pending_decision
from replicas.core.queue import RequestQueue, should_queue
from replicas.core.release_turns import turn_distance
from replicas.core.routing_errors import AllWorkersBusy, NoWorkers, RoutingError
from replicas.core.selection import BusyThresholds, Candidate, Decision, Overloaded, Selector
from replicas.core.sticky import SessionRequest, StickyOverlay, session_events, sticky_target
from replicas.core.stored_responses import Lookup, response_target
from replicas.core.tenant_admission import TenantPending, Verdict, admit
from replicas.core.tenant_headroom import NO_HEADROOM
from replicas.runtime.background import Background
from replicas.runtime.config import ReplicaConfig
from replicas.runtime.decision_log import (
    DecisionLog,
    DecisionLogHealth,
    DecisionRecord,
    describe,
)
from replicas.runtime.log_outage import LogOutage, LogUnavailable
from replicas.runtime.port import ReplicaPort
from replicas.runtime.tenant_shares import TenantShares

log = logging.getLogger("jetrouter.replica")

# Seconds a replica waits per place it stands behind the replica whose turn it is to fill an
# engine's opening (replicas/core/release_turns.py): longer than a peer's decision takes to be
# applied here (a few milliseconds on a busy 2-core host), short beside a prefill.
RELEASE_TURN_GRACE = 0.025
# Seconds since a replica's newest decision for which it keeps its place in the turns' ring
# (a replica with a backlog decides at least once a round of turns).
RELEASE_TURN_RING = 10.0


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
    # The one engine this request may go to (a Responses API follow-up must reach the engine
    # that stored the previous response); it wins over a session's pin.
    pinned: WorkerKey | None = None
    # The tenant the request is admitted for ("": none) and the tokens its admission reserves
    # (replicas/core/tenants.py); recorded on the decision.
    tenant: str = ""
    tenant_tokens: int = 0
    # vLLM's cache_salt the engine gets with this prompt (an isolated tenant's): its blocks
    # hash under it (eventlog.hashing.cache_salt_salt).
    cache_salt: str = ""
    # A decode decision's KV hand-off: the blocks its engine receives (-1: none); recorded on
    # the decision for the ledger, read by no routing rule.
    transfer_blocks: int = -1


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
    # The decision's append (Dispatcher.recorded waits for it); None: nothing to wait for.
    record: DecisionRecord | None = None
    queued_s: float = 0.0  # seconds waited in the router queue before the decision (a trace span)


_Queued = tuple[RouteRequest, "asyncio.Future[Routed]"]


class Dispatcher:
    def __init__(self, port: ReplicaPort, config: ReplicaConfig, rng: random.Random,
                 background: Background) -> None:
        self.port = port
        self.config = config
        self.rng = rng
        self.selector = Selector(config.routing)
        self.overlay = Overlay()
        self.candidate_rows = CandidateRowCache()  # who may be picked, until the roster moves
        self.sticky = StickyOverlay()  # pins routed here and not yet applied from the stream
        # Tenant admissions made here and not yet applied from the stream.
        self.tenant_pending = TenantPending()
        # Degraded mode (replicas/runtime/log_outage.py): while the event log is unavailable,
        # decisions are counted in the overlay only, and neither they nor their follow-up
        # events are appended.
        self.outage = LogOutage(port.replica_id, after_disconnect=config.log_outage_after,
                                after_unacknowledged=config.decision_append_timeout)
        self.decisions = DecisionLog(port.replica_id, grace=config.decision_record_grace,
                                     timeout=config.decision_append_timeout,
                                     settle=self.settle, outage=self.outage)
        self._unlogged: set[str] = set()  # request ids routed in degraded mode, still running
        # Set when the load may have dropped (a router or control event applied): the queue
        # dispatcher re-judges then.
        self.load_changed = asyncio.Event()
        # Counters, lifts and headroom of tenants (replicas/runtime/tenant_shares.py).
        self.shares = TenantShares(port, self.tenant_pending, self.overlay, self._queued_tokens,
                                   config.tenant_headroom if config.tenant_fair_queue else 0.0)
        self._queue: RequestQueue[_Queued] | FairQueue[_Queued] = (
            FairQueue(config.queue_policy, self.shares.service, self.shares.lifts)
            if config.tenant_fair_queue
            else RequestQueue(config.queue_policy))
        # With tenants, releases take turns between replicas (replicas/core/release_turns.py):
        # when this replica first saw each worker rank's current opening (monotonic seconds).
        self._turns = config.tenant_fair_queue
        self._free_since: dict[WorkerKey, float] = {}
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

    @property
    def decision_log(self) -> DecisionLogHealth:
        return self.decisions.health

    @property
    def on_decision_refused(self) -> Callable[[str], None] | None:
        """(reason) -> None: the HTTP layer's counter of decisions JetStream did not take."""
        return self.decisions.on_refused

    @on_decision_refused.setter
    def on_decision_refused(self, hook: Callable[[str], None] | None) -> None:
        self.decisions.on_refused = hook

    # --- deciding --------------------------------------------------------------------------

    def thresholds_for(self, model: str) -> BusyThresholds:
        return self.port.state.thresholds_for(model) or self.config.default_thresholds

    def settle(self, request_id: str) -> None:
        """The decision is in the state now (or never will be): stop counting it here."""
        self.overlay.reconcile(request_id)
        self.sticky.settled(request_id)
        self.tenant_pending.settle(request_id)

    def forget_pending(self) -> None:
        """A reset re-reads the streams from its cut: nothing pending survives it."""
        self.overlay.clear()
        self.sticky.clear()
        self.tenant_pending.clear()

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
                                    self.config.state.block_size, req.cache_salt)
        t1 = time.perf_counter()
        weight = disagg.DECODE_TRANSFER_WEIGHT if req.phase == disagg.DECODE \
            else req.overlap_weight
        thresholds = self.thresholds_for(req.model)
        rows = self.candidate_rows.get(state, req.model, req.exclude, req.phase)
        pinned_overlap: int | None = None
        if len(rows.workers) >= COLUMNS_FROM_ROWS:
            # Columns, not a Candidate object per row: the same decision (candidate_columns.py)
            # for a fraction of the cost at fleet size.
            routing = self.config.routing
            columns = build_candidate_columns(
                state, req.model, seq_hashes, exclude=req.exclude, overlay=self.overlay,
                phase=req.phase, assume_kv_reuse=self.config.assume_kv_reuse,
                track_active_blocks=routing.track_active_blocks,
                track_prefill_tokens=routing.track_prefill_tokens, rows=rows)
            if only is not None:
                columns = columns.take([i for i, k in enumerate(columns.workers) if k == only])
                pinned_overlap = int(columns.overlap_blocks[0]) if len(columns) else None
            t2 = time.perf_counter()
            result = select_columns(self.selector, columns, len(req.token_ids), self.rng,
                                    overlap_weight=weight, thresholds=thresholds)
        else:
            cands = self.candidates(req.model, seq_hashes, req.exclude, req.phase)
            if only is not None:
                cands = [c for c in cands if c.worker == only]
                pinned_overlap = cands[0].overlap_blocks if cands else None
            t2 = time.perf_counter()
            result = self.selector.select(cands, len(req.token_ids), self.rng,
                                          overlap_weight=weight, thresholds=thresholds)
        if only is not None and isinstance(result, Overloaded) and pinned_overlap is not None:
            # A session stays on its engine even when that engine is over a busy threshold:
            # its cache holds the conversation, and the pin bypasses scoring (as in Dynamo).
            result = Decision(only, pinned_overlap, result.costs)
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
        if req.pinned is not None:
            target = req.pinned
            if target not in {c.worker for c in self.candidates(req.model, (), req.exclude,
                                                                req.phase)}:
                raise NoWorkers(f"engine {target[0]} (rank {target[1]}) cannot take requests "
                                f"for model {req.model!r} now")
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
            priority=req.priority, ts=now,
            candidates=result.costs.rows(self.config.decision_candidates, result.worker),
            model=req.model, block_size=self.config.state.block_size,
            phase=req.phase, kv_reuse=self.config.assume_kv_reuse,
            track_output_blocks=self.config.track_output_blocks, osl_hint=req.osl_hint,
            prefill_load_model=self.config.prefill_load_model,
            tenant=req.tenant, tenant_tokens=req.tenant_tokens,
            transfer_blocks=req.transfer_blocks)
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

    def admit_tenant(self, request_id: str, tenant: str, tokens: int) -> Verdict:
        """Judge a tenant's request against its limits, on the applied usage plus this
        replica's own pending admissions; an admitted one counts as pending at once (no await
        between the judgement and the count, so two requests on this replica cannot both take
        the last unit of a budget)."""
        now = time.time()
        verdict = admit(self.port.state.tenants, self.tenant_pending, tenant, now, tokens)
        if verdict.admitted:
            self.tenant_pending.add(request_id, tenant, now, tokens)
        return verdict

    # --- routing ---------------------------------------------------------------------------

    async def route(self, req: RouteRequest) -> Routed:
        """Decide, count the decision in our load at once, submit its append and hand back the
        worker without waiting for the acknowledgement (:meth:`recorded` waits for it)."""
        held = self._held_unless_queued(req)
        if held is None:
            fut: asyncio.Future[Routed] = asyncio.get_running_loop().create_future()
            queued_at = time.perf_counter()
            self._enqueue((req, fut))
            self.load_changed.set()
            try:
                routed = await asyncio.wait_for(asyncio.shield(fut), self.config.queue_timeout)
            except TimeoutError:
                with contextlib.suppress(ValueError):
                    self._queue.remove((req, fut))
                if fut.done() and not fut.cancelled() and fut.exception() is None:
                    self.settle(req.request_id)
                raise AllWorkersBusy("waited too long in the router queue") from None
            routed.queued_s = time.perf_counter() - queued_at
        else:
            if req.session is not None:
                await self._catch_up_router()
            routed = self._prepare_into(req, held)
        port = self.port
        if self.outage.degraded(time.monotonic()):
            # The log cannot take it: serve on the overlay's count alone (released when the
            # request finishes), and append nothing for this request.
            self._unlogged.add(req.request_id)
            if self.config.decision_record_grace > 0:
                self.outage.skipped_decision()
                return routed
            # Strict mode: refused at once (recorded() raises), never served unrecorded.
            refused: asyncio.Future[int] = asyncio.get_running_loop().create_future()
            refused.set_exception(AppendFailed(port.names.router_subject(port.replica_id),
                                               f"{req.request_id}.routed", LogUnavailable()))
            routed.record = self.decisions.track(req.request_id, refused)
            return routed
        # Submitted now, in this order, so nothing of this request precedes its decision on
        # the subject; acknowledged while the request is on its way to the engine.
        events = [routed.event, *routed.session_events]
        recording = time.perf_counter()
        future = port.submit(port.names.router_subject(port.replica_id), events,
                             f"{req.request_id}.routed")
        routed.record = self.decisions.track(req.request_id, future)
        timings = routed.timings

        def acknowledged(f: asyncio.Future[int]) -> None:
            # Time for JetStream to acknowledge the decision (not part of "total", the decision).
            if not f.cancelled() and f.exception() is None:
                timings["record"] = time.perf_counter() - recording

        future.add_done_callback(acknowledged)
        return routed

    async def recorded(self, routed: Routed) -> None:
        """Until ``routed``'s decision is recorded, or served unrecorded past the grace (an
        election); raises :class:`DecisionNotRecorded` when JetStream refused it. Its caller
        must then send nothing to the client and end the request as ``not_routed``."""
        if routed.record is not None:
            await self.decisions.wait(routed.record)

    def prefill_completed(self, request_id: str) -> None:
        if request_id in self._unlogged:
            self.outage.skipped_followup()
            return
        self._append_later(ev.PrefillCompleted(request_id, time.time()))

    def output_progress(self, request_id: str, output_tokens: int) -> None:
        """A tracked request crossed an output block boundary. Appends coalesce: while one is
        on its way, later counts wait and only the newest follows it."""
        if request_id in self._unlogged:
            return  # its decision was never appended: nothing on the stream to progress
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
        self._progress.pop(request_id, None)  # the finish frees the output blocks anyway
        if request_id in self._unlogged:
            # Decided while the log was down: nothing of it is on the stream, so nothing ends
            # there; the overlay releases its load below.
            self._unlogged.discard(request_id)
            self.outage.skipped_followup()
        else:
            # The finish goes to the stream first: every replica frees the request's load by
            # it, whatever happens to this replica's own bookkeeping below.
            self._append_later(ev.RequestFinished(request_id, outcome, output_tokens,
                                                  time.time(), cached_tokens))
        self.settle(request_id)

    async def store_response(self, response_id: str, routed: Routed, ttl: float) -> None:
        """Record that ``routed``'s engine stored the response ``response_id``; returns once
        JetStream has it, so a follow-up sent to any replica after this can find it."""
        event = ev.ResponseStored(response_id, routed.worker_id, routed.dp_rank,
                                  routed.event.model, ttl, time.time(), routed.request_id)
        await self._append(event, f"{routed.request_id}.stored")

    async def stored_response(self, response_id: str) -> tuple[WorkerKey | None, Lookup]:
        """Where the response ``response_id`` is stored. An id this replica has not seen yet
        may have been recorded by another one a moment ago: the router stream is read up to
        its end once before the id is called unknown."""
        state = self.port.state
        found = response_target(state.responses, state.workers, state.health, HEALTH_WEIGHT,
                                response_id)
        if found[1] != Lookup.UNKNOWN:
            return found
        await self._catch_up_router()
        state = self.port.state
        return response_target(state.responses, state.workers, state.health, HEALTH_WEIGHT,
                               response_id)

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
        if self.outage.degraded(time.monotonic()):
            return  # no server to ask: asking would only delay the turn
        try:
            last = await asyncio.wait_for(self.port.stream_end(ROUTER), timeout)
            await self.port.wait_applied(ROUTER, last, timeout)
        except Exception as exc:  # a slow or unreachable server must not fail the request
            log.info("session routing without a catch-up read: %s", describe(exc))

    # --- the router queue --------------------------------------------------------------------

    def _held_unless_queued(self, req: RouteRequest) -> frozenset[str] | None:
        """None when ``req`` must wait in the router queue; otherwise the engines it may not go
        to now: those held for tenants under their share, when it is over its own (none
        without a queue threshold or headroom)."""
        threshold = self.config.queue_threshold
        if threshold is None:
            return frozenset()
        if len(self._queue):
            return None  # keep arrival order: nobody overtakes the queue
        cands = self.candidates(req.model, ())
        if cands and should_queue(cands, threshold):
            return None
        if not cands or not self.shares.fraction:
            return frozenset()
        room = self.shares.headroom(cands, threshold)
        held = room.held if req.tenant not in room.under else frozenset()
        # An over-share tenant waits while every open engine is held for the others.
        open_engines = {c.worker[0] for c in cands
                        if c.active_prefill_tokens <= threshold * c.max_num_batched_tokens}
        return None if open_engines <= held else held

    def _queued_tokens(self, tenant: str) -> int:
        return self._queue.queued_tokens(tenant) if isinstance(self._queue, FairQueue) else 0

    def _enqueue(self, item: _Queued) -> None:
        req = item[0]
        if isinstance(self._queue, FairQueue):
            self._queue.push(item, arrival=time.monotonic(), priority_jump=req.latency_sensitivity,
                             uncached_isl_tokens=len(req.token_ids), tenant=req.tenant,
                             tier=req.priority, tokens=req.tenant_tokens)
        else:
            self._queue.push(item, arrival=time.monotonic(), priority_jump=req.latency_sensitivity,
                             uncached_isl_tokens=len(req.token_ids))

    async def _dispatch_queue(self) -> None:
        """Release queued requests in policy order while some worker has capacity. The decision
        is made here, synchronously, so each release already counts in the load the next
        release is judged by. With tenants, only into openings that are this replica's turn
        (``_openings``) and that the tenant may take (``_next_fair``: headroom); the loop
        wakes up when another one's grace runs out, or a held opening may be released."""
        threshold = self.config.queue_threshold
        wake: float | None = None
        while True:
            if wake is None:
                await self.load_changed.wait()
            else:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.load_changed.wait(), wake)
            self.load_changed.clear()
            wake = None
            if threshold is None:
                continue
            while len(self._queue):
                state = self.port.state
                cands = [c for m in served_models(state) for c in self.candidates(m, ())]
                mine = frozenset[str]()
                if self._turns:
                    # Every pass, so that an opening that closed is forgotten before the next.
                    mine, wake = self._openings(cands, threshold)
                if cands and should_queue(cands, threshold):
                    break
                not_mine = frozenset[str]()
                if isinstance(self._queue, FairQueue):
                    item, not_mine, recheck = self._next_fair(self._queue, cands, threshold,
                                                              mine)
                    if recheck is not None:
                        wake = recheck if wake is None else min(wake, recheck)
                else:
                    item = self._queue.pop()
                if item is None:
                    break
                req, fut = item
                if fut.done():
                    continue
                try:
                    fut.set_result(self._prepare_into(req, not_mine))
                except RoutingError as exc:
                    fut.set_exception(exc)
            if not self._queue:
                self._free_since.clear()  # nothing waits for the openings seen so far

    def _next_fair(self, queue: FairQueue[_Queued], cands: Sequence[Candidate],
                   threshold: float, mine: frozenset[str]
                   ) -> tuple[_Queued | None, frozenset[str], float | None]:
        """The next request the fair queue releases into an opening of this replica's, the
        engines it may not go to, and (when nothing goes because openings are held) seconds
        until the headroom may lapse by itself."""
        everyone = frozenset(c.worker[0] for c in cands)
        room = self.shares.headroom(cands, threshold)
        if room is NO_HEADROOM:
            return (queue.pop() if mine else None), everyone - mine, None
        item = queue.pop(lambda tenant: bool(room.engines_for(tenant, mine)))
        if item is None:
            recheck = room.recheck_at
            return None, everyone, None if recheck is None else max(recheck - time.time(), 0.0)
        return item, everyone - room.engines_for(item[0].tenant, mine), None

    def _openings(self, cands: Sequence[Candidate], threshold: float
                  ) -> tuple[frozenset[str], float | None]:
        """Workers with an opening this replica may fill now (its turn, or its grace for the
        turn-holder ran out), and seconds until the next one it waits for becomes its own."""
        load, me, now = self.port.state.load, self.port.replica_id, time.monotonic()
        ring = load.routed_since(time.time() - RELEASE_TURN_RING)
        mine: set[str] = set()
        wait: float | None = None
        free: set[WorkerKey] = set()
        for c in cands:
            if c.active_prefill_tokens > threshold * c.max_num_batched_tokens:
                continue
            free.add(c.worker)
            since = self._free_since.setdefault(c.worker, now)
            due = since + turn_distance(ring, load.freed_by(c.worker), me) * RELEASE_TURN_GRACE
            if due <= now:
                mine.add(c.worker[0])
            else:
                wait = due - now if wait is None else min(wait, due - now)
        for worker in [w for w in self._free_since if w not in free]:
            del self._free_since[worker]  # busy again: its next opening is a new one
        return frozenset(mine), wait

    def _prepare_into(self, req: RouteRequest, not_mine: frozenset[str]) -> Routed:
        """``_prepare`` among the workers whose opening is this replica's; a request that must
        go to one engine (pinned, or its session's) is routed as usual."""
        if not_mine and req.pinned is None and req.session is None:
            with contextlib.suppress(RoutingError):
                return self._prepare(replace(req, exclude=req.exclude | not_mine))
        return self._prepare(req)

    def pending_decisions(self) -> int:
        """Decisions in the optimistic overlay: routed here, not yet applied from the stream."""
        return len(self.overlay)

    def queue_depth(self) -> int:
        return len(self._queue)
