"""ActiveLoad: in-flight prefill tokens, refcounted decode blocks, ownership, digest."""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from replicas.core.load import ActiveLoad

W1 = ("w1", 0)
W1R1 = ("w1", 1)
W2 = ("w2", 0)


def test_prefill_tokens_count_until_prefill_completed() -> None:
    load = ActiveLoad()
    assert load.add("r1", "rep", W1, 100, [1, 2], ts=10.0)
    assert load.add("r2", "rep", W1, 50, [7], ts=11.0)
    assert load.active_prefill_tokens(W1) == 150
    assert load.prefill_completed("r1")
    assert load.active_prefill_tokens(W1) == 50
    assert not load.prefill_completed("r1")  # only once
    assert not load.prefill_completed("nope")
    # decode blocks are still held until the request finishes
    assert load.active_decode_blocks(W1) == 3
    assert load.finish("r1")
    assert load.active_prefill_tokens(W1) == 50  # finishing a completed prefill frees nothing more
    assert load.active_decode_blocks(W1) == 1


def test_add_twice_is_refused_and_changes_nothing() -> None:
    load = ActiveLoad()
    assert load.add("r1", "rep", W1, 10, [1], ts=1.0)
    digest = load.digest
    assert not load.add("r1", "other", W2, 99, [5, 6], ts=2.0)
    assert load.digest == digest
    assert load.active_prefill_tokens(W2) == 0
    assert load.owner("r1") == "rep"
    assert len(load) == 1


def test_shared_blocks_on_one_worker_count_once() -> None:
    load = ActiveLoad()
    load.add("a", "rep", W1, 0, [1, 2, 3], ts=0.0)
    load.add("b", "rep", W1, 0, [1, 2, 4, 5], ts=0.0)
    assert load.active_decode_blocks(W1) == 5  # {1,2,3,4,5}
    # another rank / worker keeps its own count
    load.add("c", "rep", W1R1, 0, [1, 2], ts=0.0)
    assert load.active_decode_blocks(W1R1) == 2
    assert load.active_decode_blocks(W1) == 5
    load.finish("a")
    assert load.active_decode_blocks(W1) == 4  # 1 and 2 still held by b
    load.finish("b")
    assert load.active_decode_blocks(W1) == 0
    assert load.workers() == {W1R1}


def test_finish_unknown_is_false() -> None:
    load = ActiveLoad()
    assert not load.finish("ghost")


def test_replica_lost_frees_exactly_that_replicas_requests() -> None:
    load = ActiveLoad()
    load.add("a1", "A", W1, 10, [1, 2], ts=0.0)
    load.add("a2", "A", W2, 20, [9], ts=0.0)
    load.add("b1", "B", W1, 30, [1, 3], ts=0.0)
    freed = load.replica_lost("A")
    assert freed == ["a1", "a2"]
    assert load.owner("a1") is None and load.owner("a2") is None
    assert load.owner("b1") == "B"
    assert load.active_prefill_tokens(W1) == 30
    assert load.active_decode_blocks(W1) == 2
    assert load.active_prefill_tokens(W2) == 0
    assert load.replica_lost("A") == []


def test_active_prefix_len_examples() -> None:
    load = ActiveLoad()
    load.add("a", "rep", W1, 0, [1, 2, 3, 4], ts=0.0)
    assert load.active_prefix_len(W1, [1, 2, 3, 4, 5, 6]) == 4
    assert load.active_prefix_len(W1, [1, 2]) == 2
    assert load.active_prefix_len(W1, [9, 10, 11]) == 0  # another prefix chain
    assert load.active_prefix_len(W1, []) == 0
    assert load.active_prefix_len(W2, [1, 2]) == 0


def test_to_plain_round_trip_keeps_digest_and_load() -> None:
    load = ActiveLoad()
    load.add("a", "A", W1, 100, [1, 2, 3], ts=1.5)
    load.add("b", "B", W1R1, 7, [1, 2**64 - 1], ts=2.5)
    load.add("c", "A", W2, 3, [], ts=3.5)
    load.prefill_completed("b")
    plain = load.to_plain()
    # survives the snapshot codec
    plain = msgspec.msgpack.decode(msgspec.msgpack.encode(plain))
    back = ActiveLoad.from_plain(plain)
    assert back.digest == load.digest != 0
    assert len(back) == 3
    for w in (W1, W1R1, W2):
        assert back.active_prefill_tokens(w) == load.active_prefill_tokens(w)
        assert back.active_decode_blocks(w) == load.active_decode_blocks(w)
    assert back.request("b") == load.request("b")
    assert back.to_plain() == load.to_plain()


def test_digest_reflects_prefill_state_and_returns_to_zero() -> None:
    load = ActiveLoad()
    assert load.digest == 0
    load.add("a", "A", W1, 100, [1, 2], ts=1.0)
    before = load.digest
    load.prefill_completed("a")
    assert load.digest != before
    load.finish("a")
    assert load.digest == 0


# --- properties ---------------------------------------------------------------------------

_request = st.tuples(
    st.sampled_from(["A", "B", "C"]),  # replica
    st.sampled_from([W1, W1R1, W2]),
    st.integers(0, 10_000),  # prefill tokens
    st.lists(st.integers(0, 2**64 - 1), max_size=6),  # block hashes
    st.floats(0, 1e9, allow_nan=False),
    st.booleans(),  # prefill done
)


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.text(min_size=1, max_size=8), _request, max_size=12), st.randoms())
def test_digest_independent_of_add_order(requests: dict, rnd) -> None:
    def build(order: list[str]) -> ActiveLoad:
        load = ActiveLoad()
        for rid in order:
            replica, worker, prefill, hashes, ts, _done = requests[rid]
            assert load.add(rid, replica, worker, prefill, hashes, ts)
        for rid in reversed(order):
            if requests[rid][5]:
                load.prefill_completed(rid)
        return load

    ids = list(requests)
    shuffled = ids[:]
    rnd.shuffle(shuffled)
    a, b = build(ids), build(shuffled)
    assert a.digest == b.digest
    assert a.to_plain() == b.to_plain()
    # finishing everything in any order returns the digest to zero
    for rid in shuffled:
        a.finish(rid)
    assert a.digest == 0 and len(a) == 0 and a.workers() == set()


def _chain(prefix_id: int, length: int) -> list[int]:
    # Distinct prefixes get distinct hashes; a chain is one prefix's first `length` blocks.
    return [prefix_id * 1000 + i for i in range(length)]


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 3), st.integers(0, 40)), max_size=8),
    st.tuples(st.integers(0, 4), st.integers(0, 60)),
    st.lists(st.integers(0, 7), max_size=4),
)
def test_active_prefix_len_matches_brute_force(
    active: list[tuple[int, int]], query: tuple[int, int], finished: list[int]
) -> None:
    load = ActiveLoad()
    for n, (prefix, length) in enumerate(active):
        load.add(f"r{n}", "rep", W1, 0, _chain(prefix, length), ts=0.0)
    for n in finished:
        load.finish(f"r{n}")
    held = set()
    for n, (prefix, length) in enumerate(active):
        if load.owner(f"r{n}") is not None:
            held.update(_chain(prefix, length))
    seq = _chain(*query)
    brute = 0
    while brute < len(seq) and seq[brute] in held:
        brute += 1
    assert load.active_prefix_len(W1, seq) == brute
    assert load.active_decode_blocks(W1) == len(held)
