"""Compact-form snapshots written by the code that wrote their formats still restore: state
format 4 (index v4: tests/fixtures/compact-v4/) and format 5 (index v5: tests/fixtures/compact-v5/,
written at c3c5e65), both made by tests/fixtures/make_compact_v4.py. Each restores to the digests
and answers recorded when it was written, and to the same state once written again in the
current format (6) and read back: a replica upgraded in place restores from either. A damaged v5
column is refused by name."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from replicas.core.index_arrays import PLAIN_VERSION_V4, PLAIN_VERSION_V5, PLAIN_VERSION_V6
from replicas.core.state import RouterState, StateConfig
from replicas.core.state_codec import SNAPSHOT_FORMAT

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
CONFIG = StateConfig(index_form="compact")
# state format -> (fixture folder, its index version)
WRITTEN = {4: ("compact-v4", PLAIN_VERSION_V4), 5: ("compact-v5", PLAIN_VERSION_V5)}
Written = tuple[int, bytes, dict[str, Any]]


@pytest.fixture(scope="module", params=sorted(WRITTEN), ids=lambda f: f"format {f}")
def written(request: pytest.FixtureRequest) -> Written:
    folder = FIXTURES / WRITTEN[request.param][0]
    raw = (folder / "snapshot.bin").read_bytes()
    meta = json.loads((folder / "snapshot.json").read_text())
    assert len(raw) == meta["size"] and hashlib.sha256(raw).hexdigest() == meta["sha256"]
    return request.param, raw, meta


def _hex(state: RouterState) -> dict[str, str]:
    return {k: f"{v:016x}" for k, v in state.digests().items()}


def _answers(state: RouterState, meta: dict[str, Any]) -> list[list[list[object]]]:
    return [sorted([w, r, n] for (w, r), n in state.index.find_matches(
        [int(s) for s in a["seqs"]]).scores.items()) for a in meta["answers"]]


def test_it_is_in_its_format(written: Written) -> None:
    fmt, raw, meta = written
    doc = msgspec.msgpack.decode(raw)
    assert meta["format"] == doc["format"] == fmt
    assert doc["index"]["version"] == WRITTEN[fmt][1]
    if fmt == 5:
        assert "codes" in doc["index"]["columns"]  # the node table's cells, which v6 leaves out


def test_it_restores_to_what_was_recorded(written: Written) -> None:
    _, raw, meta = written
    state = RouterState.decode(raw, CONFIG)
    assert _hex(state) == meta["digests"]
    assert state.positions == meta["positions"]
    assert state.index.total_blocks == meta["total_blocks"]
    assert _answers(state, meta) == [a["scores"] for a in meta["answers"]]


def test_written_again_in_the_current_format_it_restores_the_same(written: Written) -> None:
    _, raw, meta = written
    state = RouterState.decode(raw, CONFIG)
    again = state.encode()
    doc = msgspec.msgpack.decode(again)
    assert doc["format"] == SNAPSHOT_FORMAT == 6
    assert doc["index"]["version"] == PLAIN_VERSION_V6
    assert len(again) < len(raw)  # v6 packs rows (v4) and leaves out the node codes (v5)
    back = RouterState.decode(again, CONFIG)
    assert _hex(back) == meta["digests"]
    assert _answers(back, meta) == [a["scores"] for a in meta["answers"]]


@pytest.mark.parametrize("column", ["ids", "own", "seqs", "codes", "refs", "occ", "shared_rows",
                                    "shared_masks", "dup_slots", "dup_seqs", "dup_counts"])
def test_a_damaged_v5_column_is_refused(column: str) -> None:
    raw = (FIXTURES / "compact-v5" / "snapshot.bin").read_bytes()
    doc = msgspec.msgpack.decode(raw)
    damaged = bytearray(doc["index"]["columns"][column])
    assert damaged, column  # the fixture has every column
    damaged[len(damaged) // 2] ^= 1
    doc["index"]["columns"][column] = bytes(damaged)
    with pytest.raises(ValueError, match=f"v5 PrefixIndex column '{column}' fails its checksum"):
        RouterState.decode(msgspec.msgpack.encode(doc), CONFIG)
