"""Columnar snapshot forms (index v2 of the reference form, load v2, state format 2): exact round
trips, the legacy v1 forms still read (by both index forms), malformed columns rejected, and a
captured encoder unaffected by later events."""

from __future__ import annotations

import random

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eventlog import events as ev
from eventlog.hashing import MASK64
from eventlog.names import ROUTER
from replicas.core import index as compact
from replicas.core.index_common import WorkerKey
from replicas.core.index_reference import PrefixIndex
from replicas.core.load import ActiveLoad
from replicas.core.state import RouterState, StateConfig


def internals(index: PrefixIndex) -> tuple[object, ...]:
    """Everything restore rebuilds, keyed by worker key (slot numbers may differ)."""
    per_worker = {w: (index._blocks[s], index._dups[s], index._kids[s], index._gaps[s],
                      index._sums[s] & MASK64) for w, s in index._slots.items()}
    nodes = {seq: frozenset(index._keys[i] for i in range(mask.bit_length()) if mask >> i & 1)
             for seq, mask in index._nodes.items()}
    expiry = {(index._keys[slot], seq): v for (slot, seq), v in index._expiry.items()}
    live_heap = sorted(e for e in index._heap
                       if expiry.get(((e[2], e[3]), e[4]), (None,))[0] == e[0])
    return per_worker, nodes, index.total_blocks, index.digest, expiry, live_heap, index.counters


def roundtrip(index: PrefixIndex) -> PrefixIndex:
    return PrefixIndex.from_plain(msgspec.msgpack.decode(msgspec.msgpack.encode(index.to_plain())))


def legacy_plain(index: PrefixIndex) -> dict[str, object]:
    """The v1 plain form (flat int lists), as replicas before the columnar format wrote it."""
    workers = []
    for worker, slot in sorted(index._slots.items()):
        flat: list[int] = []
        for block_hash, entry in index._blocks[slot].items():
            flat += [block_hash, entry & MASK64, (entry >> 64) - 1]
        workers.append([worker[0], worker[1], flat])
    per_slot: dict[int, list[float | int]] = {}
    for (slot, seq), (expires, depth) in index._expiry.items():
        per_slot.setdefault(slot, []).extend((seq, expires, depth))
    expiry = [[*index._keys[s], e] for s, e in sorted(per_slot.items(),  # type: ignore[misc]
                                                       key=lambda kv: index._keys[kv[0]])]
    return {"version": 1, "approximate": index.approximate, "ttl_secs": index.ttl_secs,
            "max_tree_size": index.max_tree_size, "prune_target_ratio": index.prune_target_ratio,
            "workers": workers, "expiry": expiry,
            "counters": [[t, s, n] for (t, s), n in sorted(index.counters.items())]}


def random_index(rng: random.Random, workers: int, ops: int) -> PrefixIndex:
    """Chains sharing prefixes, extensions, re-stores under new ids (dups), mid-chain removals
    (gaps), clears; ``workers`` keys over two dp ranks."""
    index = PrefixIndex()
    keys: list[WorkerKey] = [(f"w{i}", i % 2) for i in range(workers)]
    held: dict[WorkerKey, list[int]] = {k: [] for k in keys}
    prompts = [[rng.randrange(1, 40) for _ in range(4)] for _ in range(3)]
    for _ in range(ops):
        key = rng.choice(keys)
        roll = rng.random()
        if roll < 0.45 or not held[key]:
            tokens = rng.choice(prompts)[: rng.randint(1, 4)] + [
                rng.randrange(1, 40) for _ in range(rng.randint(0, 5))]
            ids = [rng.getrandbits(64) for _ in tokens]
            index.store(key, None, list(zip(ids, tokens, strict=True)))
            held[key] += ids
        elif roll < 0.7:
            parent = rng.choice(held[key])
            ids = [rng.getrandbits(64) for _ in range(rng.randint(1, 3))]
            if index.store(key, parent, [(i, rng.randrange(1, 40)) for i in ids]) == "ok":
                held[key] += ids
        elif roll < 0.95:
            gone = rng.sample(held[key], min(len(held[key]), rng.randint(1, 3)))
            index.remove(key, gone)
            held[key] = [b for b in held[key] if b not in gone]
        else:
            index.clear(key)
            held[key] = []
    return index


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32), st.sampled_from([1, 3, 70]), st.integers(1, 120))
def test_columnar_round_trip_rebuilds_identical_internals(seed: int, workers: int,
                                                          ops: int) -> None:
    index = random_index(random.Random(seed), workers, ops)
    restored = roundtrip(index)
    assert internals(restored) == internals(index)
    assert restored.to_plain() == index.to_plain()


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32))
def test_legacy_v1_plain_still_restores_identically(seed: int) -> None:
    index = random_index(random.Random(seed), 5, 80)
    plain = msgspec.msgpack.decode(msgspec.msgpack.encode(legacy_plain(index)))
    assert internals(PrefixIndex.from_plain(plain)) == internals(index)
    # the compact form (which the router runs) restores v1 and v2 with the same answers
    for form in (plain, msgspec.msgpack.decode(msgspec.msgpack.encode(index.to_plain()))):
        restored = compact.PrefixIndex.from_plain(form)
        assert (restored.digest, restored.total_blocks, restored.node_count) == (
            index.digest, index.total_blocks, index.node_count)
        assert restored._tree_sizes() == index._tree_sizes()
        for slot in index._slots.values():
            for entry in index._blocks[slot].values():
                query = [entry & MASK64]
                assert restored.find_matches(query) == index.find_matches(query)


def test_more_than_64_workers_sharing_a_prefix() -> None:
    index = PrefixIndex()
    for i in range(130):  # slots past 63 and 127: masks wider than one uint64
        index.store((f"w{i:03d}", 0), None, [(1000 + i, 7), (2000 + i, 8), (3000 + i, 9 + i)])
    restored = roundtrip(index)
    assert internals(restored) == internals(index)
    assert restored.find_matches([7]).scores == index.find_matches([7]).scores
    assert len(restored.find_matches([7]).scores) == 130


def test_approximate_mode_expiry_round_trips() -> None:
    index = PrefixIndex(approximate=True, ttl_secs=10.0)
    rng = random.Random(3)
    for t in range(40):
        seqs = [rng.randrange(1, 30) for _ in range(rng.randint(1, 4))]
        index.store_routed((f"w{t % 3}", 0), seqs, float(t))
    restored = roundtrip(index)
    assert internals(restored) == internals(index)
    assert restored.expire(45.0) == index.expire(45.0)
    assert internals(restored) == internals(index)


def test_extreme_hash_values_survive() -> None:
    """A parent sequence hash of 2**64 - 1 does not fit ``parent + 1`` in a uint64 column."""
    top = MASK64
    plain = {"version": 1, "approximate": False, "ttl_secs": 1.0, "max_tree_size": 10,
             "prune_target_ratio": 0.5, "expiry": [], "counters": [],
             "workers": [["w", 0, [top, top, -1, 5, 0, top, 6, 1, 0, 7, top, top]]]}
    index = PrefixIndex.from_plain(plain)
    assert index._blocks[0] == {top: top, 5: 0 | (top + 1) << 64, 6: 1 | 1 << 64,
                                7: top | (top + 1) << 64}
    assert internals(roundtrip(index)) == internals(index)


@pytest.mark.parametrize("damage", ["short_seqs", "chained_first", "bad_kind", "explicit_count"])
def test_malformed_columns_are_rejected(damage: str) -> None:
    index = PrefixIndex()
    index.store(("w", 0), None, [(1, 2), (3, 4), (5, 6)])
    index.store(("w", 0), 1, [(7, 8)])
    plain = index.to_plain()
    row = plain["workers"][0]  # type: ignore[index]
    n, ids, seqs, kinds, explicit = row[2:]
    if damage == "short_seqs":
        seqs = seqs[:-8]
    elif damage == "chained_first":
        kinds = b"\x01" + kinds[1:]
    elif damage == "bad_kind":
        kinds = kinds[:-1] + b"\x07"
    else:
        explicit = explicit + b"\x00" * 8
    row[2:] = [n, ids, seqs, kinds, explicit]
    with pytest.raises(ValueError):
        PrefixIndex.from_plain(plain)


def build_load() -> ActiveLoad:
    load = ActiveLoad()
    rng = random.Random(5)
    for i in range(30):
        hashes = [rng.getrandbits(64) for _ in range(rng.randint(0, 6))] + [1, 2]
        load.add(f"r{i}", f"rep{i % 3}", (f"w{i % 4}", 0), rng.randint(0, 500), hashes, 1.0 + i)
        if i % 3 == 0:
            load.prefill_completed(f"r{i}")
    return load


@pytest.mark.parametrize("form", ["v2", "v1"])
def test_load_v2_and_legacy_v1_restore_the_same_load(form: str) -> None:
    load = build_load()
    if form == "v2":
        plain = load.to_plain()
    else:  # hashes as int lists, as replicas before the columnar format wrote them
        plain = {"v": 1, "requests": [
            [r.request_id, r.replica_id, r.worker[0], r.worker[1], r.prefill_tokens,
             list(r.block_seq_hashes), r.ts, r.prefill_done]
            for r in sorted(load._requests.values(), key=lambda r: r.request_id)]}
    back = ActiveLoad.from_plain(msgspec.msgpack.decode(msgspec.msgpack.encode(plain)))
    assert back.digest == load.digest
    assert back.to_plain() == load.to_plain()
    assert back.workers() == load.workers()
    for w in load.workers():
        assert back._workers[w].blocks == load._workers[w].blocks
        assert back.active_prefill_tokens(w) == load.active_prefill_tokens(w)
    assert back.replica_lost("rep1") == load.replica_lost("rep1")
    assert back.finish("r0") == load.finish("r0")
    assert back.digest == load.digest
    assert back.to_plain() == load.to_plain()


def test_captured_encoder_ignores_later_events() -> None:
    state = RouterState(StateConfig(request_max_age=1e9))
    kv = [ev.WorkerRegistered("w0", "http://x", "m", 16, 100, 64, 1.0),
          ev.BlocksStored("w0", 1, 0, None, [(11, 1), (12, 2)], 1.0)]
    state.apply("kv", 1, kv)
    state.apply(ROUTER, 1, [ev.RequestRouted("r1", "ra", "w0", 0, 32, [1, 2], 0, 8, 0, 1.0)])
    expected = state.encode()
    encode = state.encoder()
    state.apply("kv", 2, [ev.BlocksStored("w0", 2, 0, 12, [(13, 3)], 2.0),
                          ev.BlocksRemoved("w0", 3, 0, [11], 2.0)])
    state.apply(ROUTER, 2, [ev.RequestFinished("r1", "ok", 3, 2.0)])
    assert encode() == expected
    copy = RouterState.decode(expected, state.config)
    assert copy.positions == {"kv": 1, "router": 1, "control": 0}


def test_state_format_1_snapshots_still_decode() -> None:
    state = RouterState()
    state.apply("kv", 1, [ev.BlocksStored("w0", 1, 0, None, [(11, 1), (12, 2)], 1.0)])
    reference = PrefixIndex()  # the form that wrote format 1 snapshots
    reference.store(("w0", 0), None, [(11, 1), (12, 2)])
    doc = msgspec.msgpack.decode(state.encode())
    doc["format"] = 1
    doc["index"] = legacy_plain(reference)
    copy = RouterState.decode(msgspec.msgpack.encode(doc), state.config)
    assert copy.digests() == state.digests()
