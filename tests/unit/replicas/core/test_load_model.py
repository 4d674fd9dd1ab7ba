"""The in-flight load against a plain model: whatever sequence of routed, prefill completed,
output progress, finished and replica lost, each worker rank's prefill tokens, distinct decode
blocks, weighted output blocks and owners are those of the requests still active, and the digest
is that of the same requests added afresh and of the state restored from its snapshot.

The load columns (load_columns.py) are checked against the same model: each loaded rank's slot
holds its figures, a free slot zeros, each active block exactly the bits of the slots holding
it, the decaying ranks are those with a modeled prefill pending, and the grouped prefix search
answers every query — prefix chains and shuffled ones alike — as ``active_prefix_len`` does."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from replicas.core.index import WorkerKey
from replicas.core.load import MILLI, ActiveLoad, OutputTracking, output_block_milli

IDS = st.sampled_from([f"r{i}" for i in range(6)])
REPLICAS = st.sampled_from(["A", "B"])
RANKS: list[WorkerKey] = [("w0", 0), ("w0", 1), ("w1", 0)]
# A block's sequence hash stands for its whole prefix, so a request holds a prefix of a chain;
# chains that share their first blocks make requests share blocks (held once per rank).
CHAINS = [[0, 1, 2, 3, 4], [0, 1, 5, 6], [7, 8, 9]]
HASHES = st.builds(lambda chain, n: chain[:n], st.sampled_from(CHAINS), st.integers(0, 5))
# What the grouped prefix search is asked: the chains, none, and shuffled ones (membership not
# monotone along the query: the binary search's answers are compared, not the model's walk).
QUERIES = [*CHAINS, [], [1, 0, 2, 3, 4], [3, 4, 0, 1, 2], [9, 8, 7], [6, 5, 1, 0, 4, 3, 2],
           [0, 7, 1, 8, 5, 9, 6]]
TRACKING = st.one_of(st.none(), st.builds(OutputTracking, st.integers(0, 40), st.just(4),
                                          st.sampled_from([0, 10, 100])))


UNKNOWN = "(unspecified after a restore)"


@dataclass
class Request:
    replica: str
    worker: WorkerKey
    prefill: int
    hashes: list[int]
    ts: float
    output: OutputTracking | None
    done: bool = False
    generated: int = 0
    modeled: bool = False


class LoadMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.load = ActiveLoad()
        self.model: dict[str, Request] = {}
        # The release turns' hint: whose request last left each rank's prefill. Not in
        # snapshots: after a restore it is unspecified until the next prefill on that rank ends.
        self.freed_by: dict[WorkerKey, str | None] = {}

    @rule(request_id=IDS, replica=REPLICAS, worker=st.sampled_from(RANKS),
          prefill=st.one_of(st.just(0), st.integers(0, 500)), hashes=HASHES,
          ts=st.integers(0, 9).map(float), output=TRACKING, modeled=st.booleans())
    def add(self, request_id: str, replica: str, worker: WorkerKey, prefill: int,
            hashes: list[int], ts: float, output: OutputTracking | None, modeled: bool) -> None:
        added = self.load.add(request_id, replica, worker, prefill, hashes, ts, output=output,
                              modeled=modeled)
        assert added == (request_id not in self.model)
        if added:
            self.model[request_id] = Request(replica, worker, prefill, hashes, ts, output,
                                             modeled=modeled)

    @rule(request_id=IDS)
    def prefill_completed(self, request_id: str) -> None:
        req = self.model.get(request_id)
        assert self.load.prefill_completed(request_id) == (req is not None and not req.done)
        if req is not None:
            if not req.done:
                self.freed_by[req.worker] = req.replica
            req.done = True

    @rule(request_id=IDS, generated=st.integers(0, 60))
    def output_progress(self, request_id: str, generated: int) -> None:
        req = self.model.get(request_id)
        advances = (req is not None and req.output is not None and generated > req.generated)
        assert self.load.output_progress(request_id, generated) == advances
        if advances:
            req.generated = generated  # type: ignore[union-attr]

    @rule(request_id=IDS)
    def finish(self, request_id: str) -> None:
        req = self.model.pop(request_id, None)
        assert self.load.finish(request_id) == (req is not None)
        if req is not None and not req.done:
            self.freed_by[req.worker] = req.replica

    @rule(replica=REPLICAS)
    def replica_lost(self, replica: str) -> None:
        owned = sorted(r for r, req in self.model.items() if req.replica == replica)
        assert self.load.replica_lost(replica) == owned
        for request_id in owned:
            req = self.model.pop(request_id)
            if not req.done:
                self.freed_by[req.worker] = req.replica

    @rule()
    def restore_from_snapshot(self) -> None:
        restored = ActiveLoad.from_plain(self.load.to_plain())
        assert restored.digest == self.load.digest
        self.load = restored
        self.freed_by = {w: UNKNOWN for w in RANKS}

    @invariant()
    def freed_by_names_the_last_prefill_to_leave_each_rank(self) -> None:
        for worker in RANKS:
            if self.freed_by.get(worker) is not UNKNOWN:
                assert self.load.freed_by(worker) == self.freed_by.get(worker)

    @invariant()
    def per_rank_sums_match_the_active_requests(self) -> None:
        assert len(self.load) == len(self.model)
        assert self.load.workers() == {req.worker for req in self.model.values()}
        for worker in RANKS:
            mine = [req for req in self.model.values() if req.worker == worker]
            assert self.load.active_prefill_tokens(worker) == sum(
                req.prefill for req in mine if not req.done)
            # the requests whose prompt is still being computed (what the headroom counts)
            assert sorted(self.load.prefilling(worker)) == sorted(
                rid for rid, req in self.model.items()
                if req.worker == worker and not req.done and req.prefill > 0)
            held = {h for req in mine for h in req.hashes}
            milli = sum(output_block_milli(req.output, req.generated)
                        for req in mine if req.output is not None)
            assert self.load.active_decode_blocks(worker) == len(held) + milli / MILLI
            for query in [*CHAINS, []]:
                prefix = 0
                while prefix < len(query) and query[prefix] in held:
                    prefix += 1
                assert self.load.active_prefix_len(worker, query) == prefix
        for replica in ("A", "B"):
            assert self.load.owned(replica) == sum(
                req.replica == replica for req in self.model.values())

    @invariant()
    def load_columns_match_the_model(self) -> None:
        columns = self.load.columns
        self.load.prefix_groups([])  # keep the holders from here on (built now if not kept)
        slot_of = {key: slot for slot, key in enumerate(columns.keys) if key is not None}
        assert len(slot_of) == sum(key is not None for key in columns.keys)
        assert set(slot_of) == {req.worker for req in self.model.values()}
        holders: dict[int, int] = {}
        for worker, slot in slot_of.items():
            mine = [req for req in self.model.values() if req.worker == worker]
            held = {h for req in mine for h in req.hashes}
            assert columns.prefill[slot] == sum(req.prefill for req in mine if not req.done)
            assert columns.blocks[slot] == len(held)
            assert columns.milli[slot] == sum(output_block_milli(req.output, req.generated)
                                              for req in mine if req.output is not None)
            for h in held:
                holders[h] = holders.get(h, 0) | 1 << slot
        for slot, key in enumerate(columns.keys):
            if key is None:
                assert columns.prefill[slot] == columns.blocks[slot] == columns.milli[slot] == 0
        assert columns.holders == holders
        assert set(self.load.decaying_workers()) == {
            req.worker for req in self.model.values()
            if req.modeled and req.prefill > 0 and not req.done}
        for query in QUERIES:
            answered: dict[WorkerKey, int] = {}
            for mask, length in self.load.prefix_groups(query):
                assert length > 0
                for slot, key in enumerate(columns.keys):
                    if mask >> slot & 1:
                        assert key is not None and key not in answered
                        answered[key] = length
            assert answered == {w: n for w in RANKS
                                if (n := self.load.active_prefix_len(w, query))}

    @invariant()
    def digest_is_that_of_the_same_requests_added_afresh(self) -> None:
        fresh = ActiveLoad()
        for request_id, req in sorted(self.model.items(), reverse=True):
            fresh.add(request_id, req.replica, req.worker, req.prefill, req.hashes, req.ts,
                      output=req.output, modeled=req.modeled)
            if req.done:
                fresh.prefill_completed(request_id)
            if req.generated:
                fresh.output_progress(request_id, req.generated)
        assert fresh.digest == self.load.digest


LoadMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=30,
                                         deadline=None)
TestLoadModel = LoadMachine.TestCase
