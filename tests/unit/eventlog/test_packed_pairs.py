"""``PackedPairs`` is the list of ``(block_hash, tokens_hash)`` tuples it was read from."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from eventlog import events as ev
from eventlog.packed_pairs import PackedPairs

PAIRS = st.lists(st.tuples(st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1)), max_size=20)


@given(PAIRS)
def test_it_is_the_sequence_of_its_pairs(pairs: list[tuple[int, int]]) -> None:
    packed = PackedPairs.of(pairs)
    assert len(packed) == len(pairs)
    assert list(packed) == pairs
    assert [packed[i] for i in range(len(pairs))] == pairs
    assert [packed[-i - 1] for i in range(len(pairs))] == pairs[::-1]
    assert packed[1:3] == pairs[1:3] and packed[::-1] == pairs[::-1]
    assert packed == pairs and pairs == packed and packed == tuple(pairs)
    assert packed == PackedPairs.of(pairs)
    assert all(type(v) is int for pair in packed for v in pair)


def test_unequal_and_out_of_range() -> None:
    packed = PackedPairs.of([(1, 2), (3, 4)])
    assert packed != [(1, 2)] and packed != [(1, 2), (3, 5)] and packed != [[1, 2], [3, 4]]
    assert packed != "pairs"
    with pytest.raises(IndexError):
        packed[2]
    with pytest.raises(IndexError):
        packed[-3]
    with pytest.raises(ValueError, match="16 bytes a pair"):
        PackedPairs(b"\x00" * 8)
    with pytest.raises(OverflowError):
        PackedPairs.of([(2**64, 0)])
    with pytest.raises(TypeError):
        hash(packed)


@given(PAIRS)
def test_an_event_holding_it_encodes_as_with_the_list(pairs: list[tuple[int, int]]) -> None:
    as_list = ev.BlocksStored("w0", 1, 0, None, pairs, 1.0)
    packed = ev.BlocksStored("w0", 1, 0, None, PackedPairs.of(pairs), 1.0)
    assert packed == as_list
    assert ev.encode_batch([packed]) == ev.encode_batch([as_list])
    assert repr(PackedPairs.of(pairs)) == f"PackedPairs({pairs!r})"
