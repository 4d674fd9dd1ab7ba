"""The soak's leak check: when the warm-up counts a process's memory as levelled off."""

from __future__ import annotations

from cluster.chaos_soak import grew


def test_growth_is_the_largest_of_processes_that_lived_through_both_readings() -> None:
    before = {"r0": (10, 100_000), "r1": (11, 100_000), "w0": (12, 50_000)}
    after = {"r0": (10, 100_500), "r1": (99, 300_000), "w0": (12, 51_000), "r2": (13, 9)}
    # r1 restarted (another pid) and r2 is new: neither counts; w0 grew 2%, r0 0.5%.
    assert grew(before, after) == 2.0


def test_shrinking_or_unreadable_memory_is_no_growth() -> None:
    assert grew({"r0": (10, 100_000)}, {"r0": (10, 90_000)}) == 0.0
    assert grew({"r0": (10, None)}, {"r0": (10, 90_000)}) == 0.0
