"""Disaggregated serving in the pure core: the prefill decision is KV-aware with active-block
tracking off, the decode decision is load-aware and counts overlap only with KV reuse, and the
state charges each phase's engine with its own part of the load."""

from __future__ import annotations

import random

import msgspec

from eventlog import events as ev
from eventlog.hashing import prompt_hashes
from eventlog.names import KV, ROUTER
from replicas.core import disagg
from replicas.core.selection import Candidate, Decision, RoutingConfig, Selector
from replicas.core.state import RouterState, StateConfig
from tests.unit.compat.earlier_worker_registered import BareWorkerRegistered

BS = 16


def cand(worker: str, *, overlap: int = 0, prefill: int = 0, decode: int = 0,
         new: int = 8) -> Candidate:
    return Candidate(worker=(worker, 0), overlap_blocks=overlap, tree_size=overlap,
                     active_prefill_tokens=prefill, active_decode_blocks=decode,
                     new_request_blocks=new, kv_total_blocks=1000,
                     max_num_batched_tokens=8192)


def pick(cands: list[Candidate], isl: int = 8 * BS) -> str:
    result = Selector(RoutingConfig.dynamo(block_size=BS)).select(cands, isl, random.Random(0))
    assert isinstance(result, Decision)
    return result.worker[0]


def test_prefill_decision_is_kv_aware_and_ignores_decode_load() -> None:
    # p0 holds 6 of the 8 prompt blocks but carries much decode load; p1 holds nothing.
    raw = [cand("p0", overlap=6, decode=40), cand("p1", decode=0)]
    assert pick(raw) == "p1"  # an aggregated decision weighs the decode load
    assert pick([disagg.prefill_candidate(c) for c in raw]) == "p0"
    # Queued prefill still counts: a cache hit does not beat a long prefill queue.
    busy = [cand("p0", overlap=6, prefill=4000), cand("p1")]
    assert pick([disagg.prefill_candidate(c) for c in busy]) == "p1"


def test_decode_decision_is_load_aware() -> None:
    # d0 holds the whole prompt but is loaded; d1 is idle: load wins either way.
    raw = [cand("d0", overlap=8, decode=50, new=0), cand("d1", decode=2)]
    for reuse in (True, False):
        assert pick([disagg.decode_candidate(c, 8, reuse) for c in raw]) == "d1"


def test_decode_overlap_counts_only_with_kv_reuse() -> None:
    # Equal load: with reuse the engine already holding the blocks needs no transfer; without
    # reuse the transfer is the same everywhere and d1's lighter load decides.
    raw = [cand("d0", overlap=8, decode=5, new=0), cand("d1", decode=4)]
    assert pick([disagg.decode_candidate(c, 8, True) for c in raw]) == "d0"
    assert pick([disagg.decode_candidate(c, 8, False) for c in raw]) == "d1"
    no_reuse = disagg.decode_candidate(raw[0], 8, False)
    assert (no_reuse.overlap_blocks, no_reuse.new_request_blocks) == (0, 8)


def test_roles() -> None:
    assert disagg.serves("prefill", "prefill") and not disagg.serves("prefill", "decode")
    assert not disagg.serves("prefill", "") and disagg.serves("decode", "")
    assert all(disagg.serves("both", p) for p in disagg.PHASES)
    assert disagg.is_disaggregated(["decode", "prefill"])
    assert not disagg.is_disaggregated(["both", "decode"])


def _registered(worker: str, role: str) -> ev.WorkerRegistered:
    return ev.WorkerRegistered(worker, f"http://{worker}", "m", BS, 1000, 8192, 1.0,
                               role=role)  # type: ignore[arg-type]


def _routed(rid: str, worker: str, phase: str, hashes: list[int], *, overlap: int = 0,
            reuse: bool = True) -> ev.RequestRouted:
    return ev.RequestRouted(rid, "r1", worker, 0, len(hashes) * BS, hashes, overlap, 16, 0,
                            2.0, model="m", block_size=BS, phase=phase,  # type: ignore[arg-type]
                            kv_reuse=reuse)


def test_state_charges_each_phase_its_own_load() -> None:
    state = RouterState(StateConfig(block_size=BS))
    state.apply(KV, 1, [_registered("p0", "prefill"), _registered("d0", "decode")])
    assert state.workers["p0"].role == "prefill"
    hashes = prompt_hashes(list(range(8 * BS)), BS)
    state.apply(ROUTER, 1, [_routed("a~prefill", "p0", "prefill", list(hashes), overlap=2)])
    state.apply(ROUTER, 2, [_routed("a", "d0", "decode", list(hashes))])
    load = state.load
    assert load.active_prefill_tokens(("p0", 0)) == 6 * BS
    assert load.active_decode_blocks(("p0", 0)) == 0  # active-block tracking off
    assert load.active_prefill_tokens(("d0", 0)) == 0  # the prompt arrives by transfer
    assert load.active_decode_blocks(("d0", 0)) == 8
    # With KV reuse, a second request with the same prompt shares the decode blocks...
    state.apply(ROUTER, 3, [_routed("b", "d0", "decode", list(hashes))])
    assert load.active_decode_blocks(("d0", 0)) == 8
    # ...without it, its blocks are its own (the same on every replica: derived from the id).
    state.apply(ROUTER, 4, [_routed("c", "d0", "decode", list(hashes), reuse=False)])
    assert load.active_decode_blocks(("d0", 0)) == 16
    assert disagg.unique_block_hashes("c", 3) == disagg.unique_block_hashes("c", 3)
    state.apply(ROUTER, 5, [ev.RequestFinished(r, "ok", 1, 3.0)
                            for r in ("a~prefill", "a", "b", "c")])
    assert load.active_prefill_tokens(("p0", 0)) == 0
    assert load.active_decode_blocks(("d0", 0)) == 0


def test_old_events_decode_as_aggregated_both() -> None:
    raw = msgspec.msgpack.encode([BareWorkerRegistered("w", "http://w", "m", BS, 10, 10, 1.0)])
    (event,) = ev.decode_batch(raw)
    assert isinstance(event, ev.WorkerRegistered) and event.role == "both"
    state = RouterState(StateConfig(block_size=BS))
    before = state.digests()["config"]
    state.apply(KV, 1, [event])
    copy = RouterState.decode(state.encode(), state.config)
    assert copy.workers["w"].role == "both" and copy.digests() == state.digests()
    assert before != state.digests()["config"]
