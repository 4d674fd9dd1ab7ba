"""``tokens_hash`` of each full KV block, as the router computes it (design.md §4).

The worker must publish the very hash the router computes from a prompt, so it uses
``eventlog.hashing.tokens_hashes`` when that module is present. Until it is, a local copy of the
documented rule is used: ``xxh3_64(little-endian u32 token ids of the block, seed=1337)``; a
trailing partial block is not hashed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import xxhash

from workers.generation import pack_u32

HASH_SEED = 1337


def _local_tokens_hashes(tokens: Sequence[int], block_size: int) -> list[int]:
    data = pack_u32(tokens)
    step = 4 * block_size
    full = (len(tokens) // block_size) * step
    return [xxhash.xxh3_64_intdigest(data[i : i + step], seed=HASH_SEED) for i in range(0, full, step)]


def _pick() -> tuple[Callable[[Sequence[int], int], list[int]], str]:
    try:
        from eventlog.hashing import tokens_hashes as shared  # another helper's module
    except ImportError:
        return _local_tokens_hashes, "local"
    return shared, "eventlog.hashing"


_impl, SOURCE = _pick()


def tokens_hashes(tokens: Sequence[int], block_size: int) -> list[int]:
    """One ``tokens_hash`` per full block of ``tokens``."""
    return list(_impl(tokens, block_size))
