"""The fair queue against a plain model: whatever sequence of push / pop / remove, each tenant's
queued tokens are those of its requests still waiting, and ``pop`` hands out the request the
rule names: highest tier, then least service per weight plus the tenant's lift (for a tenant
that started waiting with nothing in flight: up to the least counter among the tenants then
waiting or in flight; ties: the tenant whose queue formed first), then first come within the
tenant.
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
    lift: dict[str, float] = field(default_factory=dict)  # waiting tenant -> its lift
    clock: int = 0


class FairQueueMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.service = {t: 0.0 for t in TENANTS}
        self.busy = {t: 0 for t in TENANTS}  # requests in flight elsewhere in the fleet
        self.queue: FairQueue[Item] = FairQueue(
            "fcfs", lambda t: self.service[t], lambda t: self.busy[t],
            lambda: [t for t in TENANTS if self.busy[t]])
        self.model = Model()
        self.n = 0

    @rule(tenant=st.sampled_from(TENANTS), tier=st.integers(0, 2), tokens=st.integers(0, 50))
    def push(self, tenant: str, tier: int, tokens: int) -> None:
        self.n += 1
        if tenant not in {i.tenant for i in self.model.items}:  # starts waiting
            # VTC's lift, for an idle tenant only: to the least counter of the active ones
            # (waiting here: service + lift; in flight elsewhere: service).
            active = {t: self.service[t] + self.model.lift[t] for t in self.model.lift}
            active.update({t: self.service[t] for t in TENANTS
                           if self.busy[t] and t != tenant and t not in active})
            self.model.lift[tenant] = max(0.0, min(active.values()) - self.service[tenant]) \
                if active and not self.busy[tenant] else 0.0
        item = Item(self.n, tenant, tier, tokens)
        self.queue.push(item, arrival=float(self.n), tenant=tenant, tier=tier, tokens=tokens)
        self.model.items.append(item)
        self.model.clock += 1
        self.model.formed.setdefault((tier, tenant), self.model.clock)

    @rule(tenant=st.sampled_from(TENANTS), n=st.integers(0, 2))
    def in_flight(self, tenant: str, n: int) -> None:
        self.busy[tenant] = n

    @rule(tenant=st.sampled_from(TENANTS), amount=st.sampled_from([0.0, 1.0, 10.0, 100.0]))
    def serve(self, tenant: str, amount: float) -> None:
        self.service[tenant] += amount  # what the replicated book would say meanwhile

    def _forget_empty(self) -> None:
        live = {(i.tier, i.tenant) for i in self.model.items}
        self.model.formed = {k: v for k, v in self.model.formed.items() if k in live}
        self.model.lift = {t: v for t, v in self.model.lift.items()
                           if t in {i.tenant for i in self.model.items}}

    @precondition(lambda self: bool(self.model.items))
    @rule()
    def pop(self) -> None:
        items = self.model.items
        tier = max(i.tier for i in items)
        keys = {(i.tier, i.tenant) for i in items if i.tier == tier}
        key = min(keys, key=lambda k: (self.service[k[1]] + self.model.lift[k[1]],
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
