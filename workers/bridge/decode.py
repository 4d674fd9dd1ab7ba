"""Decode one engine KV-event payload (vLLM or SGLang, ZMQ frame 3) into a typed batch.

Pure: no I/O, no clock. The payload is msgpack ``[ts, [events...], dp_rank]`` (older engines:
``[ts, [events...]]``). Each event is either

* a **tagged map** (vLLM >= 0.26): ``{"type": "BlockStored", "block_hashes": [...],
  "parent_block_hash": ..., "token_ids": [...], "block_size": 32, "lora_id": ..., "medium":
  "GPU", "lora_name": ..., "extra_keys": [...], ...}``, ``{"type": "BlockRemoved",
  "block_hashes": [...], "medium": ...}``, ``{"type": "AllBlocksCleared"}``; or
* a **positional array** (older vLLM, SGLang): ``["BlockStored", block_hashes, parent_block_hash,
  token_ids, block_size, lora_id(, medium, lora_name, extra_keys, ...)]``,
  ``["BlockRemoved", block_hashes(, medium)]``, ``["AllBlocksCleared"]``.

Unknown fields and trailing array items are ignored. An event that does not fit (wrong types,
unknown tag) is counted in ``EngineBatch.malformed`` and skipped; only a payload whose envelope is
not a batch at all raises :class:`BadPayload`.

Engine block hashes are opaque ids, used only to find a block again on removal. vLLM publishes
them as unsigned 64-bit ints (older versions: raw digest bytes), SGLang as signed int64; all are
normalised to one unsigned 64-bit domain (:func:`normalise_hash`) so that a removal always finds
the block its store announced, whichever form the engine used.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from errors.root import JetrouterError

MASK64 = (1 << 64) - 1
DEVICE_MEDIUM = "GPU"
"""The tier whose blocks count for prefix overlap (vLLM reports "GPU" even for its CPU backend)."""


class BadPayload(JetrouterError, ValueError):
    """A payload that is not a ``[ts, events, dp_rank]`` batch at all."""


@dataclass(frozen=True, slots=True)
class EngineStored:
    block_hashes: list[int]
    parent_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    lora_name: str | None
    medium: str
    extra_keys: list[Any] | None  # per block; non-null entries (images, cache salt) change identity


@dataclass(frozen=True, slots=True)
class EngineRemoved:
    block_hashes: list[int]
    medium: str


@dataclass(frozen=True, slots=True)
class EngineCleared:
    pass


EngineEvent = EngineStored | EngineRemoved | EngineCleared


@dataclass(slots=True)
class EngineBatch:
    ts: float
    dp_rank: int
    events: list[EngineEvent] = field(default_factory=list)
    malformed: int = 0  # events that did not decode (skipped)


def normalise_hash(value: object) -> int:
    """An engine block hash as an unsigned 64-bit int: signed int64 (SGLang) and unsigned (vLLM)
    map to the same value; digest bytes (older vLLM) contribute their low 64 bits."""
    if isinstance(value, bool):
        raise TypeError("a block hash cannot be a bool")
    if isinstance(value, int):
        return value & MASK64
    if isinstance(value, (bytes, bytearray)) and value:
        return int.from_bytes(value, "big") & MASK64
    raise TypeError(f"not a block hash: {value!r}")


def _hashes(value: object) -> list[int]:
    if not isinstance(value, list):
        raise TypeError("block_hashes must be a list")
    return [normalise_hash(h) for h in value]


def _tokens(value: object) -> list[int]:
    if not isinstance(value, list):
        raise TypeError("token_ids must be a list")
    # min/max run in C (a per-token Python check was most of the decode cost); non-numbers raise
    # TypeError here, and non-integers are refused when the tokens are packed for hashing.
    if value and (min(value) < 0 or max(value) >= 1 << 32):
        raise TypeError("token ids must be u32")
    return value


def _opt_int(value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"expected an int or null, got {value!r}")
    return value


def _medium(value: object) -> str:
    if value is None:
        return DEVICE_MEDIUM
    if not isinstance(value, str) or not value:
        raise TypeError(f"medium must be a string, got {value!r}")
    return value.upper()


def _stored(fields: dict[str, Any]) -> EngineStored:
    hashes = _hashes(fields.get("block_hashes"))
    parent = fields.get("parent_block_hash")
    tokens = _tokens(fields.get("token_ids"))
    block_size = _opt_int(fields.get("block_size"))
    if block_size is None or block_size <= 0:
        raise TypeError("block_size must be a positive int")
    lora_name = fields.get("lora_name")
    if lora_name is not None and not isinstance(lora_name, str):
        raise TypeError("lora_name must be a string")
    extra = fields.get("extra_keys")
    if extra is not None and (not isinstance(extra, list) or len(extra) != len(hashes)):
        extra = None if extra is None or not isinstance(extra, list) else extra[:len(hashes)]
    return EngineStored(
        block_hashes=hashes,
        parent_hash=None if parent is None else normalise_hash(parent),
        token_ids=tokens,
        block_size=block_size,
        lora_id=_opt_int(fields.get("lora_id")),
        lora_name=lora_name or None,
        medium=_medium(fields.get("medium")),
        extra_keys=extra,
    )


# Positional layouts: the field names in array order after the tag (older vLLM, SGLang).
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                  "medium", "lora_name", "extra_keys")
_REMOVED_FIELDS = ("block_hashes", "medium")


def decode_event(raw: object) -> EngineEvent:
    """One event, map or positional array; raises TypeError/ValueError if it does not fit."""
    if isinstance(raw, dict):
        tag = raw.get("type")
        fields = raw
    elif isinstance(raw, list) and raw and isinstance(raw[0], str):
        tag = raw[0]
        names = _STORED_FIELDS if tag == "BlockStored" else _REMOVED_FIELDS
        fields = dict(zip(names, raw[1:], strict=False))
    else:
        raise TypeError(f"not an event: {type(raw).__name__}")
    if tag == "BlockStored":
        return _stored(fields)
    if tag == "BlockRemoved":
        return EngineRemoved(_hashes(fields.get("block_hashes")), _medium(fields.get("medium")))
    if tag == "AllBlocksCleared":
        return EngineCleared()
    raise ValueError(f"unknown event type {tag!r}")


def decode_payload(payload: bytes) -> EngineBatch:
    """Decode one ZMQ payload; malformed events are counted and skipped."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise BadPayload(f"not msgpack: {exc}") from None
    if isinstance(raw, dict):  # a map-encoded envelope (defensive; engines send arrays)
        raw = [raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")]
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
        raise BadPayload("payload is not [ts, [events...], dp_rank]")
    ts = raw[0]
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        raise BadPayload(f"batch ts {ts!r} is not a number")
    rank = raw[2] if len(raw) > 2 else None
    if rank is None:
        rank = 0
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise BadPayload(f"dp rank {rank!r} is not a non-negative int")
    batch = EngineBatch(ts=float(ts), dp_rank=rank)
    for item in raw[1]:
        try:
            batch.events.append(decode_event(item))
        except (TypeError, ValueError):
            batch.malformed += 1
    return batch
