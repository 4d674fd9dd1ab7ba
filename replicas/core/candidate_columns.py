"""Candidates as columns: one numpy array per `Candidate` field, and the KV selection over them.

At fleet size a decision weighs hundreds of (worker, dp rank) rows. As `Candidate` objects, the
rows cost ~0.5 µs each to build and ~0.35 µs each to weigh in `Selector.select`'s Python loop
(~230 µs at 256 workers); as columns, the same cost formula, busy filtering and tie-breaks are a
fixed ~20 numpy calls. ``select_columns`` returns exactly what ``Selector.select`` returns for
``columns.to_candidates()``: the same worker, overlap and cost table, the same draws from ``rng``
(property tests, tests/unit/replicas/core/test_candidate_columns.py). The arithmetic is the same
IEEE operations in the same order, so the costs are equal bit for bit; where the object code's
behaviour hinges on a corner the arrays do not model (a non-finite cost, a mode other than ``kv``
at temperature 0), the columns are turned back into objects and ``Selector.select`` decides.

Pure: no clock, no I/O; randomness only from the ``random.Random`` passed in.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from replicas.core.load import WorkerKey
from replicas.core.selection import (
    _EMPTY_COSTS,
    _KV,
    _MIN_WEIGHT,
    BusyThresholds,
    Candidate,
    CostTable,
    Decision,
    Overloaded,
    Selector,
    random_of,
)

COLUMNS_FROM_ROWS = 32
"""Below this many rows the objects are as cheap: ~20 numpy calls cost a fixed ~20 µs, about
what ``Selector.select`` takes for 30 candidates (measured with ``bench core --router-state``
at 16, 32 and 64 workers on the project's 2-core machine)."""


@dataclass(slots=True)
class CandidateColumns:
    """Row ``i`` is the candidate ``workers[i]``; each array has one entry per row.

    Counts (overlap, tree size, new blocks, KV capacity, batch size) are ``int64``; loads and the
    health weight ``float64`` (an integral load gives the same cost as the int it stands for: the
    object code converts it to float at the same step)."""

    workers: list[WorkerKey]
    overlap_blocks: np.ndarray
    tree_size: np.ndarray
    active_prefill_tokens: np.ndarray
    active_decode_blocks: np.ndarray
    new_request_blocks: np.ndarray
    kv_total_blocks: np.ndarray
    max_num_batched_tokens: np.ndarray
    weight: np.ndarray

    def __len__(self) -> int:
        return len(self.workers)

    def row(self, i: int) -> Candidate:
        return Candidate(self.workers[i], int(self.overlap_blocks[i]), int(self.tree_size[i]),
                         float(self.active_prefill_tokens[i]),
                         float(self.active_decode_blocks[i]), int(self.new_request_blocks[i]),
                         int(self.kv_total_blocks[i]), int(self.max_num_batched_tokens[i]),
                         float(self.weight[i]))

    def take(self, rows: Sequence[int]) -> CandidateColumns:
        """The columns of ``rows`` only, in that order."""
        at = np.asarray(rows, dtype=np.int64)
        return CandidateColumns([self.workers[i] for i in rows], self.overlap_blocks[at],
                                self.tree_size[at], self.active_prefill_tokens[at],
                                self.active_decode_blocks[at], self.new_request_blocks[at],
                                self.kv_total_blocks[at], self.max_num_batched_tokens[at],
                                self.weight[at])

    def to_candidates(self) -> tuple[Candidate, ...]:
        return tuple(self.row(i) for i in range(len(self.workers)))

    @classmethod
    def from_candidates(cls, candidates: Sequence[Candidate]) -> CandidateColumns:
        def column(name: str, dtype: type) -> np.ndarray:
            return np.array([getattr(c, name) for c in candidates], dtype=dtype)

        return cls([c.worker for c in candidates],
                   column("overlap_blocks", np.int64), column("tree_size", np.int64),
                   column("active_prefill_tokens", np.float64),
                   column("active_decode_blocks", np.float64),
                   column("new_request_blocks", np.int64), column("kv_total_blocks", np.int64),
                   column("max_num_batched_tokens", np.int64), column("weight", np.float64))


def select_columns(selector: Selector, columns: CandidateColumns, isl_tokens: int,
                   rng: random.Random, *, overlap_weight: float | None = None,
                   thresholds: BusyThresholds | None = None) -> Decision | Overloaded:
    """``selector.select(columns.to_candidates(), ...)``, computed over the columns."""
    n = len(columns.workers)
    if not n:
        return Overloaded("no workers", _EMPTY_COSTS)
    cfg = selector.config
    if cfg.mode != _KV or cfg.temperature > 0.0:
        return _select_objects(selector, columns, isl_tokens, rng, overlap_weight, thresholds)
    w = cfg.kv_overlap_score_weight if overlap_weight is None else overlap_weight
    bs = cfg.block_size
    qw = cfg.prefill_queue_weight
    # float(): the object code's int weight times an int count is exact there, and equal to this
    # product of floats for any count below 2**53
    fw = float(w)
    p = columns.active_prefill_tokens
    own = isl_tokens - columns.overlap_blocks * bs
    np.maximum(own, 0, out=own)
    decode = columns.active_decode_blocks + columns.new_request_blocks
    if qw is None:
        cost = p + own
        cost /= bs
        cost *= fw
    else:
        cost = own * fw
        cost += float(qw) * p
        cost /= bs
    cost += decode
    weight = columns.weight
    light = weight < 1.0
    if light.any():
        cost[light] /= np.maximum(weight[light], _MIN_WEIGHT)
    if not np.isfinite(cost).all():  # the object loop's comparisons with inf/nan: let it decide
        return _select_objects(selector, columns, isl_tokens, rng, overlap_weight, thresholds)

    th = cfg.thresholds if thresholds is None else thresholds
    excluded: frozenset[str] = frozenset()
    eligible: np.ndarray | None = None
    if th.enabled:
        busy = _busy_rows(columns, th)
        if busy.any():
            # A busy rank stays eligible while another rank of its worker is free.
            free = {columns.workers[i][0] for i in np.flatnonzero(~busy).tolist()}
            busy_ids = {columns.workers[i][0] for i in np.flatnonzero(busy).tolist()}
            excluded = frozenset(busy_ids - free)
            if excluded:
                eligible = np.fromiter((k[0] not in excluded for k in columns.workers),
                                       dtype=bool, count=n)
    costs = CostTable.lazy(columns.to_candidates, n, isl_tokens, w, bs, excluded, qw,
                           columns=columns, cost=cost)
    if eligible is not None:
        if not eligible.any():
            return Overloaded("all workers busy", costs)
        cost = np.where(eligible, cost, np.inf)
    best_cost = cost.min()
    best = np.flatnonzero(cost == best_cost)
    if len(best) > 1:
        trees = columns.tree_size[best]
        best = best[trees == trees.min()]
    if len(best) == 1:
        pick = int(best[0])
    else:
        pick = random_of(best.tolist(), columns.workers, rng)
    return Decision(columns.workers[pick], int(columns.overlap_blocks[pick]), costs)


def _busy_rows(columns: CandidateColumns, th: BusyThresholds) -> np.ndarray:
    """Each row over any configured busy threshold (``selection.is_rank_busy``, per row)."""
    p = columns.active_prefill_tokens
    busy = np.zeros(len(columns.workers), dtype=bool)
    tb = th.active_decode_blocks_threshold
    if tb is not None:
        total = columns.kv_total_blocks
        with np.errstate(divide="ignore", invalid="ignore"):
            share = columns.active_decode_blocks / total
        busy |= (total > 0) & (share > tb)
    tt = th.active_prefill_tokens_threshold
    if tt is not None:
        busy |= p > tt
    tf = th.active_prefill_tokens_threshold_frac
    if tf is not None:
        busy |= p > tf * columns.max_num_batched_tokens
    return busy


def _select_objects(selector: Selector, columns: CandidateColumns, isl_tokens: int,
                    rng: random.Random, overlap_weight: float | None,
                    thresholds: BusyThresholds | None) -> Decision | Overloaded:
    return selector.select(columns.to_candidates(), isl_tokens, rng,
                           overlap_weight=overlap_weight, thresholds=thresholds)
