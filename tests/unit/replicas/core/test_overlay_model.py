"""The overlay against a plain model: whatever sequence of add / reconcile / clear, each
worker rank's sums are exactly those of the decisions still pending on it.

Decisions of zero prefill tokens and zero new blocks are common (a prompt fully cached and
already running on that rank), so the strategy draws them often: sums that reach zero while
such decisions are still pending must not lose the rank's entry.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from replicas.core.index import WorkerKey
from replicas.core.overlay import Overlay, PendingDecision

RANKS: list[WorkerKey] = [("w0", 0), ("w0", 1), ("w1", 0)]
REQUEST_IDS = st.sampled_from([f"r{i}" for i in range(6)])
SIZES = st.one_of(st.just(0), st.integers(0, 3), st.integers(0, 500))


class OverlayMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.overlay = Overlay()
        self.model: dict[str, PendingDecision] = {}

    @rule(request_id=REQUEST_IDS, worker=st.sampled_from(RANKS), prefill=SIZES, blocks=SIZES)
    def add(self, request_id: str, worker: WorkerKey, prefill: int, blocks: int) -> None:
        decision = PendingDecision(worker, prefill, blocks)
        self.overlay.add(request_id, decision)
        self.model[request_id] = decision

    @rule(request_id=REQUEST_IDS)
    def reconcile(self, request_id: str) -> None:
        self.overlay.reconcile(request_id)
        self.model.pop(request_id, None)

    @rule()
    def clear(self) -> None:
        self.overlay.clear()
        self.model.clear()

    @invariant()
    def sums_match_the_pending_decisions(self) -> None:
        assert len(self.overlay) == len(self.model)
        for request_id in self.model:
            assert request_id in self.overlay
        for worker in RANKS:
            pending = [p for p in self.model.values() if p.worker == worker]
            assert self.overlay.prefill_tokens(worker) == sum(p.prefill_tokens for p in pending)
            assert self.overlay.decode_blocks(worker) == sum(p.new_blocks for p in pending)
            assert sorted(self.overlay.prefilling(worker)) == sorted(
                r for r, p in self.model.items() if p.worker == worker and p.prefill_tokens)


OverlayMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40,
                                            deadline=None)
TestOverlayModel = OverlayMachine.TestCase


def test_two_zero_sized_decisions_on_one_rank_reconcile_cleanly() -> None:
    overlay = Overlay()
    overlay.add("a", PendingDecision(("w0", 0), 0, 0))
    overlay.add("b", PendingDecision(("w0", 0), 0, 0))
    overlay.reconcile("a")
    overlay.reconcile("b")
    assert len(overlay) == 0 and overlay.prefill_tokens(("w0", 0)) == 0
