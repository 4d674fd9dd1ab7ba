"""Engine KV-event payloads -> jetrouter events: real vLLM 0.32 frames (read from ../shared),
positional arrays in SGLang's and older vLLM's layouts, hash normalisation, LoRA salting, storage
tiers, malformed input, and the re-announce mirror."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import msgspec
import pytest

from eventlog.events import AllBlocksCleared, BlocksRemoved, BlocksStored, WorkerRegistered
from eventlog.hashing import adapter_salt, prompt_hashes, tokens_hashes
from replicas.core.state import RouterState, StateConfig
from workers.bridge.decode import (
    BadPayload,
    EngineCleared,
    EngineRemoved,
    EngineStored,
    decode_payload,
    normalise_hash,
)
from workers.bridge.translate import CacheMirror, Translator

# ../shared beside the repo root; JETROUTER_SHARED_DIR points elsewhere (e.g. from a git worktree).
SHARED = Path(os.environ.get("JETROUTER_SHARED_DIR")
              or Path(__file__).resolve().parents[2] / ".." / "shared") / "engines" / "vllm-0.32"
BS = 32


def _jsonl(name: str) -> list[dict]:  # type: ignore[type-arg]
    path = SHARED / name
    if not path.exists():
        pytest.skip(f"{path} not present (shared engine captures live beside the repo)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _state(worker: str = "w", block_size: int = BS) -> RouterState:
    state = RouterState(StateConfig(block_size=block_size))
    state.apply("kv", 1, [WorkerRegistered(worker, "http://e", "tiny", block_size, 256, 8192,
                                           0.0)])
    return state


def _payload(events: list, dp_rank: int | None = 0, ts: float = 1.0) -> bytes:  # type: ignore[type-arg]
    body: list = [ts, events] if dp_rank is None else [ts, events, dp_rank]  # type: ignore[type-arg]
    return msgspec.msgpack.encode(body)


# --- captured vLLM 0.32 frames ---------------------------------------------------------------


def test_every_captured_frame_decodes_to_what_vllm_sent() -> None:
    frames = _jsonl("frames.jsonl")
    decoded_rows = _jsonl("events-decoded.jsonl")
    by_raw = {json.dumps(row["raw"]): row for row in decoded_rows}
    assert len(frames) == 67
    for frame in frames:
        payload = bytes.fromhex(frame["payload_hex"])
        batch = decode_payload(payload)
        assert batch.malformed == 0
        row = by_raw[json.dumps(msgspec.msgpack.decode(payload))]  # the same batch, as JSON
        assert row["seq"] == frame["seq"]
        ts, raw_events, rank = row["raw"]
        assert batch.ts == ts and batch.dp_rank == rank
        assert [type(e).__name__.replace("Engine", "") for e in batch.events] == [
            {"BlockStored": "Stored", "BlockRemoved": "Removed",
             "AllBlocksCleared": "Cleared"}[r["type"]] for r in raw_events]
        for event, raw in zip(batch.events, raw_events, strict=True):
            assert event.block_hashes == raw["block_hashes"]  # type: ignore[union-attr]
            if isinstance(event, EngineStored):
                assert event.token_ids == raw["token_ids"]
                assert len(event.token_ids) == len(event.block_hashes) * BS
                assert event.parent_hash == raw["parent_block_hash"]
                assert event.medium == "GPU" and event.lora_name is None


def test_captured_stream_translates_and_every_removal_finds_its_block() -> None:
    """The whole captured run (seq 0..66, one engine start) applied to a router state: each
    BlockStored's tokens_hash values are xxh3 of its token_ids, and every BlockRemoved hits a
    block a store announced (hashes above 2**63 included)."""
    translator = Translator("w", BS)
    state = _state()
    for n, frame in enumerate(_jsonl("frames.jsonl"), start=2):
        batch = decode_payload(bytes.fromhex(frame["payload_hex"]))
        events = translator.translate(batch)
        for event, engine_event in zip(events, batch.events, strict=True):
            if isinstance(event, BlocksStored):
                assert [th for _, th in event.blocks] == tokens_hashes(
                    engine_event.token_ids, BS)  # type: ignore[union-attr]
                assert [h for h, _ in event.blocks] == engine_event.block_hashes
        state.apply("kv", n, events)
    counts = state.stats.counts
    assert counts[("kv", "BlocksStored", "ok")] == 36
    assert counts[("kv", "BlocksRemoved", "ok")] == 332
    assert {status for (_, _, status) in counts} == {"ok"}
    assert state.index.counters.get(("removed", "block_not_found"), 0) == 0
    assert translator.skipped == {}


def test_first_prompt_matches_the_blocks_vllm_stored_for_it() -> None:
    """prompt0's first 96 tokens are vLLM's first BlockStored (3 blocks of 32): the router's hash
    of the prompt matches all three blocks the bridge indexed from the engine's event."""
    first = _jsonl("events-decoded.jsonl")[0]["raw"]
    prompt = json.loads((SHARED / "prompt0_ids.json").read_text())
    assert prompt[:96] == first[1][0]["token_ids"]
    state = _state()
    state.apply("kv", 2, Translator("w", BS).translate(decode_payload(msgspec.msgpack.encode(
        first))))
    assert state.index.find_matches(prompt_hashes(prompt, BS)).scores == {("w", 0): 3}
    assert state.index.find_matches(prompt_hashes(prompt[1:], BS)).scores == {}


def test_a_repeated_store_of_the_last_block_changes_nothing() -> None:
    """vLLM re-emits BlockStored for the last block of a repeated prompt: a no-op for the index
    and its digest."""
    first = _jsonl("events-decoded.jsonl")[0]["raw"]
    translator = Translator("w", BS)
    state = _state()
    state.apply("kv", 2, translator.translate(decode_payload(msgspec.msgpack.encode(first))))
    digest = state.digests()["index"]
    ev0 = first[1][0]
    again = {**ev0, "block_hashes": ev0["block_hashes"][-1:], "token_ids": ev0["token_ids"][-BS:],
             "parent_block_hash": ev0["block_hashes"][-2]}
    state.apply("kv", 3, translator.translate(decode_payload(_payload([again]))))
    assert state.stats.counts[("kv", "BlocksStored", "ok")] == 2
    assert state.digests()["index"] == digest
    assert state.index.total_blocks == 3


# --- positional arrays (SGLang, older vLLM) --------------------------------------------------


def test_sglang_positional_events_with_signed_hashes() -> None:
    """SGLang: one block per event, signed int64 hashes, BlockRemoved = [tag, hashes]."""
    rng = random.Random(7)
    tokens = [rng.randrange(50_000) for _ in range(3 * 16)]
    signed = [-(2**63) + 5, -42, 2**62]
    events: list = []  # type: ignore[type-arg]
    parent = None
    for i, h in enumerate(signed):
        events.append(["BlockStored", [h], parent, tokens[i * 16:(i + 1) * 16], 16, None,
                       "GPU"])
        parent = h
    translator = Translator("s", 16)
    state = _state("s", 16)
    batch = decode_payload(_payload(events, dp_rank=0))
    assert batch.malformed == 0
    stored = translator.translate(batch)
    assert [b[0][0] for b in (e.blocks for e in stored)] == [normalise_hash(h) for h in signed]
    state.apply("kv", 2, stored)
    assert state.index.find_matches(prompt_hashes(tokens, 16)).scores == {("s", 0): 3}
    # Removal as SGLang sends it (signed) finds the blocks the store announced.
    state.apply("kv", 3, translator.translate(decode_payload(_payload(
        [["BlockRemoved", [signed[2]]], ["BlockRemoved", [signed[1]]]]))))
    assert state.index.find_matches(prompt_hashes(tokens, 16)).scores == {("s", 0): 1}
    assert state.index.total_blocks == 1
    state.apply("kv", 4, translator.translate(decode_payload(_payload([["AllBlocksCleared"]]))))
    assert state.index.total_blocks == 0


def test_old_vllm_positional_layout_and_two_field_envelope() -> None:
    """Older vLLM: [tag, hashes, parent, tokens, block_size, lora_id, medium, lora_name,
    extra_keys, ...] with trailing fields it may add; batch without a dp rank."""
    tokens = list(range(64))
    payload = _payload([
        ["BlockStored", [2**64 - 1, 2**63], None, tokens, 32, None, "GPU", None, None, 0,
         "full_attention", None],
        ["BlockRemoved", [2**63], "GPU"],
        ["AllBlocksCleared"],
    ], dp_rank=None)
    batch = decode_payload(payload)
    assert batch.dp_rank == 0 and batch.malformed == 0
    assert isinstance(batch.events[0], EngineStored)
    assert batch.events[0].block_hashes == [2**64 - 1, 2**63]
    assert isinstance(batch.events[1], EngineRemoved) and isinstance(batch.events[2],
                                                                     EngineCleared)


def test_digest_bytes_hashes_are_normalised() -> None:
    digest = bytes(range(32))
    assert normalise_hash(digest) == int.from_bytes(digest[-8:], "big")
    assert normalise_hash(-1) == 2**64 - 1
    with pytest.raises(TypeError):
        normalise_hash(True)


def test_malformed_events_are_counted_and_skipped() -> None:
    good = {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"}
    batch = decode_payload(_payload([
        42, ["Bogus", 1], {"type": "BlockStored", "block_hashes": "x"},
        {"type": "BlockStored", "block_hashes": [1], "token_ids": [-1] * 16, "block_size": 16},
        {"type": "NewKind", "x": 1}, good,
        {"type": "BlockStored", "block_hashes": [1], "token_ids": [1] * 16, "block_size": 16,
         "future_field": {"a": 1}},
    ]))
    assert batch.malformed == 5
    assert len(batch.events) == 2
    for bad in (b"\xc1garbage", msgspec.msgpack.encode({"a": 1}), msgspec.msgpack.encode([1]),
                msgspec.msgpack.encode(["ts", []]), msgspec.msgpack.encode([1.0, [], -1])):
        with pytest.raises(BadPayload):
            decode_payload(bad)


def test_block_size_and_token_count_mismatches_are_skipped_not_indexed() -> None:
    translator = Translator("w", 32)
    out = translator.translate(decode_payload(_payload([
        {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
         "token_ids": list(range(16)), "block_size": 16},
        {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None,
         "token_ids": list(range(32)), "block_size": 32},
    ])))
    assert out == []
    assert translator.skipped == {"block_size_mismatch": 1, "token_count_mismatch": 1}
    assert translator.next_event_id == 1  # nothing skipped consumed an event id


# --- LoRA and storage tiers ------------------------------------------------------------------


def _stored(tokens: list[int], hashes: list[int], **extra: object) -> dict:  # type: ignore[type-arg]
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
            "token_ids": tokens, "block_size": 16, "medium": "GPU", **extra}


def test_lora_blocks_never_match_another_adapter_or_the_base_model() -> None:
    tokens = list(range(1000, 1064))
    translator = Translator("w", 16)
    state = _state("w", 16)
    state.apply("kv", 2, translator.translate(decode_payload(_payload([
        _stored(tokens, [11, 12, 13, 14], lora_id=1, lora_name="sql-lora")]))))
    find = state.index.find_matches
    assert find(prompt_hashes(tokens, 16, adapter="sql-lora")).scores == {("w", 0): 4}
    assert find(prompt_hashes(tokens, 16)).scores == {}
    assert find(prompt_hashes(tokens, 16, adapter="other-lora")).scores == {}
    # An adapter known only by its numeric id (older vLLM, SGLang) never matches any request.
    state.apply("kv", 3, translator.translate(decode_payload(_payload([
        _stored(tokens, [21, 22, 23, 24], lora_id=7)]))))
    assert find(prompt_hashes(tokens, 16)).scores == {}
    assert state.index.total_blocks == 8
    # The base model's blocks match base requests only.
    state.apply("kv", 4, translator.translate(decode_payload(_payload([
        _stored(tokens, [31, 32, 33, 34])]))))
    assert find(prompt_hashes(tokens, 16)).scores == {("w", 0): 4}
    assert find(prompt_hashes(tokens, 16, adapter="sql-lora")).scores == {("w", 0): 4}
    assert adapter_salt(None) == adapter_salt("") == 0 and adapter_salt("a") != adapter_salt("b")


def test_extra_keys_make_blocks_unmatchable_by_tokens_alone() -> None:
    tokens = list(range(32))
    translator = Translator("w", 16)
    state = _state("w", 16)
    state.apply("kv", 2, translator.translate(decode_payload(_payload([
        _stored(tokens, [1, 2], extra_keys=[["mm-hash"], None])]))))
    assert state.index.find_matches(prompt_hashes(tokens, 16)).scores == {}


def test_offloaded_tiers_are_carried_but_only_device_blocks_count() -> None:
    tokens = list(range(32))
    translator = Translator("w", 16)
    state = _state("w", 16)
    events = translator.translate(decode_payload(_payload([
        _stored(tokens, [1, 2]), _stored(tokens, [1, 2], medium="cpu"),
        {"type": "BlockRemoved", "block_hashes": [1, 2], "medium": "CPU"},
    ])))
    assert [getattr(e, "medium", None) for e in events] == [None, "CPU", "CPU"]
    state.apply("kv", 2, events)
    # The CPU copy's removal does not touch the device blocks.
    assert state.index.find_matches(prompt_hashes(tokens, 16)).scores == {("w", 0): 2}
    assert state.stats.counts[("kv", "BlocksStored", "other_tier")] == 1
    assert state.stats.counts[("kv", "BlocksRemoved", "other_tier")] == 1


# --- the re-announce mirror ------------------------------------------------------------------


def test_mirror_reannounce_rebuilds_the_same_index() -> None:
    """Random stores/evictions through the translator into one state and the mirror; a fresh
    state fed only the mirror's re-announce has the same index digest. Evictions take leaves, as
    engines free a chain tail first (an orphan whose parent was evicted cannot be re-announced:
    a store needs its parent, and it could not match anyway)."""
    rng = random.Random(3)
    translator = Translator("w", 4)
    state = _state("w", 4)
    mirror = CacheMirror()
    parents: dict[int, dict[int, int | None]] = {0: {}, 1: {}}  # per rank: block -> parent
    next_hash = 1
    seq = 2
    for _ in range(300):
        rank = rng.randrange(2)
        cached = parents[rank]
        leaves = sorted(set(cached) - set(cached.values()))
        if leaves and rng.random() < 0.35:
            victims = rng.sample(leaves, min(len(leaves), rng.randrange(1, 3)))
            raw = [{"type": "BlockRemoved", "block_hashes": victims}]
            for v in victims:
                cached.pop(v)
        else:
            parent = rng.choice([None, *cached])
            n = rng.randrange(1, 4)
            hashes = list(range(next_hash, next_hash + n))
            next_hash += n
            raw = [{"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
                    "token_ids": [rng.randrange(100) for _ in range(4 * n)], "block_size": 4}]
            for h in hashes:
                cached[h] = parent
                parent = h
        events = translator.translate(decode_payload(_payload(raw, dp_rank=rank)))
        state.apply("kv", seq, events)
        mirror.apply(events)
        seq += 1
    announced = mirror.announce(translator, 9.0)
    assert isinstance(announced[0], AllBlocksCleared)
    assert not any(isinstance(e, BlocksRemoved) for e in announced)
    fresh = _state("w", 4)
    fresh.apply("kv", 2, announced)
    assert fresh.index.total_blocks == state.index.total_blocks > 0
    assert fresh.digests()["index"] == state.digests()["index"]
    # ... and applied on top of the old state (a re-announce after a gap) it changes nothing.
    state.apply("kv", seq, mirror.announce(translator, 10.0))
    assert state.digests()["index"] == fresh.digests()["index"]


def test_non_integer_token_ids_are_skipped_when_hashed() -> None:
    translator = Translator("w", 2)
    out = translator.translate(decode_payload(_payload([
        {"type": "BlockStored", "block_hashes": [1], "token_ids": [1.5, 2], "block_size": 2},
        {"type": "BlockStored", "block_hashes": [2], "token_ids": ["a", 2], "block_size": 2},
        {"type": "BlockStored", "block_hashes": [3], "token_ids": [1, 2], "block_size": 2},
    ])))
    assert [e.blocks[0][0] for e in out] == [3]  # type: ignore[union-attr]
    assert translator.skipped == {"malformed": 2}
