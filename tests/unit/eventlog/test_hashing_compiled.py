"""The compiled prompt hashing (eventlog/_fasthash.c) gives exactly the Python code's hashes.

The Python code is the reference: equal hashes on random prompts, block sizes, salts and input
types, for both ways the compiled code reaches xxhash (its C function, its Python function); the
same errors; and ``JETROUTER_PURE_PYTHON`` turns the compiled code off."""

from __future__ import annotations

import struct
from collections.abc import Iterator

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from eventlog import compiled
from eventlog.hashing import (
    prompt_hashes,
    prompt_hashes_python,
    tokens_hashes,
    tokens_hashes_python,
)
from tests.pure_python import printed_with_pure_python

pytestmark = pytest.mark.skipif(not compiled.available(),
                                reason="the compiled hashing is not built here")

token = st.integers(min_value=0, max_value=2**32 - 1)
names = st.one_of(st.none(), st.text(max_size=8))


@pytest.fixture(autouse=True, scope="module")
def compiled_on() -> Iterator[None]:
    was = compiled.active() is not None
    compiled.use_compiled(True)
    yield
    compiled.use_compiled(was)


@pytest.fixture(scope="module", params=["xxhash C function", "xxhash Python function"])
def xxh3_binding(request: pytest.FixtureRequest) -> Iterator[str]:
    """Both bindings; the module is bound back to what it found at import afterwards."""
    fast = compiled.active()
    assert fast is not None
    if request.param == "xxhash Python function":
        assert fast.bind(None, xxhash.xxh3_64_intdigest) is False
    elif not compiled.DIRECT_XXH3:
        pytest.skip("the xxhash extension does not export XXH3_64bits_withSeed here")
    yield request.param
    compiled._bind()


@settings(max_examples=150, deadline=None)
@given(tokens=st.lists(token, max_size=600), block_size=st.integers(1, 70), adapter=names,
       cache_salt=st.text(max_size=6))
def test_equal_hashes_on_random_prompts(xxh3_binding: str, tokens: list[int], block_size: int,
                                        adapter: str | None, cache_salt: str) -> None:
    expected = prompt_hashes_python(tokens, block_size, adapter, cache_salt)
    raw = struct.pack(f"<{len(tokens)}I", *tokens)
    for form in (tokens, tuple(tokens), raw, np.array(tokens, dtype=np.uint32)):
        assert prompt_hashes(form, block_size, adapter, cache_salt) == expected
    assert tokens_hashes(tokens, block_size) == tokens_hashes_python(tokens, block_size)


def test_long_blocks_take_xxh3s_long_path(xxh3_binding: str) -> None:
    """Blocks over 240 bytes hash by another branch of xxh3: the same answer there too."""
    tokens = [(i * 2654435761) % 2**32 for i in range(4096)]
    for block_size in (60, 61, 64, 256, 1024):
        assert prompt_hashes(tokens, block_size) == prompt_hashes_python(tokens, block_size)


def test_token_ids_at_an_ints_digit_boundaries(xxh3_binding: str) -> None:
    """Ids of one 30-bit digit are read from the int directly, larger ones through the C API:
    zero, each side of 2**30 and the top of u32 hash as in Python, in one prompt."""
    edges = [0, 1, 255, 256, 2**30 - 1, 2**30, 2**31, 2**32 - 1]
    tokens = [edges[(i * 5) % len(edges)] for i in range(16 * 9)]
    for block_size in (1, 4, 16):
        assert prompt_hashes(tokens, block_size) == prompt_hashes_python(tokens, block_size)


@pytest.mark.parametrize("tokens", [[-1] * 16, [2**32] * 16, [1.0] * 16, ["1"] * 16,
                                    np.array([-1] * 16)])
def test_same_errors_as_python(tokens: list[object]) -> None:
    with pytest.raises(ValueError, match=r"token ids must be integers in \[0, 2\*\*32\)"):
        prompt_hashes(tokens, 16)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"token ids must be integers in \[0, 2\*\*32\)"):
        prompt_hashes_python(tokens, 16)  # type: ignore[arg-type]


def test_inputs_it_declines_take_the_python_code() -> None:
    tokens = list(range(100))
    expected = prompt_hashes_python(tokens, 16)
    raw = struct.pack("<100I", *tokens)
    assert prompt_hashes(bytearray(raw), 16) == expected
    assert prompt_hashes(memoryview(raw), 16) == expected
    assert prompt_hashes([np.uint32(t) for t in tokens], 16) == expected
    assert prompt_hashes([True] * 16, 16) == prompt_hashes_python([1] * 16, 16)
    # a block too large for its byte length to fit in C's sizes: no block, as in Python
    assert prompt_hashes(tokens, 2**62) == prompt_hashes_python(tokens, 2**62) == []
    assert prompt_hashes(raw, 2**62) == []


def test_environment_variable_forces_the_python_code() -> None:
    probe = "from eventlog import compiled; print(compiled.available(), compiled.active())"
    assert printed_with_pure_python(probe) == ["True", "None"]


def test_use_compiled_switches_at_run_time() -> None:
    assert compiled.use_compiled(False) is False
    assert compiled.active() is None
    assert compiled.use_compiled(True) is True
    assert compiled.active() is not None
