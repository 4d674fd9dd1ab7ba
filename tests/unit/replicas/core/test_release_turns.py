"""Turns between replicas at an engine's opening: the replica after the one whose prompt made
the opening goes first, the others one grace per place behind it, and the load remembers whose
prompt last left each worker rank's prefill."""

from __future__ import annotations

from replicas.core.load import ActiveLoad
from replicas.core.release_turns import turn_distance

W = ("w", 0)


def test_the_opening_goes_to_the_next_replica_in_the_ring() -> None:
    ring = {"r0", "r1", "r2"}
    assert [turn_distance(ring, "r0", me) for me in ("r0", "r1", "r2")] == [2, 0, 1]
    assert [turn_distance(ring, "r2", me) for me in ("r0", "r1", "r2")] == [0, 1, 2]
    # Each opening has exactly one turn-holder and every other replica its own place.
    for freed_by in ring:
        assert sorted(turn_distance(ring, freed_by, me) for me in ring) == [0, 1, 2]


def test_who_made_the_opening_is_in_the_ring_even_with_nothing_left_in_flight() -> None:
    assert turn_distance({"r1"}, "r0", "r1") == 0
    assert turn_distance({"r1"}, "r0", "r0") == 1


def test_a_replica_outside_the_ring_is_in_nobodys_count_and_waits_for_nobody() -> None:
    assert turn_distance({"r0", "r1"}, "r0", "r9") == 0
    assert turn_distance({"r0", "r1"}, "r0", "r1") == 0  # r9 takes no place from r1


def test_the_ring_is_who_routed_lately_or_still_has_a_request_in_flight() -> None:
    load = ActiveLoad()
    load.add("a", "r0", W, 10, [], ts=1.0)
    load.add("b", "r1", W, 10, [], ts=5.0)
    load.finish("b")
    assert load.routed_since(0.0) == {"r0", "r1"}
    assert load.routed_since(3.0) == {"r0", "r1"}  # r0 still has "a" in flight
    load.finish("a")
    assert load.routed_since(3.0) == {"r1"}
    load.add("c", "r2", W, 10, [], ts=6.0)
    load.replica_lost("r1")
    assert load.routed_since(3.0) == {"r2"}


def test_one_replica_and_unknown_openings_wait_for_nobody() -> None:
    assert turn_distance({"r0"}, "r0", "r0") == 0
    assert turn_distance(set(), "r0", "r0") == 0
    assert turn_distance({"r0", "r1"}, None, "r1") == 0


def test_the_load_remembers_whose_prompt_last_left_each_prefill() -> None:
    load = ActiveLoad()
    assert load.freed_by(W) is None
    load.add("a", "r0", W, 100, [], ts=1.0)
    load.add("b", "r1", W, 100, [], ts=1.0)
    assert load.freed_by(W) is None  # nothing left its prefill yet
    assert load.prefill_completed("a")
    assert load.freed_by(W) == "r0"
    assert load.finish("b")  # ended before its first token: its prompt left the engine too
    assert load.freed_by(W) == "r1"
    assert load.finish("a")  # its prefill was over already: no new opening
    assert load.freed_by(W) == "r1"
    # A hint, not state: the digest does not see it.
    fresh = ActiveLoad()
    assert fresh.digest == load.digest
