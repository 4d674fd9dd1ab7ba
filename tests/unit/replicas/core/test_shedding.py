"""Degradation levels and priority shedding (Dynamo's fault-tolerance guide's levels)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eventlog import events as ev
from replicas.core.shedding import (
    TIERS,
    Degrader,
    Pressure,
    UnitLoad,
    decide,
    degradation_level,
    fleet_pressure,
    model_pressure,
    model_units,
    retry_after,
)
from replicas.core.state import RouterState
from tests.unit.replicas.core.test_candidate_columns_state import build as build_state
from tests.unit.replicas.core.test_candidate_columns_state import worker as state_worker


@pytest.mark.parametrize(("capacity", "demand", "level"), [
    (100, 50, 0), (100, 100, 0),          # ratio >= 1: normal
    (99, 100, 1), (75, 100, 1),           # >= 0.75
    (74, 100, 2), (50, 100, 2),           # >= 0.5: shed best_effort
    (49, 100, 3), (25, 100, 3),           # >= 0.25
    (24, 100, 4), (1, 1000, 4),           # emergency
])
def test_level_follows_the_seed_ratio_bands(capacity: float, demand: float, level: int) -> None:
    assert degradation_level(capacity, demand, healthy_fraction=0.5) == level


def test_no_demand_is_normal_and_no_healthy_capacity_is_emergency() -> None:
    assert degradation_level(100, 0, 0.5) == 0
    assert degradation_level(0, 0, 0.0) == 4
    assert degradation_level(0, 10, 0.5) == 4


def test_a_full_fleet_is_never_past_level_1() -> None:
    # Overload with every worker healthy is the busy-threshold path (503s), not degradation.
    assert degradation_level(10, 1000, healthy_fraction=1.0) == 1
    assert degradation_level(100, 50, healthy_fraction=1.0) == 0


# level → (premium, standard, best_effort) shed?
SHED_TABLE = {
    0: (False, False, False),
    1: (False, False, False),
    2: (False, False, True),
    3: (False, True, True),
    4: (True, True, True),
}


@pytest.mark.parametrize("level", sorted(SHED_TABLE))
def test_lowest_tiers_are_shed_first(level: int) -> None:
    assert tuple(decide(level, tier) for tier in TIERS) == SHED_TABLE[level]


def test_unknown_tier_is_an_error() -> None:
    with pytest.raises(ValueError):
        decide(2, "gold")


def test_retry_after_grows_with_the_level() -> None:
    values = [retry_after(level) for level in range(5)]
    assert values == sorted(values) and values[4] == 30 and all(v >= 1 for v in values)
    assert retry_after(9) == 30 and retry_after(-1) == retry_after(0)


def test_fleet_pressure_weights_capacity_by_health_and_counts_all_demand() -> None:
    units = [
        UnitLoad("healthy", kv_total_blocks=100, active_decode_blocks=30, active_prefill_tokens=0),
        UnitLoad("suspicious", 100, 10, 33),      # 33 tokens at block 16 → 3 blocks
        UnitLoad("unhealthy", 100, 40, 0),        # still demand: it drains or migrates
    ]
    p = fleet_pressure(units, block_size=16, usable_fraction=0.8)
    assert p.capacity == pytest.approx(0.8 * (100 + 50))
    assert p.demand == 30 + 10 + 3 + 40
    assert p.healthy_fraction == pytest.approx(1.5 / 3)
    assert p.level == 0  # 120 usable blocks for 83 in demand


def test_half_the_engines_down_under_load_sheds_best_effort_not_premium() -> None:
    up = [UnitLoad("healthy", 100, 70, 0) for _ in range(2)]
    down = [UnitLoad("unhealthy", 100, 70, 0) for _ in range(2)]
    p = fleet_pressure(up + down, block_size=16)
    assert p.level == 2  # capacity 200, demand 280 → ratio 0.71
    assert decide(p.level, "best_effort") and not decide(p.level, "premium")


def test_empty_fleet_is_emergency() -> None:
    assert fleet_pressure([], block_size=16).level == 4


def test_degrader_rises_at_once_and_falls_one_level_per_cool_down() -> None:
    d = Degrader(cool_down=10.0)
    assert d.update(Pressure(20, 100, 0.5), now=0.0) == 4
    calm = Pressure(200, 100, 0.5)
    assert d.update(calm, 1.0) == 4       # lower since t=1
    assert d.update(calm, 10.9) == 4
    assert d.update(calm, 11.0) == 3
    assert d.update(calm, 20.0) == 3
    assert d.update(calm, 21.0) == 2
    assert d.update(Pressure(60, 100, 0.5), 22.0) == 2   # computed 2: stays, clock reset
    assert d.update(calm, 23.0) == 2
    assert d.update(calm, 33.0) == 1
    assert d.update(calm, 43.0) == 0
    assert d.update(Pressure(30, 100, 0.5), 44.0) == 3   # a new drop is followed at once


def test_model_units_reads_the_replicated_state() -> None:
    state = RouterState()
    batch: list[ev.Event] = [
        ev.WorkerRegistered(worker_id=w, url=f"http://{w}", model=m, block_size=16,
                            kv_total_blocks=64, max_num_batched_tokens=1024, ts=1.0)
        for w, m in (("a", "m"), ("b", "m"), ("c", "other"))]
    state.apply("kv", 1, batch)
    state.apply("control", 1, [ev.WorkerHealthChanged(worker_id="b", status="unhealthy",
                                                      reason="test", ts=2.0)])
    units = sorted(model_units(state, "m"), key=lambda u: u.status)
    assert [(u.status, u.kv_total_blocks) for u in units] == [("healthy", 64), ("unhealthy", 64)]
    assert fleet_pressure(units, block_size=16).healthy_fraction == 0.5


def test_an_engine_retired_for_cause_still_counts_as_lost_capacity_until_it_returns() -> None:
    from eventlog import events as ev
    from eventlog.names import KV
    from replicas.core.state import RouterState

    s = RouterState()
    s.apply(KV, 1, [ev.WorkerRegistered("a", "u", "m", 16, 100, 8192, 1.0),
                    ev.WorkerRegistered("b", "u", "m", 16, 100, 8192, 1.0),
                    ev.WorkerRegistered("c", "u", "m", 16, 100, 8192, 1.0)])
    s.apply(KV, 2, [ev.WorkerRetired("a", "heartbeat timeout", 2.0),
                    ev.WorkerRetired("b", "shutdown", 2.0)])
    statuses = sorted(u.status for u in model_units(s, "m"))
    assert statuses == ["healthy", "unhealthy"]  # b left on purpose; a died
    s.apply(KV, 3, [ev.WorkerRegistered("a", "u", "m", 16, 100, 8192, 3.0)])
    assert sorted(u.status for u in model_units(s, "m")) == ["healthy", "healthy"]
    assert RouterState.decode(s.encode()).digests() == s.digests()


@settings(max_examples=60, deadline=None)
@given(workers=st.lists(state_worker, max_size=6), model=st.sampled_from(["m", "sql", "other"]),
       retired=st.lists(st.tuples(st.integers(0, 5), st.booleans()), max_size=3),
       block_size=st.integers(1, 32), usable=st.sampled_from([1.0, 0.8, 0.35]))
def test_model_pressure_equals_the_pressure_of_model_units(
        workers: list[dict[str, object]], model: str, retired: list[tuple[int, bool]],
        block_size: int, usable: float) -> None:
    state, _, _ = build_state(workers, "reference")
    for at, (i, for_cause) in enumerate(retired):  # lost capacity, or a graceful leave
        state.apply("kv", 100 + at, [ev.WorkerRetired(
            f"w{i}", "heartbeat timeout" if for_cause else "shutdown", 4.0)])
    units = model_units(state, model)
    got = model_pressure(state, model, block_size=block_size, usable_fraction=usable)
    if not units:
        assert got is None
    else:
        assert got == fleet_pressure(units, block_size=block_size, usable_fraction=usable)
