"""A compact state's snapshot bytes with the index's columns written apart from msgspec
(state_codec.msgpack_columns_apart): the same object as msgspec's own encoding, at every msgpack
size boundary of a column, and the same state back."""

from __future__ import annotations

import random

import msgspec
import pytest

from eventlog.names import KV
from replicas.core.state import RouterState, StateConfig
from replicas.core.state_codec import msgpack_columns_apart
from tests.eventgen import interleave, worker_history

SIZES = [0, 1, 255, 256, 65535, 65536, 70000]


@pytest.mark.parametrize("columns", [1, 15, 16, 17])
def test_the_same_object_as_msgspec_writes(columns: int) -> None:
    rng = random.Random(columns)
    plain = {"version": 5, "slots": [["w", 0, 1, 3, 4]], "checksums": [1, 2],
             "columns": {f"c{i}": rng.randbytes(SIZES[i % len(SIZES)]) for i in range(columns)},
             "expiry": []}
    doc = {"format": 5, "index": None, "positions": {"kv": 3}, "load": [[1, 2.5], "x"]}
    raw = msgpack_columns_apart(doc, "index", plain)
    assert msgspec.msgpack.decode(raw) == {**doc, "index": plain}
    assert msgspec.msgpack.decode(raw) == msgspec.msgpack.decode(
        msgspec.msgpack.encode({**doc, "index": plain}))


@pytest.mark.parametrize("plain", [None, {"version": 2, "workers": []},
                                   {"columns": {"a": [1, 2]}}])
def test_anything_else_is_msgspecs_own_encoding(plain: object) -> None:
    doc = {"format": 2, "index": None}
    assert msgpack_columns_apart(doc, "index", plain) == msgspec.msgpack.encode(
        {**doc, "index": plain})


def test_a_compact_state_encoded_so_decodes_to_the_same_state() -> None:
    rng = random.Random(4)
    state = RouterState(StateConfig(index_form="compact"))
    batches = interleave(rng, [worker_history(rng, f"w{i}", 80) for i in range(4)])
    for seq, batch in enumerate(batches, 1):
        state.apply(KV, seq, batch)
    raw = state.encode()
    doc = msgspec.msgpack.decode(raw)
    assert list(doc)[-1] == "index" and list(doc["index"])[-1] == "columns"
    assert RouterState.decode(raw, state.config).digests() == state.digests()
