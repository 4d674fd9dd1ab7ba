"""Candidate building: the replicated state and a prompt's block hashes → `Candidate`s.

One row per (worker, data-parallel rank) that serves the requested model (a base model, or a
LoRA adapter the worker registered), is not excluded by the caller and is not unhealthy. Each row
carries the rank's cache overlap, its active load from the state (prefill decayed to the state's
event time, output blocks weighted) plus this replica's optimistic overlay, and a health weight
(a suspicious worker costs double). Refused workers (a bad block size in their registration) are
never in ``state.workers``, so never candidates. For a model served disaggregated, only the
engines whose role takes the decision's phase are candidates, each seen as that decision sees it
(replicas/core/disagg.py). Pure.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from eventlog.hashing import prompt_hashes
from replicas.core import disagg
from replicas.core.candidate_columns import CandidateColumns
from replicas.core.index_common import MatchColumns
from replicas.core.load import MILLI, ActiveLoad
from replicas.core.load_columns import SlotRows
from replicas.core.overlay import Overlay
from replicas.core.routing_errors import NoWorkers, UnknownModel
from replicas.core.selection import Candidate
from replicas.core.state import RouterState

# Cost divisor per health status; a status missing here (unhealthy) is never a candidate.
HEALTH_WEIGHT = {"healthy": 1.0, "suspicious": 0.5}

_NO_OVERLAY = Overlay()

GROUPED_PREFIX_FROM = 16
"""Loaded rows from which a decision asks ``ActiveLoad.prefix_groups`` for every rank's active
prefix, which from then on makes every event keep the blocks' holders (~0.25 µs a block held
and freed); below it each loaded rank is searched on its own (~1.3 µs a rank at 512 blocks), as
long as the holders are not kept anyway."""


def served_models(state: RouterState) -> list[str]:
    """Every base model and LoRA adapter some registered worker serves, sorted."""
    return sorted({m for w in state.workers.values() for m in (w.model, *w.loras)})


def adapter_of(state: RouterState, model: str) -> str | None:
    """``model`` if it names a LoRA adapter some worker serves (its blocks hash salted),
    else None (a base model)."""
    workers = state.workers.values()
    if any(w.model == model for w in workers):
        return None
    return model if any(model in w.loras for w in workers) else None


def check_routable(state: RouterState, model: str) -> None:
    """Raise `NoWorkers` or `UnknownModel` when no registered worker could serve ``model``."""
    if not state.workers:
        refused = sorted(state.refused_workers)
        if refused:
            raise NoWorkers(f"no usable inference workers: {', '.join(refused)} refused ("
                            f"{state.refusal_reason(refused[0])})")
        raise NoWorkers("no inference workers are registered yet")
    if not any(w.model == model or model in w.loras for w in state.workers.values()):
        raise UnknownModel(model, served_models(state))


def is_disaggregated(state: RouterState, model: str) -> bool:
    """The model has prefill engines: its requests get a prefill and a decode decision."""
    return disagg.is_disaggregated([w.role for w in state.workers.values()
                                    if w.model == model or model in w.loras])


def request_hashes(state: RouterState, model: str, token_ids: Sequence[int],
                   block_size: int, cache_salt: str = "") -> list[int]:
    """The prompt's block sequence hashes, salted when ``model`` is a LoRA adapter and when
    the engine gets the prompt with a ``cache_salt``."""
    return prompt_hashes(token_ids, block_size, adapter=adapter_of(state, model),
                         cache_salt=cache_salt)


def build_candidates(state: RouterState, model: str, seq_hashes: Sequence[int], *,
                     exclude: frozenset[str] = frozenset(),
                     overlay: Overlay = _NO_OVERLAY, phase: disagg.Phase = disagg.AGGREGATED,
                     assume_kv_reuse: bool = True, track_active_blocks: bool = True,
                     track_prefill_tokens: bool = True) -> list[Candidate]:
    """``phase``: the decision these candidates are for (aggregated, or one of a disaggregated
    request's two). ``assume_kv_reuse``: engines reuse blocks they already hold — a decode
    engine the transferred blocks (disagg.py), any engine the blocks other in-flight requests on
    it hold; off, a request is charged all its blocks (and the state counts each such request's
    blocks as its own). ``track_active_blocks`` / ``track_prefill_tokens`` (Dynamo's switches)
    leave decode blocks / queued prefill tokens out of every candidate: they change what a
    decision sees, never the state."""
    out = _candidates(state, model, seq_hashes, exclude, overlay, phase, assume_kv_reuse)
    if phase == disagg.PREFILL:
        out = [disagg.prefill_candidate(c) for c in out]
    elif phase == disagg.DECODE:
        n = len(seq_hashes)
        out = [disagg.decode_candidate(c, n, assume_kv_reuse) for c in out]
    if not track_active_blocks or not track_prefill_tokens:
        for c in out:  # Candidate is mutable: building 64 new ones per decision costs more
            if not track_active_blocks:
                c.active_decode_blocks = c.new_request_blocks = 0
            if not track_prefill_tokens:
                c.active_prefill_tokens = 0
    return out


def _candidates(state: RouterState, model: str, seq_hashes: Sequence[int],
                exclude: frozenset[str], overlay: Overlay, phase: str,
                assume_kv_reuse: bool) -> list[Candidate]:
    # Aggregated requests of a model served disaggregated go to decode engines only.
    split = phase != disagg.AGGREGATED or is_disaggregated(state, model)
    own_blocks = not assume_kv_reuse and phase == disagg.AGGREGATED
    scores = state.index.find_matches(seq_hashes)
    out: list[Candidate] = []
    n = len(seq_hashes)
    load = state.load
    now = state.now
    for w in state.workers.values():
        if (w.model != model and model not in w.loras) or w.worker_id in exclude:
            continue
        if split and not disagg.serves(w.role, phase):
            continue
        weight = HEALTH_WEIGHT.get(state.health.get(w.worker_id, "healthy"), 0.0)
        if weight <= 0.0:
            continue
        for rank in range(w.dp_size):
            key = (w.worker_id, rank)
            # Blocks other active requests on this rank already hold are charged once (the
            # engine shares them), unless no reuse is assumed.
            active_prefix = load.active_prefix_len(key, seq_hashes) if n and not own_blocks else 0
            out.append(Candidate(
                worker=key,
                overlap_blocks=scores.scores.get(key, 0),
                tree_size=scores.tree_sizes.get(key, 0),
                active_prefill_tokens=load.active_prefill_tokens(key, now)
                + overlay.prefill_tokens(key),
                active_decode_blocks=load.active_decode_blocks(key) + overlay.decode_blocks(key),
                new_request_blocks=n - active_prefix,
                kv_total_blocks=w.kv_total_blocks,
                max_num_batched_tokens=w.max_num_batched_tokens,
                weight=weight,
            ))
    return out


@dataclass(frozen=True, slots=True)
class CandidateRows:
    """The rows a decision weighs, before any load: which (worker, dp rank) rows (the same, in
    the same order, as ``build_candidates``), each one's KV capacity, batch size and health
    weight (read-only arrays). They change only with the roster: ``roster_version`` is the
    state's when they were built, so a caller may keep them until it moves."""

    workers: list[tuple[str, int]]
    kv_total_blocks: np.ndarray
    max_num_batched_tokens: np.ndarray
    weight: np.ndarray
    roster_version: int
    row_of: dict[tuple[str, int], int]  # worker key -> its row
    slot_rows: SlotRows  # the load columns' slots -> these rows (load_columns.py)
    # [the index's MatchColumns.workers list, these rows' places in it]: kept while the index
    # answers with the same list (its rows unchanged), instead of a dict lookup per row per
    # decision (~16 us at 256 rows)
    match_memo: list[object] = field(default_factory=list)

    def match_rows(self, match: MatchColumns) -> np.ndarray:
        """``match.rows_of(self.workers)``, kept while ``match.workers`` is the same list."""
        memo = self.match_memo
        if memo and memo[0] is match.workers:
            where: np.ndarray = memo[1]  # type: ignore[assignment]
            return where
        where = match.rows_of(self.workers)
        where.flags.writeable = False  # shared by the decisions until the index's rows move
        memo[:] = [match.workers, where]
        return where


def candidate_rows(state: RouterState, model: str, exclude: frozenset[str] = frozenset(),
                   phase: disagg.Phase = disagg.AGGREGATED) -> CandidateRows:
    """The rows ``build_candidates`` would build for ``model``, ``exclude`` and ``phase``."""
    split = phase != disagg.AGGREGATED or is_disaggregated(state, model)
    health = state.health
    rows: list[tuple[str, int]] = []
    kv_total: list[int] = []
    batched: list[int] = []
    weights: list[float] = []
    for w in state.workers.values():
        if (w.model != model and model not in w.loras) or w.worker_id in exclude:
            continue
        if split and not disagg.serves(w.role, phase):
            continue
        weight = HEALTH_WEIGHT.get(health.get(w.worker_id, "healthy"), 0.0)
        if weight <= 0.0:
            continue
        ranks = w.dp_size
        rows.extend([(w.worker_id, rank) for rank in range(ranks)])
        kv_total.extend([w.kv_total_blocks] * ranks)
        batched.extend([w.max_num_batched_tokens] * ranks)
        weights.extend([weight] * ranks)
    columns = (np.array(kv_total, dtype=np.int64), np.array(batched, dtype=np.int64),
               np.array(weights, dtype=np.float64))
    for column in columns:
        column.flags.writeable = False  # shared by every decision until the roster moves
    row_of = {key: i for i, key in enumerate(rows)}
    return CandidateRows(rows, *columns, state.roster_version, row_of, SlotRows(row_of))


class CandidateRowCache:
    """``candidate_rows`` per (model, exclusion, phase), kept while the state object and its
    ``roster_version`` stay the same (a restored state is another object: nothing carries over).
    At most ``limit`` entries: exclusion sets vary by request, so past it the cache starts over."""

    def __init__(self, limit: int = 64) -> None:
        self._limit = limit
        self._state: RouterState | None = None
        self._version = -1
        self._rows: dict[tuple[str, frozenset[str], str], CandidateRows] = {}

    def get(self, state: RouterState, model: str, exclude: frozenset[str] = frozenset(),
            phase: disagg.Phase = disagg.AGGREGATED) -> CandidateRows:
        if state is not self._state or state.roster_version != self._version:
            self._rows.clear()
            self._state, self._version = state, state.roster_version
        key = (model, exclude, str(phase))
        rows = self._rows.get(key)
        if rows is None:
            if len(self._rows) >= self._limit:
                self._rows.clear()
            rows = self._rows[key] = candidate_rows(state, model, exclude, phase)
        return rows


def build_candidate_columns(state: RouterState, model: str, seq_hashes: Sequence[int], *,
                            exclude: frozenset[str] = frozenset(),
                            overlay: Overlay = _NO_OVERLAY,
                            phase: disagg.Phase = disagg.AGGREGATED,
                            assume_kv_reuse: bool = True, track_active_blocks: bool = True,
                            track_prefill_tokens: bool = True,
                            rows: CandidateRows | None = None) -> CandidateColumns:
    """``build_candidates`` as columns: the same rows in the same order with the same values
    (``CandidateColumns.from_candidates(build_candidates(...))``, property-tested), without an
    object per row. The load comes from the state's load columns (load_columns.py): the loaded
    ranks' figures in a few array operations, every rank's active prefix from one grouped
    search; only ranks whose prefill decays and ranks with decisions pending in the overlay are
    read one by one. ``rows``: this model's, exclusion's and phase's ``candidate_rows``, kept by
    the caller while the state's ``roster_version`` stays the same (None: built here)."""
    if rows is None or rows.roster_version != state.roster_version:
        rows = candidate_rows(state, model, exclude, phase)
    keys = rows.workers
    own_blocks = not assume_kv_reuse and phase == disagg.AGGREGATED
    count = len(keys)
    n = len(seq_hashes)
    match = state.index.match_columns(seq_hashes)
    overlap, tree = match.for_keys(keys, rows.match_rows(match))
    prefill = np.zeros(count, dtype=np.float64)
    decode = np.zeros(count, dtype=np.float64)
    new = np.full(count, n, dtype=np.int64)
    # The overlay's part is added after the state's, as build_candidates sums them.
    row_of = rows.row_of
    load = state.load
    columns = load.columns
    slots, at = rows.slot_rows.sync(columns)
    if len(slots):
        prefill[at] = columns.prefill[slots]
        # as active_decode_blocks: distinct blocks + thousandths / 1000 (+ 0.0 without output)
        decode[at] = columns.blocks[slots] + columns.milli[slots] / MILLI
        now = state.now
        if now is not None:
            for key in load.decaying_workers():
                i = row_of.get(key)
                if i is not None:
                    prefill[i] = load.active_prefill_tokens(key, now)
        if n and not own_blocks:
            _charge_active_prefixes(new, load, rows.slot_rows, slots, at, seq_hashes)
    for key in overlay.pending_workers():
        i = row_of.get(key)
        if i is not None:
            prefill[i] += overlay.prefill_tokens(key)
            decode[i] += overlay.decode_blocks(key)
    if phase == disagg.PREFILL:
        decode[:] = 0
        new[:] = 0
    elif phase == disagg.DECODE and not assume_kv_reuse:
        overlap[:] = 0
        tree[:] = 0
        new[:] = n
    if not track_active_blocks:
        decode[:] = 0
        new[:] = 0
    if not track_prefill_tokens:
        prefill[:] = 0
    return CandidateColumns(keys, overlap, tree, prefill, decode, new, rows.kv_total_blocks,
                            rows.max_num_batched_tokens, rows.weight)


def _charge_active_prefixes(new: np.ndarray, load: ActiveLoad, slot_rows: SlotRows,
                            slots: np.ndarray, at: np.ndarray, seq_hashes: Sequence[int]
                            ) -> None:
    """Take each loaded row's active prefix (blocks its running requests hold already) off its
    new blocks: ``slots`` are the loaded slots with a row, ``at`` their rows."""
    n = len(seq_hashes)
    if load.columns.holders is None and len(slots) < GROUPED_PREFIX_FROM:
        keys = load.columns.keys
        for slot, i in zip(slots.tolist(), at.tolist(), strict=True):
            key = keys[slot]
            assert key is not None  # a slot with a row is a loaded rank's
            new[i] = n - load.active_prefix_len(key, seq_hashes)
        return
    groups = load.prefix_groups(seq_hashes)
    if not groups:
        return
    # Each group's mask as a row of bits by slot, in one buffer: a slot's active prefix is the
    # one length whose row has its bit (the groups are disjoint), 0 where none has.
    width = (len(load.columns.keys) + 7) // 8
    packed = b"".join([mask.to_bytes(width, "little") for mask, _ in groups])
    bits = np.unpackbits(np.frombuffer(packed, dtype=np.uint8), bitorder="little")
    held = np.array([length for _, length in groups], dtype=np.int64) @ bits.reshape(
        len(groups), -1)
    new[at] = n - held[slots]
