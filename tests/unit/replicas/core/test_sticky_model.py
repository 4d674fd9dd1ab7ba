"""The sticky overlay against a plain model: a session is known here while any decision of it
routed here is unsettled, and then points at the engine of its latest decision routed here (None
when that decision closes the session): that pin is the last of the session's this replica
appended, so it is what the state will hold once they are applied. A request id decided again (a
retry under the same id) counts once, for its newest session."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from replicas.core.index import WorkerKey
from replicas.core.sticky import SessionRequest, StickyOverlay

SESSIONS = ["s0", "s1", "s2"]
RANKS: list[WorkerKey] = [("w0", 0), ("w1", 0)]
REQUEST_IDS = st.sampled_from([f"r{i}" for i in range(5)])


class StickyMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.overlay = StickyOverlay()
        self.pending: dict[str, str] = {}  # request id -> session
        self.latest: dict[str, WorkerKey | None] = {}  # session -> its latest decision's engine

    @rule(request_id=REQUEST_IDS, session=st.sampled_from(SESSIONS),
          action=st.sampled_from(["open", "bind", "close"]), worker=st.sampled_from(RANKS))
    def routed(self, request_id: str, session: str, action: str, worker: WorkerKey) -> None:
        self.overlay.routed(request_id, SessionRequest(session, action), worker)
        self.pending[request_id] = session
        self.latest[session] = None if action == "close" else worker

    @rule(request_id=REQUEST_IDS)
    def settled(self, request_id: str) -> None:
        self.overlay.settled(request_id)
        self.pending.pop(request_id, None)

    @rule()
    def clear(self) -> None:
        self.overlay.clear()
        self.pending.clear()

    @invariant()
    def lookups_match_the_latest_unsettled_decision(self) -> None:
        for session in SESSIONS:
            known = session in self.pending.values()
            expected = (True, self.latest[session]) if known else (False, None)
            assert self.overlay.lookup(session) == expected


StickyMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=30,
                                           deadline=None)
TestStickyModel = StickyMachine.TestCase


def test_a_request_decided_again_for_another_session_releases_the_first() -> None:
    overlay = StickyOverlay()
    overlay.routed("r", SessionRequest("a"), ("w0", 0))
    overlay.routed("r", SessionRequest("b"), ("w1", 0))
    overlay.settled("r")
    assert overlay.lookup("a") == (False, None)
    assert overlay.lookup("b") == (False, None)
