"""Block hashing: tokens_hash equals xxh3 directly, partial blocks are skipped, the chain chains.

Every test runs twice: with the compiled hashing (when it is built) and with the Python code."""

from __future__ import annotations

import random
import struct
from collections.abc import Iterator

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from eventlog import compiled
from eventlog.hashing import (
    MASK64,
    SEED,
    chain_hash,
    prompt_hashes,
    sequence_hashes,
    tokens_hashes,
)

u64 = st.integers(min_value=0, max_value=MASK64)


@pytest.fixture(autouse=True, scope="module", params=["compiled", "python"])
def hashing_path(request: pytest.FixtureRequest) -> Iterator[str]:
    """Module-scoped, so hypothesis tests take it too (they refuse function-scoped fixtures)."""
    was = compiled.active() is not None
    if request.param == "compiled" and not compiled.available():
        pytest.skip("the compiled hashing is not built here")
    compiled.use_compiled(request.param == "compiled")
    yield request.param
    compiled.use_compiled(was)


def reference_tokens_hashes(tokens: list[int], block_size: int) -> list[int]:
    full = len(tokens) // block_size
    return [
        xxhash.xxh3_64_intdigest(
            struct.pack(f"<{block_size}I", *tokens[i * block_size : (i + 1) * block_size]),
            seed=1337,
        )
        for i in range(full)
    ]


def reference_sequence_hashes(local: list[int], parent: int | None = None) -> list[int]:
    out = []
    for value in local:
        parent = value if parent is None else chain_hash(parent, value)
        out.append(parent)
    return out


def test_known_answer_vectors() -> None:
    assert SEED == 1337
    tokens = list(range(16))
    expected = xxhash.xxh3_64_intdigest(struct.pack("<16I", *tokens), seed=1337)
    assert tokens_hashes(tokens, 16) == [expected]
    # a value above 2**16 checks the byte order of every token
    big = [0x01020304, 0xFFFFFFFF, 0, 7] * 4
    raw = b"".join(t.to_bytes(4, "little") for t in big)
    assert tokens_hashes(big, 16) == [xxhash.xxh3_64_intdigest(raw, seed=1337)]


@pytest.mark.parametrize("block_size", [1, 4, 16, 32, 64])
def test_matches_reference_for_random_prompts(block_size: int) -> None:
    rng = random.Random(block_size)
    tokens = [rng.randrange(2**32) for _ in range(block_size * 37 + 3)]
    expected = reference_tokens_hashes(tokens, block_size)
    assert tokens_hashes(tokens, block_size) == expected
    assert tokens_hashes(struct.pack(f"<{len(tokens)}I", *tokens), block_size) == expected
    assert tokens_hashes(np.array(tokens, dtype=np.uint32), block_size) == expected


def test_partial_block_is_ignored() -> None:
    tokens = list(range(40))
    assert len(tokens_hashes(tokens, 16)) == 2
    assert tokens_hashes(tokens, 16) == tokens_hashes(tokens[:32], 16)
    assert tokens_hashes(tokens[:15], 16) == []
    assert prompt_hashes(tokens[:15], 16) == []


def test_bad_input_is_rejected() -> None:
    with pytest.raises(ValueError):
        tokens_hashes([1, -1] * 8, 16)
    with pytest.raises(ValueError):
        tokens_hashes([2**32] * 16, 16)
    with pytest.raises(ValueError):
        tokens_hashes([1] * 16, 0)
    with pytest.raises(ValueError):
        tokens_hashes(np.array([-1] * 16), 16)


def test_chain_property_and_root() -> None:
    local = tokens_hashes(list(range(16 * 100)), 16)
    seq = sequence_hashes(local)
    assert seq[0] == local[0]
    for i in range(1, len(seq)):
        assert seq[i] == chain_hash(seq[i - 1], local[i])
    # continuing from a parent gives the same tail, for short (loop) and long (numpy) tails
    assert sequence_hashes(local[60:], parent_seq=seq[59]) == seq[60:]
    assert sequence_hashes(local[95:], parent_seq=seq[94]) == seq[95:]
    assert prompt_hashes(list(range(16 * 100)), 16) == seq


def test_prefix_identity() -> None:
    rng = random.Random(7)
    tokens = [rng.randrange(50_000) for _ in range(16 * 64)]
    base = prompt_hashes(tokens, 16)
    # a longer prompt with the same prefix shares the prefix's sequence hashes
    assert prompt_hashes(tokens + [1] * 40, 16)[:64] == base
    # changing one token in block 10 changes block 10 and every later sequence hash
    changed = list(tokens)
    changed[10 * 16 + 3] += 1
    other = prompt_hashes(changed, 16)
    assert other[:10] == base[:10]
    assert all(a != b for a, b in zip(other[10:], base[10:], strict=True))
    # same block content at a different position is a different sequence hash
    swapped = tokens[16:32] + tokens[:16] + tokens[32:]
    assert prompt_hashes(swapped, 16)[1] != base[1]


@settings(max_examples=60, deadline=None)
@given(st.lists(u64, max_size=80), st.one_of(st.none(), u64))
def test_vectorised_chain_equals_loop(local: list[int], parent: int | None) -> None:
    assert sequence_hashes(local, parent) == reference_sequence_hashes(local, parent)
