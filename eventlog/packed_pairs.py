"""A ``BlocksStored``'s blocks kept as the u64 words they were read into (``kv_decode.py``).

A sequence of ``(block_hash, tokens_hash)`` tuples like the list ``decode_batch`` gives, equal to
it, and encoded as it is (``events.encode_batch``); what it adds is ``words``, 16 bytes a pair
in native byte order, which the compact index's compiled kernel copies as they are instead of
reading two Python ints a block. Any other reader of the blocks (the reference index, tools)
gets tuples of Python ints, made when asked for.

Pure: no I/O, no clock.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence
from typing import overload

_WORD = "Q"  # unsigned 64-bit (8 bytes on every platform CPython supports)


class PackedPairs(Sequence[tuple[int, int]]):
    """``(block_hash, tokens_hash)`` pairs held as ``words`` (bytes, 16 a pair)."""

    __slots__ = ("words",)

    def __init__(self, words: bytes) -> None:
        if len(words) % 16:
            raise ValueError(f"pair words come 16 bytes a pair, got {len(words)} bytes")
        self.words = words

    @classmethod
    def of(cls, pairs: Sequence[tuple[int, int]]) -> PackedPairs:
        """Packed from pairs of ints in [0, 2**64) (``OverflowError`` for any other)."""
        return cls(array(_WORD, [v for pair in pairs for v in pair]).tobytes())

    def _values(self) -> array[int]:
        values = array(_WORD)
        values.frombytes(self.words)
        return values

    def __len__(self) -> int:
        return len(self.words) // 16

    def __iter__(self) -> Iterator[tuple[int, int]]:
        values = iter(self._values())
        return zip(values, values, strict=False)  # an even count: the pairs, nothing left over

    @overload
    def __getitem__(self, i: int) -> tuple[int, int]: ...

    @overload
    def __getitem__(self, i: slice) -> list[tuple[int, int]]: ...

    def __getitem__(self, i: int | slice) -> tuple[int, int] | list[tuple[int, int]]:
        if isinstance(i, slice):
            return list(self)[i]
        n = len(self)
        if not -n <= i < n:
            raise IndexError("pair index out of range")
        values = self._values()
        at = 2 * (i % n)
        return values[at], values[at + 1]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PackedPairs):
            return self.words == other.words
        if isinstance(other, list | tuple):
            return len(other) == len(self) and all(
                isinstance(pair, tuple) and pair == mine
                for pair, mine in zip(other, self, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # equal to lists, which are not hashable

    def __repr__(self) -> str:
        return f"PackedPairs({list(self)!r})"
