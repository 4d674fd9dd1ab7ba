"""Decoding KV stream messages with each ``BlocksStored``'s blocks left as u64 words.

``decode_batch`` turns every block of a ``BlocksStored`` into a tuple of two Python ints; the
compact index's compiled kernel reads those back into u64s, and the objects are freed again. In a
replica replaying a KV stream that was most of the time outside the index (design.md §7). Here
msgspec decodes the message with ``blocks`` left as raw msgpack (``msgspec.Raw``), and the compiled
``_kvwire.pair_words`` reads it into 16 bytes a block (``PackedPairs``) in one pass.

The answer is ``decode_batch``'s, always: the same events, equal field by field (``PackedPairs``
equals the list of tuples), and the same verdict on a malformed message. ``pair_words`` takes on
only the shape ``list[tuple[Hash, Hash]]`` accepts and returns None for anything else, and then
the message is decoded again by ``decode_batch``, which gives what it always gave (a value or
``MalformedMessage``); a message that fails the raw decode likewise. The property tests hold the
two to this on random and malformed input.

Without the compiled module, or with ``JETROUTER_PURE_PYTHON`` set, ``AVAILABLE`` is False and
readers use ``decode_batch``.
"""

from __future__ import annotations

from typing import Any, Union, get_args

import msgspec

from eventlog import events as ev
from eventlog.compiled import pure_requested
from eventlog.packed_pairs import PackedPairs

try:
    from eventlog import _kvwire  # type: ignore[attr-defined]
except ImportError:  # not built here: readers decode with decode_batch
    _kvwire = None

AVAILABLE = _kvwire is not None and not pure_requested()
"""The compiled reader of blocks is here and not switched off."""


def _raw_blocks_twin() -> Any:
    """``BlocksStored`` with ``blocks`` as ``msgspec.Raw``: same tag, names, types, defaults."""
    config = ev.BlocksStored.__struct_config__
    fields = []
    for f in msgspec.structs.fields(ev.BlocksStored):
        kind = msgspec.Raw if f.name == "blocks" else f.type
        fields.append((f.name, kind) if f.required else (f.name, kind, f.default))
    return msgspec.defstruct(
        "RawBlocksStored", fields, tag_field=config.tag_field, tag=config.tag,
        frozen=config.frozen, forbid_unknown_fields=config.forbid_unknown_fields,
        rename={f.name: f.encode_name for f in msgspec.structs.fields(ev.BlocksStored)},
        array_like=config.array_like)


RawBlocksStored = _raw_blocks_twin()
_RAW_EVENT = Union[tuple(RawBlocksStored if t is ev.BlocksStored else t  # noqa: UP007
                         for t in get_args(ev.Event))]
_decoder = msgspec.msgpack.Decoder(list[_RAW_EVENT])  # type: ignore[valid-type]
_BLOCKS_AT = [f.name for f in msgspec.structs.fields(ev.BlocksStored)].index("blocks")
# Below this many bytes a message holds a dozen blocks or fewer, and decode_batch is the quicker:
# the second struct and the words object cost ~0.6 us a message, what ~16 blocks' tuples cost.
SMALL_MESSAGE = 384


def decode_kv_batch(data: bytes) -> list[ev.Event]:
    """``decode_batch(data)``, with each ``BlocksStored.blocks`` a ``PackedPairs`` when the
    message has ``SMALL_MESSAGE`` bytes or more (a list of tuples, as always, below that)."""
    if _kvwire is None or len(data) < SMALL_MESSAGE:
        return ev.decode_batch(data)
    try:
        events = _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return ev.decode_batch(data)  # raises MalformedMessage, with msgspec's own words
    out: list[ev.Event] = []
    for e in events:
        if type(e) is RawBlocksStored:
            words = _kvwire.pair_words(e.blocks)
            if words is None:
                return ev.decode_batch(data)  # its verdict, whatever the blocks are
            values = list(msgspec.structs.astuple(e))  # the twin's fields, in the same order
            values[_BLOCKS_AT] = PackedPairs(words)
            e = ev.BlocksStored(*values)
        out.append(e)
    return out
