"""``decode_kv_batch`` gives what ``decode_batch`` gives: equal events, the same verdict.

The blocks of a ``BlocksStored`` are read by compiled code (``_kvwire.pair_words``) from msgpack
written here byte by byte, in every array and integer encoding msgpack has (including the
non-canonical ones msgspec never writes but accepts), with values at the edges of each width,
negative values in the signed widths, counts that lie and values of other types; whatever
``decode_batch`` answers — events or ``MalformedMessage`` and its words — ``decode_kv_batch``
answers too.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eventlog import events as ev
from eventlog import kv_decode
from eventlog.packed_pairs import PackedPairs

pytestmark = pytest.mark.skipif(kv_decode._kvwire is None,
                                reason="the compiled reader of blocks is not built here")

U64_MAX = 2**64 - 1


@pytest.fixture(autouse=True)
def every_size(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Small messages too go through the compiled reader (by default they skip it)."""
    monkeypatch.setattr(kv_decode, "SMALL_MESSAGE", 0)
    yield


def outcome(decode: ev.Decode, data: bytes) -> tuple[str, object]:
    try:
        return "events", decode(data)
    except ev.MalformedMessage as exc:
        return "malformed", str(exc)


def same_answer(data: bytes) -> tuple[str, object]:
    expected = outcome(ev.decode_batch, data)
    got = outcome(kv_decode.decode_kv_batch, data)
    assert got == expected
    if got[0] == "events":  # the same types too, and the blocks packed
        assert [type(e) for e in got[1]] == [type(e) for e in expected[1]]  # type: ignore[union-attr]
        for e in got[1]:  # type: ignore[union-attr]
            if isinstance(e, ev.BlocksStored):
                assert isinstance(e.blocks, PackedPairs)
    return got


# --- msgpack written by hand ------------------------------------------------------------------

INT_WIDTHS = {"u8": (0xCC, ">B"), "u16": (0xCD, ">H"), "u32": (0xCE, ">I"), "u64": (0xCF, ">Q"),
              "i8": (0xD0, ">b"), "i16": (0xD1, ">h"), "i32": (0xD2, ">i"), "i64": (0xD3, ">q")}


def msgpack_int(value: int, width: str) -> bytes:
    if width == "fix":
        return bytes([value & 0xFF]) if 0 <= value <= 0x7F else bytes([(value + 256) & 0xFF])
    tag, fmt = INT_WIDTHS[width]
    return bytes([tag]) + struct.pack(fmt, value)


def array_head(n: int, form: str) -> bytes:
    if form == "fix" and n <= 15:
        return bytes([0x90 | n])
    if form in ("fix", "a16") and n <= 0xFFFF:
        return b"\xdc" + struct.pack(">H", n)
    return b"\xdd" + struct.pack(">I", n)


def width_value(width: str) -> st.SearchStrategy[int]:
    """A value the width can hold: its edges often, negative ones in the signed widths."""
    if width == "fix":
        return st.one_of(st.integers(0, 0x7F), st.integers(-32, -1))  # negative fixint too
    _, fmt = INT_WIDTHS[width]
    bits = struct.calcsize(fmt) * 8
    lo, hi = (0, 2**bits - 1) if fmt[1].isupper() else (-(2**(bits - 1)), 2**(bits - 1) - 1)
    return st.one_of(st.sampled_from([lo, hi, 0, 1, max(lo, -1)]), st.integers(lo, hi))


@st.composite
def encoded_int(draw: st.DrawFn) -> bytes:
    width = draw(st.sampled_from(["fix", *INT_WIDTHS]))
    return msgpack_int(draw(width_value(width)), width)


OTHER_VALUES = st.sampled_from([b"\xc0", b"\xc2", b"\xc3", b"\xcb" + struct.pack(">d", 1.0),
                                b"\xca" + struct.pack(">f", 2.0), b"\xa1x", b"\xc4\x01\x00",
                                b"\x80", b"\x90", b"\xd4\x01\x00"])


@st.composite
def encoded_pair(draw: st.DrawFn) -> bytes:
    n = draw(st.sampled_from([2, 2, 2, 2, 2, 1, 3, 0]))
    head = array_head(n, draw(st.sampled_from(["fix", "a16", "a32"])))
    items = [draw(st.one_of(encoded_int(), encoded_int(), encoded_int(), OTHER_VALUES))
             for _ in range(n)]
    return head + b"".join(items)


@st.composite
def encoded_blocks(draw: st.DrawFn) -> bytes:
    pairs = draw(st.lists(encoded_pair(), max_size=8))
    count = len(pairs) + draw(st.sampled_from([0, 0, 0, 0, 1, -1]))
    head = array_head(max(count, 0), draw(st.sampled_from(["fix", "a16", "a32"])))
    return head + b"".join(pairs)


def with_blocks(raw_blocks: bytes, *, after: list[ev.Event] | None = None) -> bytes:
    """A one-event BlocksStored message whose blocks are ``raw_blocks`` as they are."""
    shell = ev.encode_batch([ev.BlocksStored("w0", 1, 0, 7, [], 1.0), *(after or [])])
    assert shell.count(b"\xa6blocks\x90") == 1
    return shell.replace(b"\xa6blocks\x90", b"\xa6blocks" + raw_blocks)


# --- the tests ----------------------------------------------------------------------------------

@settings(max_examples=600, deadline=None)
@given(encoded_blocks())
def test_hand_written_blocks_get_decode_batchs_answer(raw_blocks: bytes) -> None:
    same_answer(with_blocks(raw_blocks))
    same_answer(with_blocks(raw_blocks, after=[ev.BlocksRemoved("w0", 2, 0, [1], 2.0)]))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, U64_MAX), st.integers(0, U64_MAX)), max_size=40))
def test_valid_blocks_are_the_same_pairs(pairs: list[tuple[int, int]]) -> None:
    kind, events = same_answer(with_blocks(msgspec.msgpack.encode(pairs)))
    assert kind == "events"
    assert list(events[0].blocks) == pairs  # type: ignore[index]


@pytest.mark.parametrize("pair", [
    (0, 0), (0x7F, 0x80), (0xFF, 0x100), (0xFFFF, 0x10000), (2**32 - 1, 2**32),
    (2**63 - 1, 2**63), (U64_MAX, U64_MAX)])
@pytest.mark.parametrize("width", ["fix", "u8", "u16", "u32", "u64", "i8", "i16", "i32", "i64"])
def test_every_integer_encoding(pair: tuple[int, int], width: str) -> None:
    """Each value in each width it fits, canonical or not: the same pairs or the same refusal."""
    tag_fmt = INT_WIDTHS.get(width)
    limit = 0x7F if width == "fix" else (
        2**(8 * struct.calcsize(tag_fmt[1])) - 1 if tag_fmt[1][1].isupper()  # type: ignore[index]
        else 2**(8 * struct.calcsize(tag_fmt[1]) - 1) - 1)  # type: ignore[index]
    parts = [msgpack_int(v, width) if v <= limit else msgspec.msgpack.encode(v) for v in pair]
    kind, events = same_answer(with_blocks(b"\x91\x92" + b"".join(parts)))
    assert kind == "events" and list(events[0].blocks) == [pair]  # type: ignore[index]


@pytest.mark.parametrize("raw_blocks", [
    b"\x91\x92\xd0\xff\x01",             # -1 as int 8
    b"\x91\x92\xd3" + struct.pack(">q", -(2**63)) + b"\x01",
    b"\x91\x92\xff\x01",                 # negative fixint
    b"\x91\x91\x01",                     # a pair of one
    b"\x91\x92\x01",                     # a pair announced as two, one there
    b"\x92\x93\x01\x02\x92\x03\x04\x92\x05\x06",  # [[1, 2, [3, 4]], [5, 6]]
    b"\x91\x93\x01\x02\x03",             # a pair of three
    b"\x92\x92\x01\x02",                 # two pairs announced, one there
    b"\xdd\xff\xff\xff\xff\x92\x01\x02",  # a count far past the message's end
    b"\x91\x92\x01\xc3",                 # true is not an int
    b"\x91\x92\x01\xcb" + struct.pack(">d", 3.0),
    b"\x81\x01\x02",                     # a map, not an array
    b"\xc0",                             # nil
], ids=lambda raw: raw.hex())
def test_what_decode_batch_refuses_is_refused(raw_blocks: bytes) -> None:
    kind, _ = same_answer(with_blocks(raw_blocks))
    assert kind == "malformed"


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_garbage_gets_the_same_verdict(data: bytes) -> None:
    same_answer(data)
    same_answer(with_blocks(data))


def test_other_events_and_small_messages_are_decode_batchs(monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    events: list[ev.Event] = [
        ev.WorkerRegistered("w0", "http://e", "m", 16, 100, 512, 1.0),
        ev.BlocksStored("w0", 2, 0, None, [(1, 2)], 1.0), ev.BlocksRemoved("w0", 3, 0, [1], 1.0),
        ev.AllBlocksCleared("w0", 4, 0, 1.0)]
    data = ev.encode_batch(events)
    assert same_answer(data) == ("events", events)
    monkeypatch.setattr(kv_decode, "SMALL_MESSAGE", len(data) + 1)
    assert type(kv_decode.decode_kv_batch(data)[1].blocks) is list  # type: ignore[union-attr]


def test_without_the_compiled_reader_it_is_decode_batch(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    monkeypatch.setattr(kv_decode, "_kvwire", None)
    data = ev.encode_batch([ev.BlocksStored("w0", 2, 0, None, [(1, 2)] * 40, 1.0)])
    assert type(kv_decode.decode_kv_batch(data)[0].blocks) is list  # type: ignore[union-attr]


def test_the_raw_twin_mirrors_blocks_stored() -> None:
    """Same tag, field names, wire names, defaults and order; only ``blocks`` stays raw."""
    twin, real = kv_decode.RawBlocksStored, ev.BlocksStored
    assert twin.__struct_config__.tag == real.__struct_config__.tag == "BlocksStored"
    assert (twin.__struct_config__.forbid_unknown_fields
            == real.__struct_config__.forbid_unknown_fields)
    mine = [(f.name, f.encode_name, f.default, f.type if f.name != "blocks" else None)
            for f in msgspec.structs.fields(twin)]
    theirs = [(f.name, f.encode_name, f.default, f.type if f.name != "blocks" else None)
              for f in msgspec.structs.fields(real)]
    assert mine == theirs
    assert dict((f.name, f.type) for f in msgspec.structs.fields(twin))["blocks"] is msgspec.Raw
