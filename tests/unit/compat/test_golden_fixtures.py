"""Stream messages and a snapshot written by the previous release decode with this code.

The fixtures (tests/fixtures/golden-*/, README.md there) were encoded by an earlier release's
own code; this test is the compatibility promise of eventlog/wire.py run in CI: every event
type of that release decodes to the same field values, the same messages applied here give the
digests that release computed, and its snapshot loads to the digests recorded when it was
written. A change that breaks any of these breaks rolling upgrades and rollbacks.
"""

from __future__ import annotations

import base64
import hashlib
import json
import zlib
from pathlib import Path
from typing import Any

import msgspec
import pytest

from eventlog import events as ev
from eventlog.wire import check_message
from replicas.core.state import RouterState, StateConfig

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
RELEASES = sorted(p for p in FIXTURES.glob("golden-*") if p.is_dir())


def _hex(digests: dict[str, int]) -> dict[str, str]:
    return {k: f"{v:016x}" for k, v in digests.items()}


def _contains(new: Any, old: Any) -> bool:
    """``new`` carries every value ``old`` had (fields added since may come with defaults)."""
    if isinstance(old, dict):
        return isinstance(new, dict) and all(k in new and _contains(new[k], v)
                                             for k, v in old.items())
    if isinstance(old, list):
        return isinstance(new, list) and len(new) == len(old) and all(
            _contains(n, o) for n, o in zip(new, old, strict=True))
    return bool(new == old)


@pytest.fixture(params=RELEASES, ids=[p.name for p in RELEASES])
def release(request: pytest.FixtureRequest) -> Path:
    return Path(request.param)


def test_there_is_a_previous_release_to_check() -> None:
    assert RELEASES, f"no golden fixtures under {FIXTURES}"


def test_every_event_type_decodes_to_the_values_it_was_written_with(release: Path) -> None:
    doc = json.loads((release / "messages.json").read_text())
    current = {cls.__name__ for cls in ev.Event.__args__}  # type: ignore[attr-defined]
    assert set(doc["event_types"]) <= current, "an event type of an earlier release is gone"
    seen: set[str] = set()
    for m in doc["messages"]:
        assert check_message(m.get("headers"), m["stream"], m["seq"]) == 1
        events = ev.decode_batch(base64.b64decode(m["data"]))
        new = json.loads(json.dumps(msgspec.to_builtins(events)))  # tuples as lists
        assert _contains(new, m["decoded"]), (m["stream"], m["seq"], new, m["decoded"])
        seen |= {type(e).__name__ for e in events}
    assert seen == set(doc["event_types"])


def test_the_same_messages_give_the_digests_that_release_computed(release: Path) -> None:
    doc = json.loads((release / "messages.json").read_text())
    state = RouterState(StateConfig(block_size=16))
    for m in doc["messages"]:  # in the order the writer applied them
        state.apply(m["stream"], m["seq"], ev.decode_batch(base64.b64decode(m["data"])))
    assert state.positions == doc["positions_after_apply"]
    assert _same_digests(_hex(state.digests()), doc["digests_after_apply"])


def test_its_snapshot_loads_with_the_digests_recorded_when_written(release: Path) -> None:
    meta = json.loads((release / "snapshot.json").read_text())
    raw = zlib.decompress((release / "snapshot.zlib").read_bytes())
    assert len(raw) == meta["size"] and hashlib.sha256(raw).hexdigest() == meta["sha256"]
    state = RouterState.decode(raw, StateConfig(block_size=16))
    assert state.epoch == meta["epoch"] and state.positions == meta["positions"]
    assert _same_digests(_hex(state.digests()), meta["digests"])
    # Written again by this release, it still loads to the same state.
    again = RouterState.decode(state.encode(), StateConfig(block_size=16))
    assert _same_digests(_hex(again.digests()), meta["digests"])


def _same_digests(now: dict[str, str], then: dict[str, str]) -> bool:
    """Every part the old release digested is equal; a part added since (state that release
    did not have) is empty, so it digests to zero."""
    added = {part: value for part, value in now.items() if part not in then}
    return {part: now[part] for part in then} == then and \
        all(value == "0" * 16 for value in added.values())
