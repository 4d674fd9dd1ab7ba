"""Candidate building on a real RouterState: one row per serving rank, overlap from the index,
load from the state plus the optimistic overlay, health weights, model/LoRA filtering, and
refused or excluded workers left out."""

from __future__ import annotations

import pytest

from eventlog import events as ev
from eventlog.hashing import prompt_hashes, tokens_hashes
from eventlog.names import CONTROL, KV, ROUTER
from replicas.core.candidates import (
    adapter_of,
    build_candidates,
    check_routable,
    request_hashes,
    served_models,
)
from replicas.core.overlay import Overlay, PendingDecision
from replicas.core.routing_errors import NoWorkers, UnknownModel
from replicas.core.state import RouterState

BS = 16
TOKENS = list(range(300, 300 + 3 * BS))


def _state() -> RouterState:
    s = RouterState()
    s.apply(KV, 1, [
        ev.WorkerRegistered("a", "http://a", "m", BS, 1000, 8192, 1.0, dp_size=2),
        ev.WorkerRegistered("b", "http://b", "m", BS, 500, 4096, 1.0, loras=["sql"]),
        ev.WorkerRegistered("c", "http://c", "other", BS, 1000, 8192, 1.0),
    ])
    pairs = [(1000 + i, h) for i, h in enumerate(tokens_hashes(TOKENS, BS))]
    s.apply(KV, 2, [ev.BlocksStored("a", 1, 1, None, pairs[:2], 2.0)])  # rank 1 holds 2 blocks
    return s


def test_one_row_per_rank_of_each_worker_serving_the_model() -> None:
    s = _state()
    hashes = prompt_hashes(TOKENS, BS)
    rows = {c.worker: c for c in build_candidates(s, "m", hashes)}
    assert set(rows) == {("a", 0), ("a", 1), ("b", 0)}
    assert rows[("a", 1)].overlap_blocks == 2 and rows[("a", 0)].overlap_blocks == 0
    assert rows[("b", 0)].kv_total_blocks == 500 and rows[("b", 0)].max_num_batched_tokens == 4096
    assert all(c.new_request_blocks == 3 and c.weight == 1.0 for c in rows.values())


def test_load_is_the_state_plus_the_overlay() -> None:
    s = _state()
    hashes = prompt_hashes(TOKENS, BS)
    s.apply(ROUTER, 1, [ev.RequestRouted("q", "r", "b", 0, 48, hashes, 0, 8, 0, 3.0)])
    overlay = Overlay()
    overlay.add("p", PendingDecision(("b", 0), prefill_tokens=10, new_blocks=2))
    (row,) = [c for c in build_candidates(s, "m", hashes, overlay=overlay) if c.worker[0] == "b"]
    assert row.active_prefill_tokens == 48 + 10
    assert row.active_decode_blocks == 3 + 2
    assert row.new_request_blocks == 0  # the running request shares every block of the prompt


def test_health_weights_and_exclusions() -> None:
    s = _state()
    s.apply(CONTROL, 1, [ev.WorkerHealthChanged("a", "suspicious", "slow", 3.0),
                         ev.WorkerHealthChanged("b", "unhealthy", "canary", 3.0)])
    rows = build_candidates(s, "m", ())
    assert {c.worker: c.weight for c in rows} == {("a", 0): 0.5, ("a", 1): 0.5}
    assert build_candidates(s, "m", (), exclude=frozenset({"a"})) == []


def test_lora_requests_go_only_to_workers_serving_the_adapter_under_its_salt() -> None:
    s = _state()
    assert served_models(s) == ["m", "other", "sql"]
    assert adapter_of(s, "sql") == "sql" and adapter_of(s, "m") is None
    assert request_hashes(s, "sql", TOKENS, BS) == prompt_hashes(TOKENS, BS, adapter="sql")
    assert request_hashes(s, "m", TOKENS, BS) == prompt_hashes(TOKENS, BS)
    assert [c.worker for c in build_candidates(s, "sql", ())] == [("b", 0)]


def test_routable_checks_name_the_reason() -> None:
    s = RouterState()
    with pytest.raises(NoWorkers, match="no inference workers are registered yet"):
        check_routable(s, "m")
    s.apply(KV, 1, [ev.WorkerRegistered("bad", "http://x", "m", BS * 2, 1000, 8192, 1.0)])
    with pytest.raises(NoWorkers, match="bad refused"):
        check_routable(s, "m")
    assert build_candidates(s, "m", ()) == []  # a refused worker is never a candidate
    s = _state()
    with pytest.raises(UnknownModel, match="Available: m, other, sql"):
        check_routable(s, "nope")
    check_routable(s, "sql")
