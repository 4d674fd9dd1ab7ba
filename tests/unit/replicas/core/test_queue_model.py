"""The router queue against a plain model: under every policy, pop and peek give the waiting
item with the highest key (ties: the earliest pushed), whatever pushes, pops and removals came
before; removal drops the earliest pushed equal item."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from replicas.core.queue import POLICIES, RequestQueue, queue_key

ITEMS = st.sampled_from(["a", "b", "c", "d"])


class QueueMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.queue: RequestQueue[str] = RequestQueue()
        self.model: list[tuple[float, int, str]] = []  # (key, push order, item)
        self.pushed = 0

    @initialize(policy=st.sampled_from(POLICIES))
    def choose_policy(self, policy: str) -> None:
        self.queue = RequestQueue(policy)

    @rule(item=ITEMS, arrival=st.integers(0, 10).map(float),
          jump=st.sampled_from([0.0, 0.5, 3.0]), uncached=st.integers(0, 4))
    def push(self, item: str, arrival: float, jump: float, uncached: int) -> None:
        self.queue.push(item, arrival=arrival, priority_jump=jump, uncached_isl_tokens=uncached)
        key = queue_key(self.queue.policy, arrival, jump, uncached)
        self.model.append((key, self.pushed, item))
        self.pushed += 1

    def _first(self) -> tuple[float, int, str] | None:
        return min(self.model, key=lambda e: (-e[0], e[1])) if self.model else None

    @rule()
    def pop(self) -> None:
        first = self._first()
        assert self.queue.pop() == (first[2] if first else None)
        if first is not None:
            self.model.remove(first)

    @rule(item=ITEMS)
    def remove(self, item: str) -> None:
        equal = [e for e in self.model if e[2] == item]
        assert self.queue.remove(item) == bool(equal)
        if equal:
            self.model.remove(min(equal, key=lambda e: e[1]))

    @invariant()
    def peek_and_length_match_the_model(self) -> None:
        first = self._first()
        assert self.queue.peek() == (first[2] if first else None)
        assert len(self.queue) == len(self.model)
        assert bool(self.queue) == bool(self.model)


QueueMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40,
                                          deadline=None)
TestQueueModel = QueueMachine.TestCase
