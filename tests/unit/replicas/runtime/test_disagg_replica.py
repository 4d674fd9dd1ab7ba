"""A replica's two decisions for a model with prefill engines: each phase sees only its engines,
the decisions carry their phase, and --no-router-assume-kv-reuse reaches the decode decision.
(The replica is built without NATS: its state is fed the events directly.)"""

from __future__ import annotations

import pytest

from eventlog import events as ev
from eventlog.hashing import tokens_hashes
from eventlog.names import KV
from replicas.runtime.replica import AllWorkersBusy, Replica, ReplicaConfig, RouteRequest

BS = 16
PROMPT = list(range(8 * BS))


def replica(*, reuse: bool = True) -> Replica:
    r = Replica(ReplicaConfig(replica_id="r0", nats_url="", durable=False, seed=1,
                              assume_kv_reuse=reuse))
    regs = [ev.WorkerRegistered(w, f"http://{w}", "m", BS, 1000, 8192, 1.0, role=role)
            for w, role in (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode"),
                            ("d1", "decode"))]
    # d1 holds the whole prompt (as if it had received it before); p1 holds half of it.
    hashes = tokens_hashes(PROMPT, BS)
    stored = [ev.BlocksStored("d1", 1, 0, None, [(i + 1, h) for i, h in enumerate(hashes)], 2.0),
              ev.BlocksStored("p1", 1, 0, None,
                              [(i + 1, h) for i, h in enumerate(hashes[:4])], 2.0)]
    r.state.apply(KV, 1, regs + stored)
    return r


def route(r: Replica, phase: str, rid: str = "a") -> ev.RequestRouted:
    return r.dispatcher._prepare(RouteRequest(request_id=rid, model="m", token_ids=PROMPT,
                                              phase=ev.Phase(phase))).event


def test_each_phase_sees_only_its_engines() -> None:
    r = replica()
    assert r.is_disaggregated("m")
    pre = route(r, "prefill", "a~prefill")
    assert pre.phase == "prefill" and pre.worker_id == "p1" and pre.overlap_blocks == 4
    assert {c[0] for c in pre.candidates} == {"p0", "p1"}
    dec = route(r, "decode")
    assert dec.phase == "decode" and dec.kv_reuse and dec.worker_id == "d1"
    assert {c[0] for c in dec.candidates} == {"d0", "d1"}
    # Aggregated requests of a disaggregated model (fallback) never go to a prefill engine.
    agg = route(r, "", "b")
    assert agg.phase == "" and agg.worker_id in {"d0", "d1"}
    assert {c[0] for c in agg.candidates} == {"d0", "d1"}


def test_without_kv_reuse_the_decode_decision_counts_no_overlap() -> None:
    dec = route(replica(reuse=False), "decode")
    assert not dec.kv_reuse and dec.overlap_blocks == 0
    assert all(c[2] == 0 for c in dec.candidates)


def test_no_prefill_engine_left_is_a_routing_error() -> None:
    r = replica()
    r.state.apply(KV, 2, [ev.WorkerRetired("p0", "gone", 3.0), ev.WorkerRetired("p1", "gone", 3.0)])
    # Still served disaggregated (its decode engines are there): the prefill decision finds no
    # engine, and the request falls back to aggregated serving, counted as such.
    assert r.is_disaggregated("m")
    with pytest.raises(AllWorkersBusy):
        route(r, "prefill")
