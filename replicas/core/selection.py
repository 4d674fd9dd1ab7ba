"""Worker selection: busy filtering, the KV cost model and the routing modes (design.md §6).

Pure: no clock, no I/O; randomness only from the ``random.Random`` passed to ``select``.

Cost of a candidate (Dynamo's router guide, design.md §6):

    prefill_blocks = (active_prefill_tokens + max(isl - overlap_blocks * block_size, 0))
                     / block_size
    decode_blocks  = active_decode_blocks + new_request_blocks
    cost           = w * prefill_blocks + decode_blocks   (divided by the health weight if < 1)

``prefill_queue_weight`` (default None: Dynamo's formula above) splits the prefill term: the
request's own uncached blocks keep weight ``w`` and the worker's queued prefill gets its own weight
``q``: ``cost = w * own_uncached_blocks + q * active_prefill_blocks + decode_blocks``. With
Dynamo's form a higher ``w`` also scales the queue, so under load it pushes requests *away* from a
cache-rich worker that is momentarily prefilling; the split makes ``w`` mean what its name says
(how much a cache hit is worth). Mooncake conversation trace, 8 workers (real cluster; the
virtual-time ``bench.routesim`` agrees): ``w=8, q=1`` keeps 96% of the ideal global cache's
hit rate at light load and 80% at saturation, against 81% and 58% for Dynamo's form at ``w=1``.

Busy filtering (design.md §6) applies in every mode, and a worker is excluded only when ALL its
dp ranks are busy: one loaded rank must not take a whole multi-rank engine out of rotation.

``select`` is on every request's path, so its loop is written for speed: one pass computes costs,
busy flags and the running minimum, and the per-candidate ``CostTerms`` for the decision ledger
are only built when someone reads ``Decision.costs`` (see ``CostTable``), after the request has
been dispatched.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol, overload

import numpy as np

from replicas.core.load import WorkerKey


class RoutingMode(StrEnum):
    """How a replica picks among eligible workers (``--router-mode``)."""

    KV = "kv"                       # the cost model: KV overlap against load
    ROUND_ROBIN = "round-robin"
    RANDOM = "random"
    LEAST_LOADED = "least-loaded"   # ignores overlap entirely


MODES: tuple[str, ...] = tuple(RoutingMode)
# Plain-name copies for select(), which runs per request: reading an enum member off its class
# costs ~0.3 us on Python 3.11 (a descriptor call), a module global ~20 ns.
_KV, _ROUND_ROBIN, _RANDOM = RoutingMode.KV, RoutingMode.ROUND_ROBIN, RoutingMode.RANDOM

# Health weights at or below zero would divide by zero; such a worker just looks very expensive.
_MIN_WEIGHT = 1e-6


@dataclass(frozen=True, slots=True)
class BusyThresholds:
    active_decode_blocks_threshold: float | None = None  # fraction of kv_total_blocks
    active_prefill_tokens_threshold: int | None = None  # literal tokens
    active_prefill_tokens_threshold_frac: float | None = None  # x max_num_batched_tokens

    @property
    def enabled(self) -> bool:
        return (
            self.active_decode_blocks_threshold is not None
            or self.active_prefill_tokens_threshold is not None
            or self.active_prefill_tokens_threshold_frac is not None
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class RoutingConfig:
    # No defaults for the weights: the router's are `jetrouter serve`'s options (api/config.py),
    # the one place they are declared; :meth:`dynamo` names Dynamo's formula explicitly.
    kv_overlap_score_weight: float
    # None: the queued prefill is scaled by the overlap weight too (Dynamo); else its own weight.
    prefill_queue_weight: float | None
    mode: str = RoutingMode.KV  # a RoutingMode
    temperature: float = 0.0
    block_size: int = 16
    thresholds: BusyThresholds = field(default_factory=BusyThresholds)
    # Which in-flight load the candidates are charged with (Dynamo's block-tracking switches).
    # They change what a decision sees, never the replicated load itself, so replicas configured
    # differently still hold the same state.
    track_active_blocks: bool = True   # off: decode blocks count 0 (prefill-only engines)
    track_prefill_tokens: bool = True  # off: queued prefill tokens count 0 (decode-only paths)
    # (--no-router-assume-kv-reuse is ReplicaConfig.assume_kv_reuse: it reaches the state too,
    # through each decision's RequestRouted.kv_reuse.)

    @classmethod
    def dynamo(cls, **overrides: Any) -> RoutingConfig:
        """Dynamo's cost formula: overlap weight 1, queued prefill scaled by it as well."""
        return cls(**{"kv_overlap_score_weight": 1.0, "prefill_queue_weight": None, **overrides})

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown router mode {self.mode!r}; expected one of {MODES}")
        if self.block_size <= 0:
            raise ValueError("block_size must be positive")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if self.prefill_queue_weight is not None and not self.prefill_queue_weight >= 0:
            raise ValueError("prefill_queue_weight must be >= 0")


@dataclass(slots=True)  # not frozen: building 64 frozen ones per decision costs ~70 µs
class Candidate:
    worker: WorkerKey
    overlap_blocks: int
    tree_size: int
    active_prefill_tokens: float  # decayed by the prefill load model: not always whole
    active_decode_blocks: float   # weighted output blocks make it fractional
    new_request_blocks: int
    kv_total_blocks: int
    max_num_batched_tokens: int
    weight: float = 1.0  # health weight (0.5 = suspicious: looks twice as expensive)


@dataclass(frozen=True, slots=True)
class CostTerms:
    """One candidate's cost terms, for the decision ledger.

    ``busy`` means the candidate was filtered out (all dp ranks of its worker are busy).
    """

    worker: WorkerKey
    overlap_blocks: int
    prefill_blocks: float
    decode_blocks: float
    cost: float
    busy: bool


def _terms(c: Candidate, isl_tokens: int, weight: float, block_size: int,
           queue_weight: float | None) -> tuple[float, int, float]:
    """(prefill_blocks, decode_blocks, cost) of one candidate: the one written-out formula.

    ``queue_weight`` None scales the queued prefill by ``weight`` too (Dynamo's formula)."""
    uncached = isl_tokens - c.overlap_blocks * block_size
    own = uncached if uncached > 0 else 0
    prefill = (c.active_prefill_tokens + own) / block_size
    decode = c.active_decode_blocks + c.new_request_blocks
    if queue_weight is None:
        cost = weight * prefill + decode
    else:
        cost = (weight * own + queue_weight * c.active_prefill_tokens) / block_size + decode
    if c.weight < 1.0:
        cost /= c.weight if c.weight > _MIN_WEIGHT else _MIN_WEIGHT
    return prefill, decode, cost


def cost_terms(c: Candidate, isl_tokens: int, weight: float, block_size: int,
               busy: bool = False, queue_weight: float | None = None) -> CostTerms:
    """The cost formula for one candidate (``Selector.select`` inlines exactly this arithmetic;
    a test checks they agree)."""
    prefill, decode, cost = _terms(c, isl_tokens, weight, block_size, queue_weight)
    return CostTerms(c.worker, c.overlap_blocks, prefill, decode, cost, busy)


CostRow = tuple[str, int, int, float, float, float, bool]
"""``eventlog.events.CandidateRow``: (worker_id, dp_rank, overlap_blocks, prefill_blocks,
decode_blocks, cost, busy)."""


class CandidateSource(Protocol):
    """Candidates held as columns (``candidate_columns.CandidateColumns``): one row is built
    only when asked for."""

    workers: list[WorkerKey]

    def row(self, i: int) -> Candidate: ...


def cheapest_first(cost: np.ndarray, limit: int) -> list[int]:
    """Indices of the ``limit`` smallest of ``cost``, smallest first; equal costs in index order,
    NaN after every number. Only the rows at or under the ``limit``-th cost are sorted."""
    n = len(cost)
    if limit < n and not np.isnan(cost).any():
        kth = np.partition(cost, limit - 1)[limit - 1]
        under = np.flatnonzero(cost <= kth)  # ties at the boundary included, in index order
        order = under[np.argsort(cost[under], kind="stable")]
    else:
        order = np.argsort(cost, kind="stable")  # stable: ties in index order, NaN last
    return order[:limit].tolist()


def _cost_order(cost: float, index: int) -> tuple[bool, float, int]:
    """Sort key of ``cheapest_first``'s order: cost, then index; NaN after every number."""
    nan = cost != cost
    return (nan, 0.0 if nan else cost, index)


class CostTable(Sequence[CostTerms]):
    """Immutable, lazily built ``tuple[CostTerms, ...]`` (one per candidate, in input order).

    Building 64 frozen dataclasses costs more than choosing the worker, so the terms are computed
    on first access from the (copied) candidates with the same formula. It compares equal to the
    plain tuple; ``as_tuple()`` gives one for encoders that want a real tuple.
    """

    __slots__ = ("_bs", "_busy", "_candidates", "_columns", "_cost", "_count", "_isl", "_make",
                 "_qw", "_terms", "_weight")

    def __init__(self, candidates: tuple[Candidate, ...], isl_tokens: int, weight: float,
                 block_size: int, busy: frozenset[str], queue_weight: float | None = None) -> None:
        self._candidates: tuple[Candidate, ...] | None = candidates
        self._make: Callable[[], tuple[Candidate, ...]] | None = None
        self._count = len(candidates)
        self._isl = isl_tokens
        self._weight = weight
        self._bs = block_size
        self._busy = busy
        self._qw = queue_weight
        self._terms: tuple[CostTerms, ...] | None = None
        self._columns: CandidateSource | None = None
        self._cost: np.ndarray | None = None

    @classmethod
    def lazy(cls, make: Callable[[], tuple[Candidate, ...]], count: int, isl_tokens: int,
             weight: float, block_size: int, busy: frozenset[str],
             queue_weight: float | None = None, *, columns: CandidateSource | None = None,
             cost: np.ndarray | None = None) -> CostTable:
        """A table whose ``count`` candidates ``make`` builds when first read (a decision over
        candidate columns builds no objects unless someone reads its costs). ``columns`` and
        ``cost`` (each row's cost, as the formula gives it): :meth:`rows` with a limit builds
        only the rows it keeps."""
        table = cls((), isl_tokens, weight, block_size, busy, queue_weight)
        table._candidates, table._make, table._count = None, make, count
        table._columns, table._cost = columns, cost
        return table

    def _rows(self) -> tuple[Candidate, ...]:
        if self._candidates is None:
            assert self._make is not None
            self._candidates, self._make = self._make(), None
        return self._candidates

    def rows(self, limit: int = 0, chosen: WorkerKey | None = None) -> list[CostRow]:
        """Plain `(worker_id, dp_rank, overlap, prefill_blocks, decode_blocks, cost, busy)`
        rows: what a `RequestRouted` carries for the decision ledger (cheap to encode).

        ``limit`` 0: every candidate, in candidate order. Else at most ``limit`` rows, cheapest
        first (equal costs in candidate order): the ``chosen`` candidate's row always (the
        routing mode or a session's pin may have chosen one that is not among the cheapest)
        and the cheapest others'. Over columns, only the kept rows are built."""
        if limit <= 0:
            return [self._row(c) for c in self._rows()]
        if self._columns is None or self._cost is None:
            # Objects (a small fleet, or a decision the columns handed to the objects): every
            # candidate is an object already, and sorting their rows is the cheap part.
            rows = [self._row(c) for c in self._rows()]
            costs = [r[5] for r in rows]
            # sorted() is stable: equal costs stay in candidate order. NaN compares false with
            # everything, so costs holding one (their sum is NaN) need the explicit key.
            total = sum(costs)
            key: Callable[[int], Any] = costs.__getitem__ if total == total else \
                (lambda i: _cost_order(costs[i], i))
            order = sorted(range(len(rows)), key=key)
            kept = order[:limit]
            at = next((i for i in order if rows[i][:2] == chosen), None)
            if at is not None and at not in kept:  # it replaces the dearest kept row
                kept = sorted([*kept[:-1], at], key=key)
            return [rows[i] for i in kept]
        workers, cost = self._columns.workers, self._cost
        kept = cheapest_first(cost, limit)
        if chosen is not None and chosen in workers and all(workers[i] != chosen for i in kept):
            # The chosen row takes the place of the dearest kept one, at its own cost's rank.
            keep = sorted([*kept[:-1], workers.index(chosen)])
            kept = [keep[j] for j in cheapest_first(cost[keep], len(keep))]
        row = self._columns.row
        return [self._row(row(i)) for i in kept]

    def _row(self, c: Candidate) -> CostRow:
        prefill, decode, cost = _terms(c, self._isl, self._weight, self._bs, self._qw)
        return (c.worker[0], c.worker[1], c.overlap_blocks, prefill, float(decode), cost,
                c.worker[0] in self._busy)

    def as_tuple(self) -> tuple[CostTerms, ...]:
        if self._terms is None:
            isl, w, bs, busy = self._isl, self._weight, self._bs, self._busy
            self._terms = tuple(
                cost_terms(c, isl, w, bs, c.worker[0] in busy, self._qw)
                for c in self._rows()
            )
        return self._terms

    @overload
    def __getitem__(self, i: int) -> CostTerms: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[CostTerms, ...]: ...
    def __getitem__(self, i: int | slice) -> CostTerms | tuple[CostTerms, ...]:
        return self.as_tuple()[i]

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[CostTerms]:
        return iter(self.as_tuple())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, CostTable):
            return self.as_tuple() == other.as_tuple()
        if isinstance(other, tuple):
            return self.as_tuple() == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.as_tuple())

    def __repr__(self) -> str:
        return f"CostTable({self.as_tuple()!r})"


_EMPTY_COSTS = CostTable((), 0, 1.0, 1, frozenset())


@dataclass(frozen=True, slots=True)
class Decision:
    worker: WorkerKey
    overlap_blocks: int
    costs: CostTable  # Sequence[CostTerms]; equal to the tuple of terms


@dataclass(frozen=True, slots=True)
class Overloaded:
    reason: str  # "no workers" | "all workers busy"
    costs: CostTable


def is_rank_busy(c: Candidate, t: BusyThresholds) -> bool:
    """One (worker, dp_rank) over any configured busy threshold (design.md §6)."""
    tb = t.active_decode_blocks_threshold
    if tb is not None and c.kv_total_blocks > 0 and c.active_decode_blocks / c.kv_total_blocks > tb:
        return True
    tt = t.active_prefill_tokens_threshold
    if tt is not None and c.active_prefill_tokens > tt:
        return True
    tf = t.active_prefill_tokens_threshold_frac
    return tf is not None and c.active_prefill_tokens > tf * c.max_num_batched_tokens


def busy_workers(candidates: Iterable[Candidate], thresholds: BusyThresholds) -> set[str]:
    """Worker ids whose every dp rank among ``candidates`` is busy."""
    if not thresholds.enabled:
        return set()
    seen: set[str] = set()
    not_busy: set[str] = set()
    for c in candidates:
        wid = c.worker[0]
        seen.add(wid)
        if wid not in not_busy and not is_rank_busy(c, thresholds):
            not_busy.add(wid)
    return seen - not_busy


def _softmax_pick(costs: list[float], temperature: float, rng: random.Random) -> int:
    """Index sampled with p ~ exp(-(cost / (max - min)) / T); uniform when all costs are equal."""
    lo, hi = min(costs), max(costs)
    if not hi > lo:  # equal costs (or a non-finite spread): nothing to prefer
        return rng.randrange(len(costs))
    span = hi - lo
    # Subtracting the largest logit keeps exp() in range; it does not change the distribution.
    logits = [-(c / span) / temperature for c in costs]
    top = max(logits)
    weights = [math.exp(x - top) for x in logits]
    r = rng.random() * math.fsum(weights)
    acc = 0.0
    for i, wgt in enumerate(weights):
        acc += wgt
        if r < acc:
            return i
    return len(weights) - 1


class Selector:
    """Picks a worker for one request. Holds the round-robin cursor; per-request options (the
    overlap weight, the model's busy thresholds) are passed to `select`, never set on ``config``."""

    def __init__(self, config: RoutingConfig) -> None:
        self.config = config
        self._rr_last: WorkerKey | None = None

    def select(
        self,
        candidates: Sequence[Candidate],
        isl_tokens: int,
        rng: random.Random,
        *,
        overlap_weight: float | None = None,
        thresholds: BusyThresholds | None = None,
    ) -> Decision | Overloaded:
        """``thresholds``: the busy thresholds of the request's model (None: ``config``'s)."""
        if not candidates:
            return Overloaded("no workers", _EMPTY_COSTS)
        cands = tuple(candidates)  # the lazy CostTable must not see later caller mutations
        cfg = self.config
        w = cfg.kv_overlap_score_weight if overlap_weight is None else overlap_weight
        bs = cfg.block_size
        qw = cfg.prefill_queue_weight
        mode = cfg.mode
        # kv mode at temperature 0 only needs the running minimum; the others need every eligible
        # candidate with its cost.
        collect = mode != "kv" or cfg.temperature > 0.0
        th = cfg.thresholds if thresholds is None else thresholds
        check = th.enabled
        tb = th.active_decode_blocks_threshold
        tt = th.active_prefill_tokens_threshold
        tf = th.active_prefill_tokens_threshold_frac

        not_busy: set[str] = set()  # workers with at least one rank under every threshold
        busy_ranks: list[tuple[int, float]] = []  # decided after the pass (worker may be free)
        eligible: list[tuple[int, float]] = []
        best_cost = math.inf
        best_tree = 0
        best: list[int] = []
        for i, c in enumerate(cands):
            p = c.active_prefill_tokens
            uncached = isl_tokens - c.overlap_blocks * bs
            if qw is None:
                cost = w * ((p + (uncached if uncached > 0 else 0)) / bs) + (
                    c.active_decode_blocks + c.new_request_blocks
                )
            else:
                cost = (w * (uncached if uncached > 0 else 0) + qw * p) / bs + (
                    c.active_decode_blocks + c.new_request_blocks
                )
            if c.weight < 1.0:
                cost /= c.weight if c.weight > _MIN_WEIGHT else _MIN_WEIGHT
            if check:
                kv_total = c.kv_total_blocks
                if (
                    (tb is not None and kv_total > 0 and c.active_decode_blocks / kv_total > tb)
                    or (tt is not None and p > tt)
                    or (tf is not None and p > tf * c.max_num_batched_tokens)
                ):
                    busy_ranks.append((i, cost))
                    continue
                not_busy.add(c.worker[0])
            if collect:
                eligible.append((i, cost))
            if cost < best_cost:
                best_cost, best_tree, best = cost, c.tree_size, [i]
            elif cost == best_cost:
                tree = c.tree_size
                if tree < best_tree:
                    best_tree, best = tree, [i]
                elif tree == best_tree:
                    best.append(i)

        excluded: frozenset[str] = frozenset()
        if busy_ranks:
            # A busy rank stays eligible while another rank of its worker is free (module doc).
            excluded = frozenset(cands[i].worker[0] for i, _ in busy_ranks) - not_busy
            for i, cost in busy_ranks:
                c = cands[i]
                if c.worker[0] in excluded:
                    continue
                if collect:
                    eligible.append((i, cost))
                if cost < best_cost or (cost == best_cost and c.tree_size < best_tree):
                    best_cost, best_tree, best = cost, c.tree_size, [i]
                elif cost == best_cost and c.tree_size == best_tree:
                    best.append(i)
        costs = CostTable(cands, isl_tokens, w, bs, excluded, qw)
        if not best:
            return Overloaded("all workers busy", costs)

        if mode == _KV:
            if collect and len(eligible) > 1:
                # Sample in worker order so the draw does not depend on candidate order.
                eligible.sort(key=lambda e: cands[e[0]].worker)
                k = _softmax_pick([cost for _, cost in eligible], cfg.temperature, rng)
                pick = eligible[k][0]
            else:
                pick = best[0] if len(best) == 1 else _random_of(best, cands, rng)
        elif mode == _ROUND_ROBIN:
            pick = self._round_robin([i for i, _ in eligible], cands)
        elif mode == _RANDOM:
            pick = _random_of([i for i, _ in eligible], cands, rng)
        else:  # least-loaded: ignores overlap entirely
            pick = self._least_loaded([i for i, _ in eligible], cands, rng)
        chosen = cands[pick]
        return Decision(chosen.worker, chosen.overlap_blocks, costs)

    def _round_robin(self, eligible: list[int], cands: Sequence[Candidate]) -> int:
        # The cursor is the last worker picked, not an index: the next pick is the first eligible
        # worker after it in sorted order, so the cycle survives workers joining, leaving or going
        # busy between calls.
        order = sorted(eligible, key=lambda i: cands[i].worker)
        last = self._rr_last
        pick = order[0]
        if last is not None:
            for i in order:
                if cands[i].worker > last:
                    pick = i
                    break
        self._rr_last = cands[pick].worker
        return pick

    def _least_loaded(
        self, eligible: list[int], cands: Sequence[Candidate], rng: random.Random
    ) -> int:
        bs = self.config.block_size
        best_load = math.inf
        best: list[int] = []
        for i in eligible:
            c = cands[i]
            load = c.active_decode_blocks + c.active_prefill_tokens / bs
            if c.weight < 1.0:
                load /= max(c.weight, _MIN_WEIGHT)
            if load < best_load:
                best_load, best = load, [i]
            elif load == best_load:
                best.append(i)
        return best[0] if len(best) == 1 else _random_of(best, cands, rng)


def _random_of(indices: list[int], cands: Sequence[Candidate], rng: random.Random) -> int:
    """Uniform pick; sorted by worker first so the draw does not depend on candidate order."""
    order = sorted(indices, key=lambda i: cands[i].worker)
    return order[rng.randrange(len(order))]


def random_of(indices: list[int], workers: Sequence[WorkerKey], rng: random.Random) -> int:
    """``_random_of`` for rows whose worker keys are ``workers`` (the same draw)."""
    order = sorted(indices, key=workers.__getitem__)
    return order[rng.randrange(len(order))]
