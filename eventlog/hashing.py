"""Block hashing: `tokens_hash` per block and the sequence hash chain over a prompt (design.md §4).

Pure module: no clock, no randomness, no I/O. It lives in eventlog because workers (and the bridges
that translate engine KV events) must compute ``tokens_hash`` exactly as the router does.

* ``tokens_hash`` = ``xxh3_64(little-endian u32 token ids of one full block, seed=1337)``, as in
  Dynamo. A trailing partial block is never hashed.
* The *sequence* hash of block ``i`` identifies the whole prefix ``0..i``. jetrouter computes it
  itself from ``tokens_hash`` values (engines' own hashes are opaque ids), so it is free to pick a
  chain that can be computed without a Python-level loop. It is a polynomial over the
  ``tokens_hash`` values modulo 2**64::

      seq[0] = local[0]                                (no parent)
      seq[i] = (seq[i-1] * CHAIN_MULTIPLIER + local[i]) mod 2**64

  which unrolls to ``seq[i] = P**i * (sum_{j<=i} local[j] * P**-j)`` (P odd, so invertible modulo
  2**64): one cumulative sum in numpy instead of 512 sequential xxh3 calls. Because ``local[i]``
  is already a 64-bit xxh3 digest, two different prefixes collide with probability ~2**-64 on
  honest input. Known weakness: a power-of-two modulus admits crafted collisions (Thue-Morse
  strings of ~2**11 blocks); the only effect is a wrong overlap estimate for that request.
* **LoRA adapters**: a block cached under adapter A holds different KV than the same tokens under
  adapter B or the base model, so it must never match them. ``tokens_hash`` of a block cached
  under an adapter is xored with ``adapter_salt(name)`` (xxh3 of the adapter name); the base model
  has no salt (salt 0), so base-model hashes are unchanged. Bridges salt by the event's adapter,
  the router salts a request's blocks when the requested model is an adapter.
* **Compiled path**: ``tokens_hashes`` and ``prompt_hashes`` run ``eventlog/_fasthash.c`` when it
  is built and not turned off (``eventlog/compiled.py``): the same hashes in one call per prompt.
  ``tokens_hashes_python`` and ``prompt_hashes_python`` are the reference it is tested against.
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Sequence

import numpy as np
import xxhash

from eventlog import compiled

SEED = 1337
"""xxh3 seed for ``tokens_hash`` (Dynamo's convention)."""

CHAIN_MULTIPLIER = 0x9E3779B97F4A7C15
"""Odd 64-bit multiplier P of the sequence-hash polynomial (2**64 / golden ratio, rounded odd)."""

MASK64 = (1 << 64) - 1
_INVERSE = pow(CHAIN_MULTIPLIER, -1, 1 << 64)

# Below this many blocks a plain Python loop beats numpy's per-call overhead.
_NUMPY_MIN_BLOCKS = 24

_xxh3 = xxhash.xxh3_64_intdigest
_xxh3_digest = xxhash.xxh3_64_digest  # the same value as 8 big-endian bytes
_BIG_U64 = np.dtype(">u8")
_LITTLE = sys.byteorder == "little"

_pack_cache: dict[int, struct.Struct] = {}
_split_cache: dict[int, struct.Struct] = {}
_powers = np.ones(1, dtype=np.uint64)  # P**i mod 2**64
_inverse_powers = np.ones(1, dtype=np.uint64)  # P**-i mod 2**64


def _packer(count: int) -> struct.Struct:
    packer = _pack_cache.get(count)
    if packer is None:
        packer = _pack_cache[count] = struct.Struct(f"<{count}I")
    return packer


def _splitter(block_bytes: int) -> struct.Struct:
    splitter = _split_cache.get(block_bytes)
    if splitter is None:
        splitter = _split_cache[block_bytes] = struct.Struct(f"{block_bytes}s")
    return splitter


def _token_bytes(tokens: Sequence[int] | bytes | bytearray | memoryview) -> bytes | memoryview:
    """Little-endian u32 bytes of ``tokens`` (zero-copy for buffers already in that layout)."""
    if isinstance(tokens, (bytes, bytearray, memoryview)):
        return tokens
    if isinstance(tokens, np.ndarray):
        if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= 1 << 32):
            raise ValueError("token ids must be integers in [0, 2**32)")
        return np.ascontiguousarray(tokens, dtype="<u4").tobytes()
    try:
        return _packer(len(tokens)).pack(*tokens)
    except struct.error as exc:
        raise ValueError(f"token ids must be integers in [0, 2**32): {exc}") from None


def _compiled_input(tokens: Sequence[int] | bytes | bytearray | memoryview
                    ) -> Sequence[int] | bytes | bytearray | memoryview:
    """What the compiled code takes as is (a list, a tuple, bytes); a numpy array becomes bytes
    (checked as the Python code checks it). Anything else it declines, and Python runs."""
    return _token_bytes(tokens) if isinstance(tokens, np.ndarray) else tokens


def tokens_hashes(tokens: Sequence[int], block_size: int) -> list[int]:
    """``tokens_hash`` of every full block of ``tokens`` (a trailing partial block is skipped).

    ``tokens`` may also be little-endian u32 bytes, or a numpy integer array.
    """
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    fast = compiled.active()
    if fast is not None:
        out = fast.hash_blocks(_compiled_input(tokens), block_size, SEED, 0, 0, False)
        if out is not None:
            return out  # type: ignore[no-any-return]
    return tokens_hashes_python(tokens, block_size)


def tokens_hashes_python(tokens: Sequence[int], block_size: int) -> list[int]:
    """``tokens_hashes`` in Python: the reference the compiled code is tested against."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    raw = _token_bytes(tokens)
    block_bytes = 4 * block_size
    usable = len(raw) - len(raw) % block_bytes
    if usable == 0:
        return []
    view = memoryview(raw)[:usable] if usable != len(raw) else raw
    # iter_unpack cuts the buffer into per-block bytes objects in C, much cheaper than slicing.
    return [_xxh3(chunk, SEED) for (chunk,) in _splitter(block_bytes).iter_unpack(view)]


def _tokens_hash_array(tokens: Sequence[int], block_size: int) -> np.ndarray:
    """``tokens_hashes`` as a uint64 array, never as Python ints: each block's digest bytes are
    joined and viewed as big-endian u64 at once (no list-to-array conversion on the hot path)."""
    raw = _token_bytes(tokens)
    block_bytes = 4 * block_size
    usable = len(raw) - len(raw) % block_bytes
    view = memoryview(raw)[:usable] if usable != len(raw) else raw
    digests = b"".join([_xxh3_digest(chunk, SEED)
                        for (chunk,) in _splitter(block_bytes).iter_unpack(view)])
    return np.frombuffer(digests, dtype=_BIG_U64).astype(np.uint64)


def _chain_array(values: np.ndarray) -> list[int]:
    """``sequence_hashes`` (no parent) of a uint64 array; ``values`` is overwritten."""
    count = len(values)
    _ensure_powers(count)
    values *= _inverse_powers[:count]  # uint64 arithmetic wraps: everything is modulo 2**64
    np.cumsum(values, out=values)
    values *= _powers[:count]
    return values.tolist()  # type: ignore[no-any-return]


def chain_hash(parent_seq: int, tokens_hash: int) -> int:
    """Sequence hash of a block whose parent block has sequence hash ``parent_seq``."""
    return (parent_seq * CHAIN_MULTIPLIER + tokens_hash) & MASK64


def _ensure_powers(count: int) -> None:
    global _powers, _inverse_powers
    have = len(_powers)
    if have >= count:
        return
    size = max(count, 2 * have)
    powers = [0] * size
    inverse = [0] * size
    p = q = 1
    for i in range(size):
        powers[i] = p
        inverse[i] = q
        p = (p * CHAIN_MULTIPLIER) & MASK64
        q = (q * _INVERSE) & MASK64
    _powers = np.array(powers, dtype=np.uint64)
    _inverse_powers = np.array(inverse, dtype=np.uint64)


def sequence_hashes(local: Sequence[int], parent_seq: int | None = None) -> list[int]:
    """Chain ``tokens_hash`` values into sequence hashes (``seq[0] = local[0]`` with no parent)."""
    count = len(local)
    if count < _NUMPY_MIN_BLOCKS or not _LITTLE:
        out: list[int] = []
        seq = 0 if parent_seq is None else parent_seq
        for value in local:
            seq = (seq * CHAIN_MULTIPLIER + value) & MASK64
            out.append(seq)
        return out
    _ensure_powers(count)
    values = np.array(local, dtype=np.uint64)
    values *= _inverse_powers[:count]  # uint64 arithmetic wraps: everything is modulo 2**64
    np.cumsum(values, out=values)
    if parent_seq is not None:
        values += np.uint64(((parent_seq & MASK64) * CHAIN_MULTIPLIER) & MASK64)
    values *= _powers[:count]
    return values.tolist()  # type: ignore[no-any-return]


def adapter_salt(adapter: str | None) -> int:
    """Salt xored into ``tokens_hash`` of blocks cached under a LoRA adapter; 0 for the base model
    (``None`` or empty)."""
    if not adapter:
        return 0
    return _xxh3(b"lora-adapter:" + adapter.encode(), SEED) or 1  # never 0: that is the base


def extra_keys_salt(key: object) -> int:
    """Salt xored into ``tokens_hash`` of a block whose engine-reported ``extra_keys`` are
    ``key`` (multimodal inputs, a cache salt), as the bridge decodes them from the event."""
    return _xxh3(b"extra-keys:" + repr(key).encode(), SEED) or 1


def cache_salt_salt(cache_salt: str) -> int:
    """Salt of the first block of a prompt sent with vLLM's ``cache_salt``: vLLM puts the salt
    in the extra keys of the prompt's first block only (``(cache_salt,)``, a list once it has
    crossed msgpack), and the chain carries it to every later block. 0 for no salt."""
    return extra_keys_salt([cache_salt]) if cache_salt else 0


def salted(local: list[int], salt: int) -> list[int]:
    """``tokens_hash`` values under an adapter's salt (unchanged for salt 0)."""
    if not salt:
        return local
    return [value ^ salt for value in local]


def prompt_hashes(tokens: Sequence[int], block_size: int, adapter: str | None = None,
                  cache_salt: str = "") -> list[int]:
    """Sequence hashes of every full block of a prompt: what the router matches and records.

    ``adapter``: the LoRA adapter the request runs under (None: the base model).
    ``cache_salt``: vLLM's ``cache_salt`` the engine gets with the prompt ("" for none)."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    salt = adapter_salt(adapter)
    first = cache_salt_salt(cache_salt)
    fast = compiled.active()
    if fast is not None:
        out = fast.hash_blocks(_compiled_input(tokens), block_size, SEED, salt, first, True)
        if out is not None:
            return out  # type: ignore[no-any-return]
    return _prompt_hashes_python(tokens, block_size, salt, first)


def prompt_hashes_python(tokens: Sequence[int], block_size: int, adapter: str | None = None,
                         cache_salt: str = "") -> list[int]:
    """``prompt_hashes`` in Python: the reference the compiled code is tested against."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    return _prompt_hashes_python(tokens, block_size, adapter_salt(adapter),
                                 cache_salt_salt(cache_salt))


def _prompt_hashes_python(tokens: Sequence[int], block_size: int, salt: int, first: int
                          ) -> list[int]:
    if len(tokens) < _NUMPY_MIN_BLOCKS * block_size or not _LITTLE:
        local_list = salted(tokens_hashes_python(tokens, block_size), salt)
        if first and local_list:
            local_list = [local_list[0] ^ first, *local_list[1:]]
        return sequence_hashes(local_list)
    local = _tokens_hash_array(tokens, block_size)
    if salt:
        local ^= np.uint64(salt)
    if first:
        local[0] ^= np.uint64(first)
    return _chain_array(local)
