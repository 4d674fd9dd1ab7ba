"""Recently ended requests against a plain model: an id is remembered from its first add until
the bound passes the end of its routed second, and snapshots keep exactly that."""

from __future__ import annotations

import math

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from replicas.core.ended import EndedRequests

IDS = [f"r{i}" for i in range(6)]
TIMES = st.floats(0, 20, allow_nan=False)


class EndedMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.ended = EndedRequests()
        self.model: dict[str, float] = {}  # id -> routed ts of the add that counted

    @rule(request_id=st.sampled_from(IDS), ts=TIMES)
    def add(self, request_id: str, ts: float) -> None:
        self.ended.add(request_id, ts)
        self.model.setdefault(request_id, ts)

    @rule(bound=TIMES)
    def expire(self, bound: float) -> None:
        self.ended.expire(bound)
        for request_id, ts in list(self.model.items()):
            if math.floor(ts) + 1 <= bound:
                del self.model[request_id]

    @rule()
    def restore_from_snapshot(self) -> None:
        self.ended = EndedRequests.from_plain(self.ended.to_plain())

    @rule()
    def clear(self) -> None:
        self.ended.clear()
        self.model.clear()

    @invariant()
    def membership_matches_the_model(self) -> None:
        assert len(self.ended) == len(self.model)
        for request_id in IDS:
            assert (request_id in self.ended) == (request_id in self.model)


EndedMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=30,
                                          deadline=None)
TestEndedModel = EndedMachine.TestCase
