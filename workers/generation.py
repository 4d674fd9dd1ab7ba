"""Deterministic "greedy decoding" for the simulated engine.

Each next token is a function of the whole context (prompt + tokens generated so far): an xxh3
state fed with every context token (little-endian u32), whose digest picks a printable ASCII byte.
So a request resumed elsewhere, with the tokens generated so far appended to its prompt, continues
exactly as if it had never moved - tests use :func:`expected_tokens` to know what a healthy engine
must produce.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

import xxhash

_SEED = 0x6A6574  # "jet"
# Printable ASCII (32..126), letters and spaces weighted so output looks vaguely like words.
_ALPHABET = (b"eeeeettttaaaooiinnsshhrrddllcuumwfgypbvkjxqz     "
    b"EETAOINSHR.,;:!?'-0123456789()")
assert all(32 <= b <= 126 for b in _ALPHABET)


def pack_u32(tokens: Sequence[int]) -> bytes:
    """Token ids as little-endian u32 bytes (the layout block hashing uses too)."""
    packed = array("I", tokens)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


class ContextState:
    """Running hash of a context; O(1) per appended token (xxh3 streaming state)."""

    __slots__ = ("_h",)

    def __init__(self, tokens: Sequence[int] = ()) -> None:
        self._h = xxhash.xxh3_64(seed=_SEED)
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        if len(tokens):
            self._h.update(pack_u32(tokens))

    def append(self, token: int) -> None:
        self._h.update(int(token).to_bytes(4, "little"))

    def digest(self) -> int:
        return self._h.intdigest()

    def copy(self) -> ContextState:
        other = ContextState.__new__(ContextState)
        other._h = self._h.copy()
        return other


def next_token(state: ContextState) -> int:
    """The token a healthy engine emits after the context ``state`` describes (no mutation)."""
    return _ALPHABET[state.digest() % len(_ALPHABET)]


def wrong_token(state: ContextState) -> int:
    """A token guaranteed to differ from :func:`next_token` (the ``wrong_output`` fault)."""
    good = next_token(state)
    return 32 + (good - 32 + 1) % 95


def expected_tokens(prompt_ids: Sequence[int], n: int) -> list[int]:
    """The first ``n`` output tokens a healthy engine produces for ``prompt_ids``."""
    state = ContextState(prompt_ids)
    out: list[int] = []
    for _ in range(n):
        token = next_token(state)
        out.append(token)
        state.append(token)
    return out
