"""The router state machine (design.md §5): pure, deterministic, exactly-once.

``RouterState.apply(stream, seq, events)`` is the only way state changes — live events, replay and
snapshot restore all go through it. One JetStream message is one batch, so the unit of
exactly-once is the message: a message at or below its stream's position is a duplicate and is
ignored whole.

Determinism across replicas matters more than anything here: two replicas apply the three streams
interleaved differently, yet must reach the same state at equal positions. So every cross-stream
effect is avoided or made order-independent:
- in-flight load is driven by the router stream alone (a retired worker's requests are freed by
  their own ``RequestFinished``, by ``ReplicaLost`` or by expiry, never by the KV stream);
- expiry uses event time ``now`` (the newest ``ts`` applied, a max, hence order-independent) and
  runs after every message, so the active set is a function of the applied set.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import xxhash

from eventlog import events as ev
from eventlog.names import CONTROL, KV, ROUTER, STREAM_KINDS
from replicas.core import disagg, index_reference, state_codec, state_run
from replicas.core import index as compact_index
from replicas.core.ended import EndedRequests
from replicas.core.load import ActiveLoad, OutputTracking
from replicas.core.prefill_model import PrefillLoadModel
from replicas.core.selection import BusyThresholds
from replicas.core.sessions import SessionTable
from replicas.core.stored_responses import StoredResponses
from replicas.core.tenants import TenantBook
from replicas.core.worker_info import WorkerInfo

_MASK = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class StateConfig:
    block_size: int = 16
    approximate: bool = False  # --no-router-kv-events: index fed by routing decisions
    ttl_secs: float = 120.0
    max_tree_size: int = 2**20
    prune_target_ratio: float = 0.8
    request_max_age: float = 600.0  # in-flight requests older than this (event time) are dropped
    # "reference": dicts of ints, plain Python; "compact": numpy tables, ~4x less memory per
    # held block and, with its compiled kernel, faster apply and decisions as fast
    # (replicas/core/README.md).
    # Every replica of a deployment uses the same form: a reference replica cannot read the
    # compact form's snapshots (v3), a compact one reads both.
    index_form: str = "reference"


PrefixIndex = index_reference.PrefixIndex | compact_index.PrefixIndex
INDEX_FORMS: dict[str, type[index_reference.PrefixIndex] | type[compact_index.PrefixIndex]] = {
    "reference": index_reference.PrefixIndex, "compact": compact_index.PrefixIndex}


def _index_class(c: StateConfig) -> type[index_reference.PrefixIndex] | \
        type[compact_index.PrefixIndex]:
    try:
        return INDEX_FORMS[c.index_form]
    except KeyError:
        raise ValueError(f"unknown index form {c.index_form!r}; expected one of "
                         f"{sorted(INDEX_FORMS)}") from None


@dataclass(slots=True)
class ApplyStats:
    """Per (stream, event_type, status) counts; the adapter turns them into metrics."""

    counts: dict[tuple[str, str, str], int] = field(default_factory=dict)

    def bump(self, stream: str, event_type: str, status: str, n: int = 1) -> None:
        key = (stream, event_type, status)
        self.counts[key] = self.counts.get(key, 0) + n


def _h(*parts: object) -> int:
    return xxhash.xxh3_64_intdigest(repr(parts).encode(), seed=7)


class RouterState:
    def __init__(self, config: StateConfig | None = None) -> None:
        self.config = config or StateConfig()
        c = self.config
        self.index = _index_class(c)(approximate=c.approximate, ttl_secs=c.ttl_secs,
                                 max_tree_size=c.max_tree_size,
                                 prune_target_ratio=c.prune_target_ratio)
        self.load = ActiveLoad()
        self.sessions = SessionTable()  # sticky session pins (router stream)
        # Responses API: response id -> the engine that stored it (router stream)
        self.responses = StoredResponses()
        # Tenants' limits (control stream) and usage (router stream): replicas/core/tenants.py
        self.tenants = TenantBook()
        self.positions: dict[str, int] = {k: 0 for k in STREAM_KINDS}
        self.epoch = 0
        self.now = 0.0
        self.workers: dict[str, WorkerInfo] = {}
        # Retired for cause (not shut down gracefully) and not back yet: lost capacity.
        self.lost_workers: dict[str, WorkerInfo] = {}
        # Registered with a block size other than ours: its blocks would hash to different
        # sequence hashes (silently never matching, or matching wrongly), so it is never indexed
        # nor routed to. A function of the event and the config alone: the same on every replica.
        self.refused_workers: dict[str, WorkerInfo] = {}
        self.thresholds: dict[str, BusyThresholds] = {}
        self.snapshot_threshold: int | None = None
        self.health: dict[str, str] = {}
        # Bumped whenever workers or their health change (registered, retired, health changed):
        # whoever keeps a view of the roster (the candidate rows) knows when to rebuild it.
        self.roster_version = 0
        self.last_event_id: dict[str, int] = {}
        self.out_of_sync: set[str] = set()
        self.last_snapshot: ev.SnapshotTaken | None = None
        # Highest position per stream any SnapshotTaken recorded: the leader purges only up to a
        # snapshot's positions, so nothing at or above this floor is ever purged (see reset).
        self.snapshot_floor: dict[str, int] = {}
        self.stats = ApplyStats()
        # (routed ts, request_id) of active requests, for expiry in event time.
        self._expiry: list[tuple[float, str]] = []
        # Ended requests, kept as long as the request could still be live, so a RequestRouted
        # delivered again (a retry that escaped the stream's dedup window) does not bring back
        # phantom load. Past request_max_age it would expire at once anyway.
        self._ended = EndedRequests()
        self._routed_ts: dict[str, float] = {}

    # --- applying --------------------------------------------------------------------------

    def apply(self, stream: str, seq: int, events: Sequence[ev.Event]) -> bool:
        """Apply one stream message. Returns False (and changes nothing) for a duplicate."""
        if stream not in self.positions:
            raise ValueError(f"unknown stream kind {stream!r}")
        if seq <= self.positions[stream]:
            self.stats.bump(stream, "message", "duplicate")
            return False
        self.positions[stream] = seq
        if not events:
            self.stats.bump(stream, "message", "malformed")
        for event in events:
            self._apply_event(stream, event)
        self._expire()
        return True

    def apply_many(self, stream: str, messages: Sequence[tuple[int, Sequence[ev.Event]]]
                   ) -> None:
        """``apply`` each (seq, events) message in order, to the same state; KV messages'
        stores and removals as runs (``state_run.py``: a replica catching up)."""
        state_run.apply_many(self, stream, messages)

    def _apply_event(self, stream: str, event: ev.Event) -> None:
        handler = _HANDLERS.get(type(event))
        if handler is None:
            status = "unexpected"
        elif _STREAM_OF[type(event)] != stream:
            # Only each stream's own total order makes replicas agree: a RequestRouted on the
            # KV stream would be applied before or after the router stream's RequestFinished
            # depending on how a replica interleaves the streams.
            status = "wrong_stream"
        else:
            if event.ts > self.now:
                self.now = event.ts
            status = handler(self, event)
        self.stats.bump(stream, type(event).__name__, status)

    def _expire(self) -> None:
        bound = self.now - self.config.request_max_age
        heap = self._expiry
        while heap and heap[0][0] < bound:
            _, request_id = heapq.heappop(heap)
            if self.load.finish(request_id):
                self._end((request_id,))
                self.stats.bump(ROUTER, "RequestExpired", "ok")
        self._ended.expire(bound)
        if self.config.approximate:
            self.index.expire(self.now)
        if len(self.sessions):
            for _ in self.sessions.expire(self.now):
                self.stats.bump(ROUTER, "SessionExpired", "ok")
        if len(self.responses):
            for _ in self.responses.expire(self.now):
                self.stats.bump(ROUTER, "ResponseExpired", "ok")
        if self.tenants:
            self.tenants.expire(self.now)

    # KV stream

    def _worker_registered(self, e: ev.WorkerRegistered) -> str:
        self.roster_version += 1
        restarted = e.worker_id in self.workers
        self.lost_workers.pop(e.worker_id, None)
        info = WorkerInfo(e.worker_id, e.url, e.model, e.block_size, e.kv_total_blocks,
                          e.max_num_batched_tokens, e.dp_size, e.ts, list(e.loras),
                          str(e.role),  # the digest reprs it: a plain string either way
                          str(e.engine_kind), e.bootstrap_port)
        if e.block_size != self.config.block_size:
            self.workers.pop(e.worker_id, None)
            self.health.pop(e.worker_id, None)
            self.refused_workers[e.worker_id] = info
            self.index.remove_worker(e.worker_id)
            self.last_event_id.pop(e.worker_id, None)
            self.out_of_sync.discard(e.worker_id)
            return "refused_block_size"
        self.refused_workers.pop(e.worker_id, None)
        self.workers[e.worker_id] = info
        # A (re)registered engine starts with an empty cache and a fresh event_id sequence.
        self.index.remove_worker(e.worker_id)
        self.last_event_id.pop(e.worker_id, None)
        self.out_of_sync.discard(e.worker_id)
        return "restarted" if restarted else "ok"

    def _worker_retired(self, e: ev.WorkerRetired) -> str:
        self.roster_version += 1
        info = self.workers.pop(e.worker_id, None)
        known = info is not None or self.refused_workers.pop(e.worker_id, None) is not None
        if info is not None and e.reason != "shutdown":
            self.lost_workers[e.worker_id] = info
        self.index.remove_worker(e.worker_id)
        self.last_event_id.pop(e.worker_id, None)
        self.out_of_sync.discard(e.worker_id)
        # `health` is left alone: it is a function of the control stream only. Clearing it here
        # (a KV event) made it depend on how a replica interleaved the two streams, and a
        # replica replaying them after a restart ended with another health map than its peers.
        return "ok" if known else "unknown_worker"

    def _skip_kv_event(self, worker_id: str, event_id: int) -> str | None:
        """None if the worker's KV event should apply; else the status to count it under (a
        refused worker, a repeated ``event_id``). ``apply_many`` checks its runs with it too."""
        if worker_id in self.refused_workers:
            return "refused_worker"
        last = self.last_event_id.get(worker_id)
        if last is not None and event_id <= last:
            return "duplicate_event_id"
        self.last_event_id[worker_id] = event_id
        if last is not None and event_id > last + 1:
            # Events were lost between the engine and the stream: the worker must re-announce.
            self.out_of_sync.add(worker_id)
            self.stats.bump(KV, "EventIdGap", "gap")
        return None

    def refusal_reason(self, worker_id: str) -> str | None:
        """Why a registered worker is not used, or None when it is not refused."""
        info = self.refused_workers.get(worker_id)
        if info is None:
            return None
        return (f"block size {info.block_size} differs from the router's "
                f"--kv-cache-block-size {self.config.block_size}")

    def _blocks_stored(self, e: ev.BlocksStored) -> str:
        skip = self._skip_kv_event(e.worker_id, e.event_id)
        if skip:
            return skip
        if e.medium is not None:
            # An offloaded tier (CPU, disk): carried on the stream, not indexed, so only device
            # blocks count for overlap (docs/decisions/0017-only-device-tier-blocks-count.md).
            return "other_tier"
        return self.index.store((e.worker_id, e.dp_rank), e.parent_hash, e.blocks)

    def _blocks_removed(self, e: ev.BlocksRemoved) -> str:
        skip = self._skip_kv_event(e.worker_id, e.event_id)
        if skip:
            return skip
        if e.medium is not None:
            return "other_tier"  # leaving an offloaded tier does not touch the device blocks
        unknown = self.index.remove((e.worker_id, e.dp_rank), e.block_hashes)
        return "block_not_found" if unknown else "ok"

    def _all_blocks_cleared(self, e: ev.AllBlocksCleared) -> str:
        skip = self._skip_kv_event(e.worker_id, e.event_id)
        if skip:
            return skip
        self.index.clear((e.worker_id, e.dp_rank))
        # A full re-announce starts with a clear: the worker is back in sync.
        self.out_of_sync.discard(e.worker_id)
        return "ok"

    # Router stream

    def _end(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self.tenants.ended_one(request_id)
            self._ended.add(request_id, self._routed_ts.pop(request_id, self.now))

    def _request_routed(self, e: ev.RequestRouted) -> str:
        if e.request_id in self._ended:
            return "duplicate_request"
        block_size = self._block_size(e.worker_id)
        prefill = max(e.isl_tokens - e.overlap_blocks * block_size, 0)
        blocks: Sequence[int] = e.block_seq_hashes
        output = OutputTracking(e.isl_tokens, e.block_size or block_size, e.osl_hint) \
            if e.track_output_blocks else None
        if e.phase == disagg.PREFILL:
            blocks = ()  # active-block tracking is off for prefill engines
            output = None  # and they generate no output to speak of
        else:
            if e.phase == disagg.DECODE:
                prefill = 0  # the prompt's KV arrives by transfer; the engine computes none
            if not e.kv_reuse:
                # --no-router-assume-kv-reuse: this request's blocks are its own (decode or
                # aggregated), shared with no other request on the engine.
                blocks = disagg.unique_block_hashes(e.request_id, len(blocks))
        added = self.load.add(e.request_id, e.replica_id, (e.worker_id, e.dp_rank), prefill,
                              blocks, e.ts, output=output,
                              modeled=e.prefill_load_model == PrefillLoadModel.LINEAR)
        if not added:
            return "duplicate_request"
        heapq.heappush(self._expiry, (e.ts, e.request_id))
        if e.tenant:
            self.tenants.routed(e)
        self._routed_ts[e.request_id] = e.ts
        if self.config.approximate:
            self.index.store_routed((e.worker_id, e.dp_rank), e.block_seq_hashes, e.ts)
        return "ok"

    def _prefill_completed(self, e: ev.PrefillCompleted) -> str:
        return "ok" if self.load.prefill_completed(e.request_id, e.ts) else "unknown_request"

    def _output_progress(self, e: ev.OutputProgress) -> str:
        if self.load.output_progress(e.request_id, e.output_tokens):
            return "ok"
        return "unknown_request" if e.request_id not in self.load else "ignored"

    def _request_finished(self, e: ev.RequestFinished) -> str:
        if e.prefill_ts is not None:
            # A PrefillCompleted folded into the finish (group commit): the same state as the
            # two events, including what the prefill load model learns from the completion.
            self.load.prefill_completed(e.request_id, e.prefill_ts)
        self.tenants.finished(e.request_id, e.outcome, e.output_tokens)
        if not self.load.finish(e.request_id):
            # Remember it anyway: a decision whose append timed out is finished by its replica
            # ("not_routed") in case it landed; should it land after all, it must not count.
            self._end((e.request_id,))
            return "unknown_request"
        self._end((e.request_id,))
        return "ok"

    def _replica_lost(self, e: ev.ReplicaLost) -> str:
        freed = self.load.replica_lost(e.replica_id)
        self._end(freed)
        return "ok" if freed else "nothing_owned"

    def _session_pinned(self, e: ev.SessionPinned) -> str:
        return self.sessions.pin(e.session_id, (e.worker_id, e.dp_rank), e.model, e.ttl, e.ts)

    def _session_released(self, e: ev.SessionReleased) -> str:
        return "ok" if self.sessions.release(e.session_id) else "unknown_session"

    def _response_stored(self, e: ev.ResponseStored) -> str:
        return self.responses.store(e)

    # Control stream

    def _busy_thresholds_set(self, e: ev.BusyThresholdsSet) -> str:
        self.thresholds[e.model] = BusyThresholds(e.active_decode_blocks_threshold,
                                                  e.active_prefill_tokens_threshold,
                                                  e.active_prefill_tokens_threshold_frac)
        return "ok"

    def _snapshot_threshold_set(self, e: ev.SnapshotThresholdSet) -> str:
        self.snapshot_threshold = e.threshold
        return "ok"

    def _snapshot_taken(self, e: ev.SnapshotTaken) -> str:
        self.last_snapshot = e
        for kind, pos in e.positions.items():
            if kind in self.positions and pos > self.snapshot_floor.get(kind, 0):
                self.snapshot_floor[kind] = pos
        return "ok"

    def _state_reset(self, e: ev.StateReset) -> str:
        if e.epoch <= self.epoch:
            return "stale_epoch"
        if any(e.positions.get(k, self.snapshot_floor[k]) < self.snapshot_floor[k]
               for k in (KV, ROUTER) if k in self.snapshot_floor):
            # A real reset cuts at the streams' ends, which are past every snapshot taken
            # before it. A cut below a snapshot's positions may already be purged: rewinding to
            # it would leave every replica waiting forever for messages that are gone.
            return "stale_cut"
        c = self.config
        self.epoch = e.epoch
        for kind in (KV, ROUTER):
            if kind in e.positions:
                # Rewinds (or skips) the other streams to the cut: the runtime re-reads from here.
                self.positions[kind] = e.positions[kind]
        self.index = _index_class(c)(approximate=c.approximate, ttl_secs=c.ttl_secs,
                                 max_tree_size=c.max_tree_size,
                                 prune_target_ratio=c.prune_target_ratio)
        self.load = ActiveLoad()
        self.sessions.clear()
        self.responses.clear()
        self.tenants.clear_usage()  # limits are config, like thresholds: they stay
        self._expiry.clear()
        self._routed_ts.clear()
        self._ended.clear()
        self.last_event_id.clear()
        self.out_of_sync.clear()
        return "ok"

    def _tenant_limits_set(self, e: ev.TenantLimitsSet) -> str:
        return self.tenants.set_limits(e)

    def _tenant_deleted(self, e: ev.TenantDeleted) -> str:
        return self.tenants.delete(e)

    def _api_key_set(self, e: ev.ApiKeySet) -> str:
        return self.tenants.set_key(e)

    def _api_key_revoked(self, e: ev.ApiKeyRevoked) -> str:
        return self.tenants.revoke_key(e)

    def _worker_health_changed(self, e: ev.WorkerHealthChanged) -> str:
        self.roster_version += 1
        self.health[e.worker_id] = e.status
        return "ok"

    # --- queries ---------------------------------------------------------------------------

    def _block_size(self, worker_id: str) -> int:
        info = self.workers.get(worker_id)
        return info.block_size if info else self.config.block_size

    def thresholds_for(self, model: str) -> BusyThresholds | None:
        return self.thresholds.get(model) or self.thresholds.get("*")

    def digests(self) -> dict[str, int]:
        """Order-independent digests of the replicated state, and their sum as ``state``."""
        config = _h(
            self.epoch,
            sorted((m, t.active_decode_blocks_threshold, t.active_prefill_tokens_threshold,
                    t.active_prefill_tokens_threshold_frac) for m, t in self.thresholds.items()),
            self.snapshot_threshold,
            sorted(self.health.items()),
            sorted((w.worker_id, w.url, w.model, w.block_size, w.kv_total_blocks,
                    w.max_num_batched_tokens, w.dp_size, *((tuple(w.loras),) if w.loras else ()),
                    *((w.role,) if w.role != "both" else ()),
                    *((w.engine_kind,) if w.engine_kind != "jetrouter" else ()))
                   for w in self.workers.values()),
            sorted(self.lost_workers),
            sorted((w.worker_id, w.block_size) for w in self.refused_workers.values()),
        )
        parts = {"index": self.index.digest & _MASK, "load": self.load.digest & _MASK,
                 "config": config, "sessions": self.sessions.digest & _MASK,
                 # Zero while no response is stored: the sum then equals older replicas' digest.
                 "responses": self.responses.digest & _MASK,
                 "tenants": self.tenants.digest}  # likewise zero while no tenant is known
        parts["state"] = sum(parts.values()) & _MASK
        return parts

    # --- encode / decode (snapshots: state_codec.py) -------------------------------------

    @property
    def snapshot_format(self) -> int:
        """The oldest state format that carries this state (``state_codec.snapshot_format``)."""
        return state_codec.snapshot_format(self)

    def encode(self) -> bytes:
        return self.encoder(copy=False)()

    def encoder(self, *, copy: bool = True) -> Callable[[], bytes]:
        """Capture the state now and return a function that encodes that capture (it may run
        in a worker thread while this state keeps applying events: ``state_codec.encoder``)."""
        return state_codec.encoder(self, copy=copy)

    def capture(self) -> state_codec.Capture:
        """Capture the state for a snapshot, the prefix index in steps of a few ms while the
        caller keeps the KV stream from applying (``state_codec.capture``)."""
        return state_codec.capture(self)

    @classmethod
    def decode(cls, data: bytes, config: StateConfig | None = None) -> RouterState:
        """The state a snapshot holds; raises ``NewerFormat`` for a format this release does
        not read yet and ``ValueError`` for one it cannot read at all."""
        state = cls(config)
        state_codec.restore(state, data)
        return state


_HANDLERS = {
    ev.WorkerRegistered: RouterState._worker_registered,
    ev.WorkerRetired: RouterState._worker_retired,
    ev.BlocksStored: RouterState._blocks_stored,
    ev.BlocksRemoved: RouterState._blocks_removed,
    ev.AllBlocksCleared: RouterState._all_blocks_cleared,
    ev.RequestRouted: RouterState._request_routed,
    ev.PrefillCompleted: RouterState._prefill_completed,
    ev.OutputProgress: RouterState._output_progress,
    ev.RequestFinished: RouterState._request_finished,
    ev.ReplicaLost: RouterState._replica_lost,
    ev.SessionPinned: RouterState._session_pinned,
    ev.SessionReleased: RouterState._session_released,
    ev.ResponseStored: RouterState._response_stored,
    ev.BusyThresholdsSet: RouterState._busy_thresholds_set,
    ev.SnapshotThresholdSet: RouterState._snapshot_threshold_set,
    ev.SnapshotTaken: RouterState._snapshot_taken,
    ev.StateReset: RouterState._state_reset,
    ev.WorkerHealthChanged: RouterState._worker_health_changed,
    ev.TenantLimitsSet: RouterState._tenant_limits_set,
    ev.TenantDeleted: RouterState._tenant_deleted,
    ev.ApiKeySet: RouterState._api_key_set,
    ev.ApiKeyRevoked: RouterState._api_key_revoked,
}


_STREAM_OF = {cls: KV if cls in ev.KvEvent.__args__ else  # type: ignore[attr-defined]
              ROUTER if cls in ev.RouterEvent.__args__ else CONTROL  # type: ignore[attr-defined]
              for cls in _HANDLERS}


def stream_of(event: ev.Event) -> str:
    """Which stream kind an event belongs on."""
    if isinstance(event, ev.KvEvent):
        return KV
    if isinstance(event, ev.RouterEvent):
        return ROUTER
    return CONTROL


def apply_all(state: RouterState, messages: Iterable[tuple[str, int, Sequence[ev.Event]]]) -> None:
    for stream, seq, batch in messages:
        state.apply(stream, seq, batch)
