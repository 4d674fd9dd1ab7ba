"""Hypothesis strategies for stream messages: garbage bytes, random msgpack, and events that
are schema-valid (or nearly) but absurd — negative sizes, unknown workers, ids out of range,
NaN and infinite timestamps, huge lists. Shared by the pure-core fuzz test and the live one."""

from __future__ import annotations

import re
from typing import Any

import msgspec
from hypothesis import strategies as st

from eventlog import events as ev
from eventlog.names import CONTROL, KV, ROUTER

i64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
u64 = st.integers(min_value=0, max_value=2**64 - 1)
ints = (st.integers(0, 64) | i64 | u64
        | st.sampled_from([0, -1, 1, 2**31, 2**32, 2**53, 2**63 - 1, 2**64 - 1, -(2**63)]))
floats = (st.floats(0, 2e9) | st.floats()
          | st.sampled_from([float("nan"), float("inf"), -float("inf"), -1.0, 1e300]))
ids = st.sampled_from(["w0", "r0", "r1", "ghost", "", "w0 ", "*", "healthy", "unhealthy",
                       "suspicious"]) | st.text(max_size=12)
strings = ids | st.text(max_size=30)
plain = st.recursive(st.none() | st.booleans() | ints | floats | strings | st.binary(max_size=20),
                     lambda inner: st.lists(inner, max_size=4)
                     | st.dictionaries(strings, inner, max_size=4), max_leaves=10)


def field_values(annotation: Any) -> st.SearchStrategy[Any]:
    """Values for one event field: of its type but absurd, or of another type altogether."""
    # Judge by the plain type: the events' bounds (Annotated[int, Meta(...)]) are what the
    # values here are meant to break.
    text = re.sub(r"typing\.Annotated\[(\w+), msgspec\.Meta\([^)]*\)\]", r"\1", str(annotation))
    text = re.sub(r"typing\.Optional\[(.*)\]$", r"\1 | None", text)
    text = text.replace("typing.Literal", "str")
    if "list[tuple[int, int]]" in text or "BlockPair" in text:
        typed: st.SearchStrategy[Any] = st.lists(st.tuples(ints, ints), max_size=20)
    elif "list[tuple[str" in text or "CandidateRow" in text:
        typed = st.lists(st.tuples(ids, ints, ints, floats, floats, floats, st.booleans()),
                         max_size=3)
    elif "list[int]" in text:
        typed = st.lists(ints, max_size=30)
    elif "dict[str, int]" in text:
        typed = st.dictionaries(st.sampled_from([KV, ROUTER, CONTROL, "x"]), ints, max_size=3)
    elif "float" in text:
        typed = floats | st.floats(min_value=1e9, max_value=2e9)
    elif "int" in text:
        typed = ints
    else:
        typed = strings
    if "None" in text:
        typed = typed | st.none()
    return typed


EVENT_TYPES = [ev.WorkerRegistered, ev.WorkerRetired, ev.BlocksStored, ev.BlocksRemoved,
               ev.AllBlocksCleared, ev.RequestRouted, ev.PrefillCompleted, ev.RequestFinished,
               ev.ReplicaLost, ev.BusyThresholdsSet, ev.SnapshotThresholdSet, ev.SnapshotTaken,
               ev.StateReset, ev.WorkerHealthChanged, ev.ResponseStored, ev.TenantLimitsSet,
               ev.TenantDeleted, ev.ApiKeySet, ev.ApiKeyRevoked]


_FIELD_VALUES = {cls: [(f.encode_name, field_values(f.type)) for f in msgspec.structs.fields(cls)]
                 for cls in EVENT_TYPES}


@st.composite
def absurd_event(draw: st.DrawFn, well_typed: bool) -> dict[str, Any]:
    """One event as a tagged map: every field of its type but absurd (``well_typed``), or now
    and then a field missing, of another type, or unknown."""
    cls = draw(st.sampled_from(EVENT_TYPES))
    doc: dict[str, Any] = {"type": cls.__name__}
    for name, values in _FIELD_VALUES[cls]:
        damage = 0 if well_typed else draw(st.integers(0, 30))
        if damage == 1:
            continue  # a missing field
        doc[name] = draw(plain if damage == 2 else values)
    if not well_typed and draw(st.integers(0, 7)) == 0:
        doc[draw(st.text(min_size=1, max_size=6))] = draw(plain)  # an unknown field
    return doc


def pack(value: Any) -> bytes:
    return msgspec.msgpack.encode(value)


payloads = st.integers(0, 9).flatmap(lambda n: (
    st.binary(max_size=300) if n == 0 else plain.map(pack) if n == 1
    else st.lists(absurd_event(well_typed=n > 4), min_size=1, max_size=3).map(pack)))
