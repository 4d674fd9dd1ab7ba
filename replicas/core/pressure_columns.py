"""``shedding.model_pressure`` over the load columns, for fleets with hundreds of loaded ranks.

The shedding check runs on every request. ``model_pressure`` walks the model's engines and asks
each loaded rank for its decode blocks and prefill tokens: ~0.8 µs a loaded rank, ~0.2 ms at 256
loaded ranks — more than the routing decision itself. Here the engines' weights and capacities
are columns kept per model while the roster stays the same (``PressureRowCache``), and the
demand reads the load columns (load_columns.py), so a check is a fixed few numpy calls.

The answer is ``model_pressure``'s bit for bit (property-tested): every rank's figure is the same
IEEE operations on the same values, and the sums are taken one after the other in the same
order (``np.add.accumulate``, not a pairwise sum). Below ``COLUMNS_FROM`` loaded ranks
``model_pressure`` itself answers: its loop is cheaper there. Pure.
"""

from __future__ import annotations

import numpy as np

from replicas.core.health import ROUTING_WEIGHT, HealthStatus
from replicas.core.load import MILLI
from replicas.core.load_columns import SlotRows
from replicas.core.shedding import Pressure, model_pressure
from replicas.core.state import RouterState

COLUMNS_FROM = 24
"""Loaded ranks from which the columns answer (a fixed ~15 µs against ~0.8 µs a loaded rank)."""


class PressureRows:
    """One model's engines as ``model_pressure`` counts them: every dp rank of the roster's
    workers serving it (whatever their health), in roster order, then those of the workers lost
    for cause; their routing weights and KV capacities as columns."""

    __slots__ = ("kv_total", "roster_ranks", "roster_version", "row_of", "slot_rows", "state",
                 "weight_sum", "weights")

    def __init__(self, state: RouterState, model: str) -> None:
        keys: list[tuple[str, int]] = []
        weights: list[float] = []
        kv_total: list[int] = []
        health = state.health
        for w in state.workers.values():
            if w.model != model and model not in w.loras:
                continue
            weight = ROUTING_WEIGHT.get(health.get(w.worker_id, HealthStatus.HEALTHY), 0.0)
            for rank in range(w.dp_size):
                keys.append((w.worker_id, rank))
                weights.append(weight)
                kv_total.append(w.kv_total_blocks)
        unhealthy = ROUTING_WEIGHT.get(HealthStatus.UNHEALTHY, 0.0)
        for w in state.lost_workers.values():
            if (w.model == model or model in w.loras) and w.worker_id not in state.workers:
                weights.extend([unhealthy] * w.dp_size)
                kv_total.extend([w.kv_total_blocks] * w.dp_size)
        self.state = state
        self.roster_version = state.roster_version
        self.roster_ranks = len(keys)
        self.row_of = {key: i for i, key in enumerate(keys)}
        self.slot_rows = SlotRows(self.row_of)
        self.weights = np.array(weights, dtype=np.float64)
        self.kv_total = np.array(kv_total, dtype=np.int64)
        self.weight_sum = float(np.add.accumulate(self.weights)[-1]) if weights else 0.0

    def pressure(self, *, block_size: int, usable_fraction: float = 1.0) -> Pressure | None:
        """``model_pressure(state, model, block_size=..., usable_fraction=...)``."""
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        n = len(self.weights)
        if not n:
            return None
        capacity = float(np.add.accumulate(self.weights * self.kv_total * usable_fraction)[-1])
        return Pressure(capacity, self._demand(block_size), self.weight_sum / n)

    def _demand(self, block_size: int) -> float:
        state = self.state
        load = state.load
        columns = load.columns
        slots, at = self.slot_rows.sync(columns)
        if not len(slots):
            return 0.0
        decode = np.zeros(self.roster_ranks, dtype=np.float64)
        prefill = np.zeros(self.roster_ranks, dtype=np.float64)
        loaded = np.zeros(self.roster_ranks, dtype=bool)
        decode[at] = columns.blocks[slots] + columns.milli[slots] / MILLI
        prefill[at] = columns.prefill[slots]
        loaded[at] = True
        for key in load.decaying_workers():
            i = self.row_of.get(key)
            if i is not None:
                prefill[i] = load.active_prefill_tokens(key, state.now)
        # each loaded rank in roster order: decode blocks + ceil(prefill tokens / block size)
        per_rank = decode[loaded] + np.ceil(prefill[loaded] / block_size)
        return float(np.add.accumulate(per_rank)[-1])


class PressureRowCache:
    """``PressureRows`` per model, kept while the state object and its ``roster_version`` stay
    the same (as ``candidates.CandidateRowCache``); ``pressure`` is what a shedding check asks."""

    def __init__(self, limit: int = 64) -> None:
        self._limit = limit
        self._rows: dict[str, PressureRows] = {}

    def get(self, state: RouterState, model: str) -> PressureRows:
        rows = self._rows.get(model)
        if rows is None or rows.state is not state or rows.roster_version != state.roster_version:
            if len(self._rows) >= self._limit:
                self._rows.clear()
            rows = self._rows[model] = PressureRows(state, model)
        return rows

    def pressure(self, state: RouterState, model: str, *, block_size: int,
                 usable_fraction: float = 1.0) -> Pressure | None:
        """``model_pressure``'s answer, from the columns from ``COLUMNS_FROM`` loaded ranks."""
        if len(state.load.loaded_workers()) < COLUMNS_FROM:
            return model_pressure(state, model, block_size=block_size,
                                  usable_fraction=usable_fraction)
        return self.get(state, model).pressure(block_size=block_size,
                                               usable_fraction=usable_fraction)
