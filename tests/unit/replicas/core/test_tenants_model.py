"""Tenant usage against a plain model, through ``RouterState.apply``: whatever sequence of
admissions (first hops, migrated hops, prefill hops), finishes, lost replicas, time passing and
snapshot round trips, each tenant's requests and tokens in the last minute and its requests in
flight are exactly what the model computes from the events applied — and so are the oldest
admission in the window and the tokens admitted before a moment, which the fair queue's
newcomer lift reads, and what the headroom reads (the newest admission, who is recent, the
tenant of a hop in flight).
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from eventlog import events as ev
from eventlog.names import CONTROL, PREFILL_HOP, ROUTER, split_hop
from replicas.core.state import RouterState, StateConfig
from replicas.core.tenants import WINDOW

TENANTS = ["a", "b"]
REPLICAS = ["r0", "r1"]
BASES = ["q0", "q1"]
HOP_IDS = st.sampled_from([*BASES, *(f"{b}~1" for b in BASES), *(f"{b}~prefill" for b in BASES)])
# Long enough that no request expires as load: only the tenant window ages out here.
CONFIG = StateConfig(request_max_age=1e7)


@dataclass
class _Charge:
    tenant: str
    ts: float
    prompt: int
    tokens: int
    output: int = 0


class TenantMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.state = RouterState(CONFIG)
        self.seqs = {ROUTER: 0, CONTROL: 0}
        self.now = 1000.0
        self.charges: dict[str, _Charge] = {}
        self.active: dict[str, tuple[str, str, str]] = {}  # hop id -> (base, tenant, replica)
        self.ended: set[str] = set()

    def _apply(self, stream: str, *events: ev.Event) -> None:
        self.seqs[stream] += 1
        self.state.apply(stream, self.seqs[stream], list(events))
        bound = self.state.now - WINDOW
        self.charges = {b: c for b, c in self.charges.items() if c.ts >= bound}

    @rule(hop_id=HOP_IDS, tenant=st.sampled_from(TENANTS), replica=st.sampled_from(REPLICAS),
          prompt=st.integers(1, 50), reserve=st.integers(0, 100), skew=st.floats(-5, 0))
    def route(self, hop_id: str, tenant: str, replica: str, prompt: int, reserve: int,
              skew: float) -> None:
        ts = self.now + skew  # replicas' clocks differ a little: events arrive out of ts order
        self._apply(ROUTER, ev.RequestRouted(hop_id, replica, "w0", 0, prompt, [], 0, 8, 0, ts,
                                             tenant=tenant, tenant_tokens=prompt + reserve))
        if hop_id in self.active or hop_id in self.ended:
            return  # a duplicate: counts nothing
        base, hop = split_hop(hop_id)
        if hop == 0 and base not in self.charges and ts >= self.state.now - WINDOW:
            self.charges[base] = _Charge(tenant, ts, prompt, prompt + reserve)
        tenant_of_base = next((t for b, t, _ in self.active.values() if b == base), tenant)
        self.active[hop_id] = (base, tenant_of_base, replica)

    @rule(hop_id=HOP_IDS, outcome=st.sampled_from(["ok", "migrated", "error"]),
          output=st.integers(0, 40))
    def finish(self, hop_id: str, outcome: str, output: int) -> None:
        self._apply(ROUTER, ev.RequestFinished(hop_id, outcome, output, self.now))
        if hop_id in self.active:
            base = self.active.pop(hop_id)[0]
            charge = self.charges.get(base)
            if charge is not None:
                charge.output += output
                if outcome != "migrated" and split_hop(hop_id)[1] != PREFILL_HOP:
                    charge.tokens = charge.prompt + charge.output
        self.ended.add(hop_id)

    @rule(replica=st.sampled_from(REPLICAS))
    def lose_replica(self, replica: str) -> None:
        self._apply(ROUTER, ev.ReplicaLost(replica, self.now))
        for hop_id in [h for h, (_, _, r) in self.active.items() if r == replica]:
            del self.active[hop_id]
            self.ended.add(hop_id)

    @rule(seconds=st.floats(0, 40))
    def time_passes(self, seconds: float) -> None:
        self.now += seconds
        # Time reaches the state only as event time: a limit change carries it.
        self._apply(CONTROL, ev.TenantLimitsSet("a", 10, 1000, 3, 1.0, False, self.now))

    @rule()
    def snapshot_round_trip(self) -> None:
        before = self.state.digests()["tenants"]
        self.state = RouterState.decode(self.state.encode(), CONFIG)
        assert self.state.digests()["tenants"] == before

    @invariant()
    def usage_matches_the_model(self) -> None:
        at = self.state.now
        for tenant in TENANTS:
            used = self.state.tenants.usage(tenant, at)
            mine = [c for c in self.charges.values() if c.tenant == tenant and c.ts > at - WINDOW]
            assert used.requests == len(mine)
            assert used.tokens == sum(c.tokens for c in mine)
            assert used.concurrent == len({b for b, t, _ in self.active.values() if t == tenant})
            # What the fair queue's newcomer lift reads: the oldest admission in the window, and
            # the tokens admitted in the window before a given moment.
            # Asked at the state's time and later (a replica's clock runs ahead of event time).
            book = self.state.tenants
            for later in (at, at + WINDOW / 3):
                seen = [c for c in mine if c.ts > later - WINDOW]
                assert book.first_admission(tenant, later) == min((c.ts for c in seen),
                                                                  default=None)
                for ts in {c.ts for c in self.charges.values()} | {later, at - WINDOW / 2}:
                    assert book.tokens_before(tenant, ts, later) == sum(
                        c.tokens for c in seen if c.ts < ts)
            # What the headroom reads (tenant_headroom.py): the newest admission in the window,
            # and who was admitted since a moment or has a request in flight.
            assert book.last_admission(tenant) == max((c.ts for c in mine), default=None)
            for since in {c.ts for c in self.charges.values()} | {at, at - WINDOW / 2}:
                admitted = any(c.ts >= since for c in mine)
                in_flight = any(t == tenant for _, t, _ in self.active.values())
                assert (tenant in book.recent(since)) == (admitted or in_flight)
        for hop_id in self.ended - set(self.active):
            assert self.state.tenants.tenant_of(hop_id) is None
        for hop_id, (_, tenant, _) in self.active.items():
            assert self.state.tenants.tenant_of(hop_id) == tenant


TenantMachine.TestCase.settings = settings(max_examples=400, stateful_step_count=40,
                                           deadline=None)
TestTenantModel = TenantMachine.TestCase
