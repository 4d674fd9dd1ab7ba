"""The session table against a plain model: pins set, refreshed, moved, released and lapsed in
event time, whatever the order of operations; its digest equals that of a table rebuilt from
its snapshot."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from replicas.core.index import WorkerKey
from replicas.core.sessions import SessionTable

SESSIONS = st.sampled_from(["s0", "s1", "s2", "s3"])
RANKS: list[WorkerKey] = [("w0", 0), ("w0", 1), ("w1", 0)]
TIMES = st.integers(0, 40).map(float)
TTLS = st.sampled_from([1.0, 5.0, 30.0])


class SessionMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.table = SessionTable()
        # session -> (worker, model, ttl, last_ts)
        self.model: dict[str, tuple[WorkerKey, str, float, float]] = {}

    @rule(session=SESSIONS, worker=st.sampled_from(RANKS), model=st.sampled_from(["m", "n"]),
          ttl=TTLS, ts=TIMES)
    def pin(self, session: str, worker: WorkerKey, model: str, ttl: float, ts: float) -> None:
        old = self.model.get(session)
        status = self.table.pin(session, worker, model, ttl, ts)
        if old is None:
            assert status == "ok"
            last = ts
        else:
            assert status == ("refreshed" if old[0] == worker else "moved")
            last = max(old[3], ts)  # an older stamp never shortens the window
        self.model[session] = (worker, model, ttl, last)

    @rule(session=SESSIONS)
    def release(self, session: str) -> None:
        assert self.table.release(session) == (self.model.pop(session, None) is not None)

    @rule(now=TIMES)
    def expire(self, now: float) -> None:
        lapsed = sorted(s for s, (_, _, ttl, last) in self.model.items() if last + ttl < now)
        assert sorted(self.table.expire(now)) == lapsed
        for session in lapsed:
            del self.model[session]

    @rule()
    def restore_from_snapshot(self) -> None:
        restored = SessionTable.from_plain(self.table.to_plain())
        assert restored.digest == self.table.digest
        self.table = restored

    @invariant()
    def pins_match_the_model(self) -> None:
        assert len(self.table) == len(self.model)
        for session, (worker, model, ttl, last) in self.model.items():
            pin = self.table.get(session)
            assert pin is not None
            assert (pin.worker, pin.model, pin.ttl, pin.last_ts) == (worker, model, ttl, last)

    @invariant()
    def digest_is_that_of_the_same_pins_made_afresh(self) -> None:
        fresh = SessionTable()
        for session, (worker, model, ttl, last) in sorted(self.model.items()):
            fresh.pin(session, worker, model, ttl, last)
        assert fresh.digest == self.table.digest


SessionMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=30,
                                            deadline=None)
TestSessionModel = SessionMachine.TestCase
