"""Divergence detection (pure): only replicas at equal positions are compared, each divergence is
reported once, and the test-only injection hook really moves the digest — on real RouterStates."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from eventlog import events as ev
from eventlog.names import CONTROL, KV, ROUTER
from replicas.core.divergence import (
    Divergence,
    DivergenceDetector,
    Heartbeat,
    compare,
    decode_heartbeat,
    encode_heartbeat,
    same_positions,
)
from replicas.core.state import RouterState
from tests.divergence_hook import inject_divergence
from tests.unit.test_core_purity import FORBIDDEN_MODULES, imported_roots

ROOT = Path(__file__).resolve().parents[2]


def hb(rid: str, state: RouterState, *, leader: bool = False) -> Heartbeat:
    return Heartbeat(rid, 1.0, dict(state.positions), state.digests(), True, leader)


def fed_state() -> RouterState:
    """A small state with something in every part (index, load, config)."""
    s = RouterState()
    s.apply(KV, 1, [ev.WorkerRegistered("w1", "http://w1", "m", 16, 100, 64, 1.0)])
    s.apply(KV, 2, [ev.BlocksStored("w1", 1, 0, None, [(11, 111), (12, 112)], 2.0)])
    s.apply(ROUTER, 1, [ev.RequestRouted("r1", "A", "w1", 0, 32, [5, 6], 0, 8, 0, 3.0)])
    s.apply(CONTROL, 1, [ev.SnapshotThresholdSet(100, 4.0)])
    return s


def test_module_is_pure() -> None:
    tree = ast.parse((ROOT / "replicas/core/divergence.py").read_text())
    assert not imported_roots(tree) & FORBIDDEN_MODULES


def test_equal_states_at_equal_positions_do_not_diverge() -> None:
    a, b = fed_state(), fed_state()
    assert compare(hb("A", a), {"B": hb("B", b)}) == []


@pytest.mark.parametrize("part", ["index", "load", "config"])
def test_injected_divergence_is_found_and_names_the_part(part: str) -> None:
    a, b = fed_state(), fed_state()
    before = b.digests()
    what = inject_divergence(b, part, replica_id="B")
    assert part in what
    assert b.positions == a.positions  # no event: positions did not move
    found = compare(hb("A", a), {"B": hb("B", b)})
    assert len(found) == 1
    d = found[0]
    assert (d.replica_id, d.peer_id, d.parts) == ("A", "B", (part,))
    assert d.mine == a.digests() and d.theirs == b.digests() != before
    line = d.describe()
    assert f"{a.digests()['state']:016x}" in line and f"{b.digests()['state']:016x}" in line
    assert d.to_json()["parts"] == [part]


def test_repeated_injections_keep_moving_the_digest() -> None:
    s = fed_state()
    seen = {s.digests()["state"]}
    for part in ["index", "index", "load", "load", "config", "config"]:
        inject_divergence(s, part)
        seen.add(s.digests()["state"])
    assert len(seen) == 7


def test_unknown_part_is_rejected() -> None:
    with pytest.raises(ValueError, match="part must be"):
        inject_divergence(fed_state(), "positions")


def test_different_positions_are_never_compared() -> None:
    a, b = fed_state(), fed_state()
    b.apply(ROUTER, 2, [ev.RequestFinished("r1", "ok", 8, 5.0)])  # b is one message ahead
    assert a.digests()["state"] != b.digests()["state"]
    assert compare(hb("A", a), {"B": hb("B", b)}) == []
    a.apply(ROUTER, 2, [ev.RequestFinished("r1", "ok", 8, 5.0)])  # caught up: equal again
    assert compare(hb("A", a), {"B": hb("B", b)}) == []


def test_equal_positions_on_two_streams_only_is_not_enough() -> None:
    a = Heartbeat("A", 0, {KV: 5, ROUTER: 7, CONTROL: 1}, {"state": 1, "index": 1}, True, False)
    b = Heartbeat("B", 0, {KV: 5, ROUTER: 7, CONTROL: 2}, {"state": 2, "index": 2}, True, False)
    assert compare(a, {"B": b}) == []
    assert not same_positions(a.positions, b.positions)
    # a stream missing from one heartbeat counts as position 0
    assert same_positions({KV: 0, ROUTER: 3}, {ROUTER: 3, CONTROL: 0})


def test_self_and_digestless_peers_are_skipped_and_order_is_by_peer() -> None:
    pos = {KV: 1, ROUTER: 1, CONTROL: 1}
    me = Heartbeat("A", 0, pos, {"state": 1, "index": 1}, True, True)
    peers = {
        "A": Heartbeat("A", 0, pos, {"state": 9}, True, True),  # our own entry, read back
        "C": Heartbeat("C", 0, pos, {"state": 3, "index": 3}, True, False),
        "B": Heartbeat("B", 0, pos, {"state": 2, "load": 5}, True, False),
        "D": Heartbeat("D", 0, pos, {}, True, False),  # no state digest: nothing to compare
    }
    found = compare(me, peers)
    assert [d.peer_id for d in found] == ["B", "C"]
    assert found[0].parts == ("index", "load")  # index 1 vs missing, load missing vs 5
    assert found[1].parts == ("index",)


def test_detector_reports_each_divergence_once() -> None:
    a, b = fed_state(), fed_state()
    inject_divergence(b)
    det = DivergenceDetector()
    first = det.observe(hb("A", a), {"B": hb("B", b)})
    assert len(first) == 1 and isinstance(first[0], Divergence)
    for _ in range(3):  # quiet streams: the same heartbeats every round
        assert det.observe(hb("A", a), {"B": hb("B", b)}) == []
    # the streams move on and both still differ at the new positions: a new report
    for s in (a, b):
        s.apply(CONTROL, 2, [ev.SnapshotThresholdSet(200, 6.0)])
    again = det.observe(hb("A", a), {"B": hb("B", b)})
    assert len(again) == 1 and again[0].positions[CONTROL] == 2
    assert det.total == 2 and len(det.recent) == 2


def test_heartbeat_json_round_trip_keeps_u64_digests() -> None:
    s = fed_state()
    h = hb("A", s, leader=True)
    assert max(h.digests.values()) > 2**53  # beyond a double's exact range
    assert decode_heartbeat(encode_heartbeat(h)) == h
