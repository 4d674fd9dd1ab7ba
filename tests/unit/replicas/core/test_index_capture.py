"""The prefix index's capture in steps (index_capture.py for the compact form,
index_reference_capture.py for the reference form) and the state's (state_codec.capture): the
same snapshot as a capture at once, whatever the step size; a change between the first and the
last step refused rather than written; approximate mode captured whole."""

from __future__ import annotations

import random

import pytest

from eventlog import events as ev
from eventlog.names import KV, ROUTER
from replicas.core.index_capture import IndexCapture, IndexChanged
from replicas.core.state import RouterState, StateConfig
from tests.eventgen import interleave, router_history, worker_history

COMPACT = StateConfig(index_form="compact")


def history(seed: int, workers: int = 5, batches: int = 60) -> list[list[ev.Event]]:
    rng = random.Random(seed)
    return interleave(rng, [worker_history(rng, f"w{i}", batches, dp_size=1 + i % 2)
                            for i in range(workers)])


def state_after(config: StateConfig, batches: list[list[ev.Event]]) -> RouterState:
    state = RouterState(config)
    for seq, batch in enumerate(batches, 1):
        state.apply(KV, seq, batch)
    return state


def stepped(capture: IndexCapture) -> int:
    steps = 0
    for _ in capture.steps():
        steps += 1
    return steps


@pytest.mark.parametrize("seed", range(3))
def test_the_reference_form_in_steps_is_its_capture_at_once(seed: int) -> None:
    state = state_after(StateConfig(), history(seed))
    capture = state.index.plain_capture()
    assert stepped(capture) == len(state.index._slots)  # one worker's map a step
    assert capture.build() == state.index.to_plain()


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("step_cells", [8, 64, 1 << 19])
def test_a_capture_in_steps_is_the_capture_at_once(seed: int, step_cells: int) -> None:
    state = state_after(COMPACT, history(seed))
    whole = state.index.to_plain()
    capture = IndexCapture(state.index, step_cells=step_cells)
    steps = stepped(capture)
    assert capture.build() == whole
    if step_cells == 8:
        assert steps > len(state.index._slots) * 8  # many pieces a slot: joined in build


def test_holder_bitmaps_of_more_than_64_slots_are_copied_row_by_row() -> None:
    """Two words a bitmap: a step copies whole rows."""
    rng = random.Random(3)
    state = state_after(COMPACT, interleave(rng, [worker_history(rng, f"w{i}", 4)
                                                  for i in range(70)]))
    assert state.index._holders.rows.shape[1] == 2 and state.index._holders.rows_used
    capture = IndexCapture(state.index, step_cells=8)
    stepped(capture)
    assert capture.build() == state.index.to_plain()


def test_the_copies_do_not_follow_later_changes() -> None:
    batches = history(1)
    state = state_after(COMPACT, batches[:-40])
    before = state.index.to_plain()
    capture = IndexCapture(state.index, step_cells=64)
    stepped(capture)
    for seq, batch in enumerate(batches[-40:], len(batches) - 39):
        state.apply(KV, seq, batch)
    assert state.index.to_plain() != before
    assert capture.build() == before


@pytest.mark.parametrize("config", [COMPACT, StateConfig()], ids=["compact", "reference"])
def test_a_change_between_two_steps_is_refused(config: StateConfig) -> None:
    batches = history(2)
    state = state_after(config, batches[:-1])
    capture = (IndexCapture(state.index, step_cells=64) if config is COMPACT
               else state.index.plain_capture())
    steps = capture.steps()
    next(steps)
    state.apply(KV, len(batches), batches[-1])
    with pytest.raises(IndexChanged):
        for _ in steps:
            pass
    with pytest.raises(RuntimeError, match="not complete"):
        capture.build()


def test_a_step_size_that_does_not_pack_into_whole_bytes_is_refused() -> None:
    with pytest.raises(ValueError, match="multiple of 8"):
        IndexCapture(RouterState(COMPACT).index, step_cells=12)


@pytest.mark.parametrize("config", [COMPACT, StateConfig()], ids=["compact", "reference"])
def test_the_state_captured_in_steps_decodes_to_the_state_at_its_positions(
        config: StateConfig) -> None:
    """Router messages applied between the steps are not in the snapshot: its positions are
    the capture's, and so are its load and sessions."""
    rng = random.Random(5)
    state = state_after(config, history(5))
    routed = router_history(rng, "r1", ["w0", "w1", "w2"], 80)
    for seq, batch in enumerate(routed[:40], 1):
        state.apply(ROUTER, seq, batch)
    digests, positions = state.digests(), dict(state.positions)
    taken = state.capture()
    steps = 0
    for seq, _ in enumerate(taken.steps, 41):
        if seq <= len(routed):
            state.apply(ROUTER, seq, routed[seq - 1])
        steps += 1
    assert steps > 1 and state.positions[ROUTER] > positions[ROUTER]
    restored = RouterState.decode(taken.encode(), config)
    assert restored.positions == positions
    assert restored.digests() == digests


@pytest.mark.parametrize("config", [COMPACT, StateConfig()], ids=["compact", "reference"])
def test_a_kv_message_applied_during_the_state_capture_is_refused(config: StateConfig) -> None:
    """Even one that leaves the index as it was (a removal of a block nobody holds)."""
    state = state_after(config, history(6))
    taken = state.capture()
    next(taken.steps)
    assert state.apply(KV, state.positions[KV] + 1,
                       [ev.BlocksRemoved("nobody", 1, 0, [12345], 1.0)])
    with pytest.raises(IndexChanged, match="KV messages"):
        for _ in taken.steps:
            pass


@pytest.mark.parametrize("form", ["reference", "compact"])
def test_approximate_mode_is_captured_whole(form: str) -> None:
    config = StateConfig(index_form=form, approximate=True)
    state = state_after(config, history(7))
    # the index is fed by decisions there
    for seq, batch in enumerate(router_history(random.Random(7), "r1", ["w0", "w1"], 30), 1):
        state.apply(ROUTER, seq, batch)
    digests = state.digests()
    taken = state.capture()
    assert list(taken.steps) == []
    state.apply(KV, state.positions[KV] + 1, history(8)[1])  # later changes do not reach it
    assert RouterState.decode(taken.encode(), config).digests() == digests
