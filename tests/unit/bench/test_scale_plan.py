"""`bench scale`'s plan: replica counts by CPUs, and how many simulated engines share a process."""

from __future__ import annotations

from bench.scale import default_replica_counts, engines_per_process


def test_engines_get_a_process_each_until_there_are_more_engines_than_cores() -> None:
    assert engines_per_process(8, 0, cpus=16) == 1
    assert engines_per_process(16, 0, cpus=16) == 1
    assert engines_per_process(256, 0, cpus=16) == 16  # 16 processes of 16
    assert engines_per_process(256, 0, cpus=2) == 128
    assert engines_per_process(257, 0, cpus=16) == 17  # the last process holds fewer
    assert engines_per_process(256, 4, cpus=2) == 4  # asked for: as asked


def test_replica_counts_double_up_to_half_the_cores_and_at_least_four() -> None:
    assert default_replica_counts(2) == [1, 2, 4]
    assert default_replica_counts(16) == [1, 2, 4, 8]
