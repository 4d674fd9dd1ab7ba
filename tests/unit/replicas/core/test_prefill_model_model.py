"""One worker rank's prefill model against a plain model: the kept completions are the most
recent ``KEEP`` observed (by first token time) whatever the order they came in, the throughput
and digest are functions of that set, and the anchor is the oldest modeled prefill still
pending (a request id started again counts with its newest routing time)."""

from __future__ import annotations

import heapq
import itertools
import struct

import xxhash
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from replicas.core.prefill_model import KEEP, MIN_BUSY_SECONDS, Completion, WorkerPrefill

IDS = st.sampled_from([f"r{i}" for i in range(5)])
TIMES = st.integers(0, 50).map(float)
COMPLETION = st.tuples(TIMES, IDS, TIMES, st.integers(0, 3000)).map(
    lambda c: (max(c[0], c[2]), c[1], c[2], c[3]))  # a first token never precedes its routing


def brute_rate(kept: list[Completion]) -> float | None:
    """Tokens over the time covered by the union of [routed, first token], summed over the
    elementary intervals between all their ends: independent of the production sweep."""
    if not kept:
        return None
    edges = sorted({c[2] for c in kept} | {c[0] for c in kept})
    busy = 0.0
    for lo, hi in itertools.pairwise(edges):
        if any(routed <= lo and hi <= done for done, _, routed, _ in kept):
            busy += hi - lo
    if busy < MIN_BUSY_SECONDS:
        return None
    return sum(c[3] for c in kept) / busy


def mix(c: Completion) -> int:
    done, rid, routed, tokens = c
    return xxhash.xxh3_64_intdigest(struct.pack("<ddq", done, routed, tokens) + rid.encode(),
                                    seed=3)


class PrefillMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.rank = WorkerPrefill()
        self.observed: list[Completion] = []
        self.pending: dict[str, float] = {}  # id -> routed ts of its newest start

    @rule(completions=st.lists(COMPLETION, max_size=KEEP))
    def observe(self, completions: list[Completion]) -> None:
        for done, rid, routed, tokens in completions:
            self.rank.observe(rid, tokens, routed, done)
            if tokens > 0:  # a fully cached prompt says nothing about speed
                self.observed.append((done, rid, routed, tokens))

    @rule(request_id=IDS, ts=TIMES)
    def start(self, request_id: str, ts: float) -> None:
        self.rank.start(request_id, ts)
        self.pending[request_id] = ts

    @rule(request_id=IDS)
    def leave(self, request_id: str) -> None:
        self.rank.leave(request_id)
        self.pending.pop(request_id, None)

    @rule()
    def restore_from_snapshot(self) -> None:
        restored = WorkerPrefill.from_plain(self.rank.plain())
        restored.pending, restored.pending_ids = self.rank.pending, self.rank.pending_ids
        self.rank = restored

    def kept(self) -> list[Completion]:
        return heapq.nlargest(KEEP, self.observed)

    @invariant()
    def learned_figures_are_those_of_the_kept_set(self) -> None:
        kept = self.kept()
        assert sorted(self.rank.done) == sorted(kept)
        assert self.rank.digest == sum(mix(c) for c in kept) & ((1 << 64) - 1)
        expected = brute_rate(kept)
        got = self.rank.throughput()
        if expected is None:
            assert got is None
        else:
            assert got is not None and abs(got - expected) <= 1e-9 * max(expected, 1.0)

    @invariant()
    def anchor_is_the_oldest_pending(self) -> None:
        expected = min(((ts, rid) for rid, ts in self.pending.items()), default=None)
        anchor = self.rank.anchor()
        assert anchor == expected
        if anchor is not None:
            start = max([anchor[0]] + [done for done, rid, routed, _ in self.kept()
                                       if (routed, rid) < anchor])
            assert self.rank.anchor_start(anchor) == start


PrefillMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=30,
                                            deadline=None)
TestPrefillModel = PrefillMachine.TestCase


def test_a_prefill_started_again_is_anchored_at_its_newest_routing() -> None:
    rank = WorkerPrefill()
    rank.start("r", 1.0)
    rank.leave("r")
    rank.start("r", 5.0)
    assert rank.anchor() == (5.0, "r")
