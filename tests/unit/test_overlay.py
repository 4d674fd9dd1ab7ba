"""The optimistic overlay: a decision counts at once, and exactly until it is reconciled."""

from __future__ import annotations

from eventlog import events as ev
from eventlog.names import ROUTER
from replicas.core.overlay import Overlay, PendingDecision, pending_decision
from replicas.core.state import RouterState


def test_added_decisions_sum_per_rank_and_reconcile_once() -> None:
    o = Overlay()
    o.add("q1", PendingDecision(("w", 0), 100, 3))
    o.add("q2", PendingDecision(("w", 0), 20, 1))
    o.add("q3", PendingDecision(("w", 1), 5, 1))
    assert (o.prefill_tokens(("w", 0)), o.decode_blocks(("w", 0))) == (120, 4)
    assert len(o) == 3 and "q1" in o
    o.reconcile("q1")
    o.reconcile("q1")  # applied from the stream after the request already finished: no-op
    o.reconcile("never-added")
    assert (o.prefill_tokens(("w", 0)), o.decode_blocks(("w", 0))) == (20, 1)
    assert len(o) == 2


def test_a_request_id_counts_once_and_clear_forgets_everything() -> None:
    o = Overlay()
    o.add("q", PendingDecision(("w", 0), 100, 3))
    o.add("q", PendingDecision(("v", 0), 7, 1))  # decided again (e.g. a retry): the last one
    assert o.prefill_tokens(("w", 0)) == 0 and o.prefill_tokens(("v", 0)) == 7
    o.clear()
    assert len(o) == 0 and o.decode_blocks(("v", 0)) == 0


def test_pending_decision_counts_uncached_tokens_and_blocks_not_shared_by_running_requests(
) -> None:
    s = RouterState()
    s.apply(ROUTER, 1, [ev.RequestRouted("r", "x", "w", 0, 32, [11, 12], 0, 8, 0, 1.0)])
    p = pending_decision(s.load, ("w", 0), isl_tokens=64, overlap_blocks=1, block_size=16,
                         seq_hashes=[11, 12, 13, 14])
    assert p == PendingDecision(("w", 0), prefill_tokens=48, new_blocks=2)
    p = pending_decision(s.load, ("w", 1), isl_tokens=10, overlap_blocks=4, block_size=16,
                         seq_hashes=[11])
    assert p == PendingDecision(("w", 1), prefill_tokens=0, new_blocks=1)
