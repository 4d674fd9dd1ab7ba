"""The router side of LoRA isolation: a request naming an adapter goes only to workers that
registered it and matches only blocks cached under it; a base-model request never matches them."""

from __future__ import annotations

import msgspec
import pytest

from eventlog.events import WorkerRegistered
from replicas.core.selection import Decision
from replicas.core.shedding import model_units
from replicas.core.state import StateConfig
from replicas.runtime.replica import Replica, ReplicaConfig, RouteRequest, UnknownModel
from workers.bridge.decode import decode_payload
from workers.bridge.translate import Translator

BS = 16
TOKENS = list(range(500, 500 + 4 * BS))


def _stored(worker: str, hashes: list[int], lora: str | None) -> list:  # type: ignore[type-arg]
    payload = msgspec.msgpack.encode([1.0, [{
        "type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
        "token_ids": TOKENS, "block_size": BS, "lora_id": 1 if lora else None,
        "lora_name": lora, "medium": "GPU"}], 0])
    return Translator(worker, BS).translate(decode_payload(payload))  # type: ignore[return-value]


@pytest.fixture
def replica() -> Replica:
    r = Replica(ReplicaConfig("r1", "", state=StateConfig(block_size=BS), seed=1))
    r.state.apply("kv", 1, [
        WorkerRegistered("with-lora", "http://a", "tiny", BS, 1000, 8192, 1.0,
                         loras=["sql-lora"]),
        WorkerRegistered("base-only", "http://b", "tiny", BS, 1000, 8192, 1.0),
    ])
    # The same tokens: under the adapter on one worker, under the base model on the other.
    r.state.apply("kv", 2, _stored("with-lora", [1, 2, 3, 4], "sql-lora"))
    r.state.apply("kv", 3, _stored("base-only", [5, 6, 7, 8], None))
    return r


def _decide(replica: Replica, model: str) -> Decision:
    decision, _, _ = replica.dispatcher.decide(RouteRequest("q", model, TOKENS))
    assert isinstance(decision, Decision)
    return decision


def test_adapter_request_goes_to_the_adapter_worker_and_matches_its_blocks(
        replica: Replica) -> None:
    assert replica.models() == ["sql-lora", "tiny"]
    decision = _decide(replica, "sql-lora")
    assert decision.worker == ("with-lora", 0) and decision.overlap_blocks == 4
    assert {c.worker for c in decision.costs} == {("with-lora", 0)}


def test_base_request_never_matches_adapter_blocks(replica: Replica) -> None:
    decision = _decide(replica, "tiny")
    overlaps = {c.worker: c.overlap_blocks for c in decision.costs}
    assert overlaps == {("with-lora", 0): 0, ("base-only", 0): 4}
    assert decision.worker == ("base-only", 0)


def test_unknown_adapter_is_an_unknown_model(replica: Replica) -> None:
    with pytest.raises(UnknownModel):
        replica.dispatcher.decide(RouteRequest("q", "other-lora", TOKENS))


def test_adapter_requests_are_shed_on_the_engines_that_serve_them(replica: Replica) -> None:
    assert len(model_units(replica.state, "sql-lora")) == 1
    assert len(model_units(replica.state, "tiny")) == 2
