"""RouterState with either index form: the same events give the same digests, each form
restores its own snapshots, the compact form reads the reference form's, and a reference replica
refuses the compact form's snapshot with a clear error."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eventlog.names import KV
from replicas.core.state import RouterState, StateConfig
from tests.eventgen import interleave, worker_history

WORKERS = ["w0", "w1", "w2"]


def applied(form: str, seed: int) -> RouterState:
    rng = random.Random(seed)
    state = RouterState(StateConfig(index_form=form))
    histories = [worker_history(rng, w, 25, tokens_pool=6) for w in WORKERS]
    for seq, batch in enumerate(interleave(rng, histories), start=1):
        state.apply(KV, seq, batch)
    return state


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**32))
def test_both_forms_agree_on_digests(seed: int) -> None:
    # Their answers to prompts agree block by block: tests/unit/replicas/core/test_index_compact.py
    reference, compact = applied("reference", seed), applied("compact", seed)
    assert reference.digests() == compact.digests()


@pytest.mark.parametrize("seed", [1, 2])
def test_snapshots_cross_forms_one_way(seed: int) -> None:
    reference, compact = applied("reference", seed), applied("compact", seed)
    for state, form in ((reference, "reference"), (compact, "compact")):
        again = RouterState.decode(state.encode(), StateConfig(index_form=form))
        assert again.digests() == state.digests()
    # The compact form reads the reference form's snapshot (an upgrade to the compact form).
    moved = RouterState.decode(reference.encode(), StateConfig(index_form="compact"))
    assert moved.digests() == reference.digests()
    # A reference replica cannot read the compact form's snapshot: it says so.
    with pytest.raises(ValueError, match="--router-index-form compact"):
        RouterState.decode(compact.encode(), StateConfig(index_form="reference"))


def test_an_unknown_form_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown index form"):
        RouterState(StateConfig(index_form="radix"))
