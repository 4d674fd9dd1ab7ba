"""Graceful degradation and priority shedding (the levels of Dynamo's fault-tolerance guide).
Pure.

The degradation level comes from the ratio of healthy capacity to current demand, with the guide's
cut points: ratio >= 1 → 0 (normal), >= 0.75 → 1, >= 0.5 → 2, >= 0.25 → 3, else 4.

A router has one lever the guide's levels share: admission. The engine-side measures (level 1's
smaller batches, level 3's relaxed latency SLOs) are not ours to apply, so the router maps the
levels to shedding the lowest tiers first:

    level 0, 1: nothing shed (level 1 is a warning: capacity is tight)
    level 2:    best_effort shed (the guide's "shed low-priority traffic")
    level 3:    best_effort and standard shed (the router's stand-in for "relax SLOs")
    level 4:    every new request refused, in-flight ones drain (the guide's emergency level)

Degradation answers *lost* capacity. While every worker is healthy, overload is what the busy
thresholds of design.md §6 handle (503 once all workers are busy), so the level is capped at 1 then;
only a fleet that lost weight (unhealthy or suspicious workers) sheds by tier.

Capacity and demand are in KV blocks: a unit (one worker dp rank) offers ``kv_total_blocks`` *
``usable_fraction`` * its routing weight (1 healthy, 0.5 suspicious, 0 unhealthy); demand is
every unit's active decode blocks plus its prompt tokens still to prefill, in blocks. Load on an
unhealthy worker still counts as demand: those requests drain or migrate onto the rest.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

from replicas.core.health import ROUTING_WEIGHT, HealthStatus
from replicas.core.state import RouterState


class PriorityTier(StrEnum):
    """A request's priority tier (``nvext.agent_hints.priority``), highest first."""

    PREMIUM = "premium"
    STANDARD = "standard"
    BEST_EFFORT = "best_effort"


TIERS: tuple[str, ...] = tuple(PriorityTier)  # highest priority first
MAX_LEVEL = 4
# Level at and above which each tier is shed.
SHED_FROM_LEVEL = {PriorityTier.BEST_EFFORT: 2, PriorityTier.STANDARD: 3, PriorityTier.PREMIUM: 4}
# Suggested Retry-After (seconds) per level: longer the deeper the degradation; 30 s at the
# emergency level is the guide's value (one canary interval, the soonest a recovery is seen).
RETRY_AFTER = {0: 1, 1: 1, 2: 5, 3: 15, 4: 30}
_RATIO_FLOORS = (1.0, 0.75, 0.5, 0.25)  # ratio >= _RATIO_FLOORS[i] → level i


@dataclass(frozen=True, slots=True)
class UnitLoad:
    """One engine (a worker's dp rank) as the replica's state sees it."""

    status: str                 # "healthy" | "suspicious" | "unhealthy"
    kv_total_blocks: int
    active_decode_blocks: float
    active_prefill_tokens: float


@dataclass(frozen=True, slots=True)
class Pressure:
    capacity: float          # usable KV blocks on healthy engines, weighted by health
    demand: float            # blocks the in-flight requests hold or are about to prefill
    healthy_fraction: float  # summed routing weight / number of engines (1.0 = nothing lost)

    @property
    def level(self) -> int:
        return degradation_level(self.capacity, self.demand, self.healthy_fraction)


def fleet_pressure(units: Iterable[UnitLoad], *, block_size: int,
                   usable_fraction: float = 1.0) -> Pressure:
    """Capacity, demand and healthy fraction of one model's engines."""
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    capacity = demand = weight_sum = 0.0
    n = 0
    for u in units:
        weight = ROUTING_WEIGHT.get(u.status, 0.0)
        n += 1
        weight_sum += weight
        capacity += weight * u.kv_total_blocks * usable_fraction
        demand += u.active_decode_blocks + math.ceil(u.active_prefill_tokens / block_size)
    return Pressure(capacity, demand, weight_sum / n if n else 0.0)


def model_units(state: RouterState, model: str) -> list[UnitLoad]:
    """Every engine (worker x dp rank) serving ``model``, with the load the state accounts."""
    out: list[UnitLoad] = []
    for w in state.workers.values():
        if w.model != model and model not in w.loras:  # a LoRA adapter runs on its base's engine
            continue
        status = state.health.get(w.worker_id, HealthStatus.HEALTHY)
        for rank in range(w.dp_size):
            key = (w.worker_id, rank)
            out.append(UnitLoad(status, w.kv_total_blocks, state.load.active_decode_blocks(key),
                                state.load.active_prefill_tokens(key, state.now)))
    # Engines retired for cause (not a graceful shutdown) are capacity the fleet has lost until
    # they register again: without them a dead engine would stop counting once retired.
    for w in state.lost_workers.values():
        if (w.model == model or model in w.loras) and w.worker_id not in state.workers:
            out.extend(UnitLoad(HealthStatus.UNHEALTHY, w.kv_total_blocks, 0, 0)
                       for _ in range(w.dp_size))
    return out


def model_pressure(state: RouterState, model: str, *, block_size: int,
                   usable_fraction: float = 1.0) -> Pressure | None:
    """``fleet_pressure(model_units(state, model), ...)`` without a ``UnitLoad`` per engine:
    it runs on every request, and at hundreds of engines building those objects and reading
    the load of idle ones cost more than the rest of admission. Same sums in the same order
    (idle engines add exact zeros), so the same ``Pressure``; None when no engine serves
    ``model``."""
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    loaded = state.load.loaded_workers()
    health = state.health
    capacity = demand = weight_sum = 0.0
    n = 0
    for w in state.workers.values():
        if w.model != model and model not in w.loras:
            continue
        weight = ROUTING_WEIGHT.get(health.get(w.worker_id, HealthStatus.HEALTHY), 0.0)
        for rank in range(w.dp_size):
            n += 1
            weight_sum += weight
            capacity += weight * w.kv_total_blocks * usable_fraction
            key = (w.worker_id, rank)
            if key in loaded:
                demand += state.load.active_decode_blocks(key) + math.ceil(
                    state.load.active_prefill_tokens(key, state.now) / block_size)
    unhealthy = ROUTING_WEIGHT.get(HealthStatus.UNHEALTHY, 0.0)
    for w in state.lost_workers.values():
        if (w.model == model or model in w.loras) and w.worker_id not in state.workers:
            for _ in range(w.dp_size):
                n += 1
                weight_sum += unhealthy
                capacity += unhealthy * w.kv_total_blocks * usable_fraction
    if not n:
        return None
    return Pressure(capacity, demand, weight_sum / n)


def degradation_level(capacity: float, demand: float, healthy_fraction: float) -> int:
    """The guide's level 0..4 from healthy capacity vs demand (see the module docstring)."""
    if healthy_fraction <= 0.0 or capacity <= 0.0:
        return MAX_LEVEL  # nothing healthy is left to serve a new request
    if demand <= 0.0:
        return 0
    ratio = capacity / demand
    level = next((i for i, floor in enumerate(_RATIO_FLOORS) if ratio >= floor), MAX_LEVEL)
    if healthy_fraction >= 1.0:
        level = min(level, 1)  # a full fleet's overload is the busy-threshold path (503s)
    return level


def decide(level: int, tier: str) -> bool:
    """True when a new request of ``tier`` is shed (503 + Retry-After) at ``level``."""
    try:
        return level >= SHED_FROM_LEVEL[tier]
    except KeyError:
        raise ValueError(f"unknown priority tier {tier!r}; one of {', '.join(TIERS)}") from None


def retry_after(level: int) -> int:
    """Seconds to put in ``Retry-After`` for a request shed at ``level``."""
    return RETRY_AFTER[max(0, min(level, MAX_LEVEL))]


class Degrader:
    """The current level with hysteresis: it rises at once, but falls one level at a time and
    only after the computed level has stayed lower for ``cool_down`` seconds. Shedding lowers
    demand, which lowers the computed level, which would let the shed traffic back in: without
    the delay the level would flap on every request."""

    def __init__(self, cool_down: float = 10.0) -> None:
        self.cool_down = cool_down
        self.level = 0
        self._lower_since: float | None = None

    def update(self, pressure: Pressure, now: float) -> int:
        target = pressure.level
        if target >= self.level:
            self.level = target
            self._lower_since = None
        elif self._lower_since is None:
            self._lower_since = now
        elif now - self._lower_since >= self.cool_down:
            self.level -= 1
            self._lower_since = now if self.level > target else None
        return self.level
