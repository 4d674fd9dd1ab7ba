"""The fair queue against a plain model: whatever sequence of push / pop / remove, each tenant's
queued tokens are those of its requests still waiting, and ``pop`` hands out the request the
rule names: highest tier, then least service per weight plus the tenant's lift as the caller
gives it (ties: the tenant whose queue formed first), then first come within the tenant.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from replicas.core.fair_queue import FairQueue

TENANTS = ["a", "b", "c"]


@dataclass(eq=False)
class Item:
    n: int
    tenant: str
    tier: int
    tokens: int


@dataclass
class Model:
    items: list[Item] = field(default_factory=list)  # in arrival order
    formed: dict[tuple[int, str], int] = field(default_factory=dict)  # queue -> when it formed
    clock: int = 0


class FairQueueMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.service = {t: 0.0 for t in TENANTS}
        self.lift: dict[str, float] = {}  # what the caller's newcomer_lifts would say
        self.queue: FairQueue[Item] = FairQueue("fcfs", lambda t: self.service[t],
                                                lambda: self.lift)
        self.model = Model()
        self.n = 0

    @rule(tenant=st.sampled_from(TENANTS), tier=st.integers(0, 2), tokens=st.integers(0, 50))
    def push(self, tenant: str, tier: int, tokens: int) -> None:
        self.n += 1
        item = Item(self.n, tenant, tier, tokens)
        self.queue.push(item, arrival=float(self.n), tenant=tenant, tier=tier, tokens=tokens)
        self.model.items.append(item)
        self.model.clock += 1
        self.model.formed.setdefault((tier, tenant), self.model.clock)

    @rule(tenant=st.sampled_from(TENANTS), amount=st.sampled_from([0.0, 5.0, 50.0]))
    def lifted(self, tenant: str, amount: float) -> None:
        if amount:
            self.lift[tenant] = amount
        else:
            self.lift.pop(tenant, None)

    @rule(tenant=st.sampled_from(TENANTS), amount=st.sampled_from([0.0, 1.0, 10.0, 100.0]))
    def serve(self, tenant: str, amount: float) -> None:
        self.service[tenant] += amount  # what the replicated book would say meanwhile

    def _forget_empty(self) -> None:
        live = {(i.tier, i.tenant) for i in self.model.items}
        self.model.formed = {k: v for k, v in self.model.formed.items() if k in live}

    @precondition(lambda self: bool(self.model.items))
    @rule()
    def pop(self) -> None:
        items = self.model.items
        tier = max(i.tier for i in items)
        keys = {(i.tier, i.tenant) for i in items if i.tier == tier}
        key = min(keys, key=lambda k: (self.service[k[1]] + self.lift.get(k[1], 0.0),
                                       self.model.formed[k]))
        expected = next(i for i in items if (i.tier, i.tenant) == key)
        assert self.queue.pop() is expected
        items.remove(expected)
        self._forget_empty()

    @precondition(lambda self: bool(self.model.items))
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        item = data.draw(st.sampled_from(self.model.items))
        assert self.queue.remove(item)
        assert not self.queue.remove(item)
        self.model.items.remove(item)
        self._forget_empty()

    @invariant()
    def sums_match(self) -> None:
        assert len(self.queue) == len(self.model.items)
        for t in TENANTS:
            assert self.queue.queued_tokens(t) == sum(i.tokens for i in self.model.items
                                                      if i.tenant == t)


FairQueueMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40,
                                              deadline=None)
TestFairQueueModel = FairQueueMachine.TestCase
