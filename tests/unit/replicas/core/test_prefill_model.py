"""The linear prefill load model (``--router-prefill-load-model linear``): throughput learned from
observed prefill completions, the oldest modeled prefill decaying over its predicted duration —
all in event time, the same on every replica."""

from __future__ import annotations

import random

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eventlog.names import ROUTER
from replicas.core.load import ActiveLoad
from replicas.core.prefill_model import KEEP, WorkerPrefill
from replicas.core.state import RouterState, StateConfig
from tests.eventgen import interleave, router_history

W = ("w1", 0)


def _learned(load: ActiveLoad, tokens_per_s: float = 1000.0) -> None:
    """Teach ``W`` a throughput: one 1000-token prefill that took 1000/tokens_per_s seconds."""
    load.add("warm", "rep", W, 1000, [], ts=0.0)
    load.prefill_completed("warm", ts=1000.0 / tokens_per_s)
    load.finish("warm")


def test_throughput_is_tokens_over_the_union_of_prefill_intervals() -> None:
    wp = WorkerPrefill()
    assert wp.throughput() is None
    wp.observe("a", 1000, 0.0, 1.0)
    assert wp.throughput() == pytest.approx(1000.0)
    # Queued behind a: its wait overlaps a's interval, so only [1, 2] is new busy time.
    wp.observe("b", 1000, 0.5, 2.0)
    assert wp.throughput() == pytest.approx(1000.0)
    # Prefilled in one batch with b: tokens without time.
    wp.observe("c", 1000, 1.5, 2.0)
    assert wp.throughput() == pytest.approx(1500.0)
    # An idle gap is not busy time.
    wp.observe("d", 500, 10.0, 10.5)
    assert wp.throughput() == pytest.approx(3500.0 / 2.5)
    wp.observe("cached", 0, 11.0, 11.0)  # a fully cached prompt says nothing about speed
    assert wp.throughput() == pytest.approx(3500.0 / 2.5)


def test_learning_is_a_function_of_the_completions_not_of_their_order() -> None:
    rng = random.Random(7)
    obs = []
    for i in range(3 * KEEP):
        routed = rng.uniform(0, 100)
        obs.append((f"r{i}", rng.randint(1, 4000), routed, routed + rng.uniform(0, 3)))
    figures = set()
    for _ in range(5):
        rng.shuffle(obs)
        wp = WorkerPrefill()
        for o in obs:
            wp.observe(*o)
        assert len(wp.done) == KEEP  # only the most recent completions are kept
        figures.add((wp.throughput(), wp.digest))
        assert WorkerPrefill.from_plain(wp.plain()).digest == wp.digest
    assert len(figures) == 1


def test_the_oldest_modeled_prefill_decays_and_the_next_one_waits() -> None:
    load = ActiveLoad()
    _learned(load, 1000.0)
    load.add("a", "rep", W, 2000, [], ts=10.0, modeled=True)
    load.add("b", "rep", W, 500, [], ts=10.5, modeled=True)
    assert load.active_prefill_tokens(W) == 2500  # without a time: static accounting
    assert load.active_prefill_tokens(W, 10.0) == 2500
    assert load.active_prefill_tokens(W, 10.5) == pytest.approx(2000.0)  # a: 500 done
    assert load.active_prefill_tokens(W, 11.5) == pytest.approx(1000.0)
    assert load.active_prefill_tokens(W, 30.0) == pytest.approx(500.0)  # a done; b waits
    # a's first token at 12.0: b is the anchor from then on, at the throughput learned so far.
    load.prefill_completed("a", ts=12.0)
    rate = load.prefill_throughput(W)
    assert rate == pytest.approx(3000.0 / 3.0)  # warm: 1000 in [0, 1]; a: 2000 in [10, 12]
    assert load.active_prefill_tokens(W, 12.0) == pytest.approx(500.0)
    assert load.active_prefill_tokens(W, 12.25) == pytest.approx(500.0 - 0.25 * rate)
    load.finish("b")
    assert load.active_prefill_tokens(W, 13.0) == 0


def test_only_modeled_requests_decay_and_only_once_something_was_learned() -> None:
    load = ActiveLoad()
    load.add("a", "rep", W, 800, [], ts=5.0, modeled=True)
    assert load.active_prefill_tokens(W, 50.0) == 800  # nothing learned: no prediction
    load.finish("a")
    _learned(load)
    load.add("plain", "rep", W, 800, [], ts=5.0)
    assert load.active_prefill_tokens(W, 50.0) == 800  # routed with the model off


def test_a_newer_prefill_finishing_first_does_not_restart_the_anchor() -> None:
    wp = WorkerPrefill()
    wp.observe("old", 1000, 0.0, 1.0)
    wp.start("a", 2.0)
    wp.start("b", 3.0)
    anchor = wp.anchor()
    assert anchor == (2.0, "a") and wp.anchor_start(anchor) == 2.0
    wp.observe("b", 100, 3.0, 3.2)  # b (short, newer) done first, batched with a
    wp.leave("b")
    assert wp.anchor() == anchor and wp.anchor_start(anchor) == 2.0
    wp.observe("a", 1000, 2.0, 4.0)
    wp.leave("a")
    assert wp.anchor() is None


def test_the_next_anchor_starts_when_the_one_before_it_produced_its_first_token() -> None:
    wp = WorkerPrefill()
    wp.start("a", 1.0)
    wp.start("b", 1.5)
    wp.observe("a", 1000, 1.0, 3.0)
    wp.leave("a")
    assert wp.anchor() == (1.5, "b") and wp.anchor_start((1.5, "b")) == 3.0


def test_snapshot_keeps_what_was_learned_and_the_decay() -> None:
    load = ActiveLoad()
    _learned(load, 2000.0)
    load.add("a", "rep", W, 3000, [7, 8], ts=4.0, modeled=True)
    load.add("b", "rep", W, 100, [7], ts=4.2, modeled=True)
    load.add("c", "rep", ("w2", 0), 100, [9], ts=4.2, modeled=True)
    plain = msgspec.msgpack.decode(msgspec.msgpack.encode(load.to_plain()))
    back = ActiveLoad.from_plain(plain)
    assert back.digest == load.digest
    assert back.prefill_throughput(W) == load.prefill_throughput(W)
    for now in (4.0, 4.5, 5.0, 9.0):
        assert back.active_prefill_tokens(W, now) == load.active_prefill_tokens(W, now)
    for x in (back, load):
        x.prefill_completed("a", ts=5.0)
    assert back.digest == load.digest
    assert back.active_prefill_tokens(W, 5.02) == load.active_prefill_tokens(W, 5.02) < 100


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**32), st.integers(0, 2**32), st.integers(0, 2**32))
def test_replicas_interleaving_two_replicas_decisions_judge_the_same_load(
        seed: int, o1: int, o2: int) -> None:
    """Routed with both models on (randomly per request), prefilled, progressing, finished: two
    states fed the two replicas' decisions in different interleavings judge every worker alike,
    and so does one restored from a snapshot."""
    rng = random.Random(seed)
    workers = ["w0", "w1", "w2"]
    histories = [router_history(rng, r, workers, 60) for r in ("ra", "rb")]
    states = []
    for order in (o1, o2):
        state = RouterState(StateConfig(block_size=16, request_max_age=1e9))
        for seq, batch in enumerate(interleave(random.Random(order), histories), 1):
            state.apply(ROUTER, seq, batch)
        states.append(state)
    states.append(RouterState.decode(states[0].encode(), states[0].config))
    now = max(s.now for s in states)
    views = {(tuple(round(s.load.active_prefill_tokens((w, 0), now), 9) for w in workers),
              tuple(s.load.active_decode_blocks((w, 0)) for w in workers),
              s.digests()["load"]) for s in states}
    assert len(views) == 1
