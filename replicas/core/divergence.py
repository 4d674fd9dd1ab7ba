"""Divergence detection between replicas, from their heartbeats.

Pure: no I/O, no clock. Two replicas that have applied exactly the same messages of all three
streams must hold the same state (design.md §5), so their ``state`` digests must be equal. Live
replicas rarely sit at equal positions while events flow, but they do whenever the streams are
quiet for a heartbeat round, which is when a mismatch is caught.

``Heartbeat`` lives here (not in ``liveness.py``) because it is the pure value both sides use:
the liveness adapter publishes it, ``compare`` reads it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import msgspec

from eventlog.names import STREAM_KINDS

STATE = "state"
PARTS: tuple[str, ...] = ("index", "load", "config", "sessions", "responses")


class Heartbeat(msgspec.Struct, frozen=True):
    """What a replica publishes every heartbeat round into the ``<ns>-replicas`` KV bucket."""

    replica_id: str
    ts: float  # the sender's wall clock, for display only (liveness never compares clocks)
    positions: dict[str, int]  # last applied sequence per stream kind
    digests: dict[str, int]  # RouterState.digests(): index, load, config and their sum "state"
    ready: bool
    leader: bool
    # The sender's release: package version and the formats it writes ({"events": n,
    # "snapshots": m}). Empty from releases before they were published; a release that does not
    # know these fields ignores them (msgspec drops unknown fields), so mixed versions interoperate.
    version: str = ""
    formats: dict[str, int] = {}


class HeartbeatLike(Protocol):
    @property
    def replica_id(self) -> str: ...
    @property
    def positions(self) -> Mapping[str, int]: ...
    @property
    def digests(self) -> Mapping[str, int]: ...


_json_encoder = msgspec.json.Encoder()
_json_decoder = msgspec.json.Decoder(Heartbeat)


def encode_heartbeat(hb: Heartbeat) -> bytes:
    return _json_encoder.encode(hb)


def decode_heartbeat(data: bytes) -> Heartbeat:
    """Raise ``msgspec.DecodeError`` / ``ValidationError`` for anything that is not one."""
    return _json_decoder.decode(data)


@dataclass(frozen=True, slots=True)
class Divergence:
    """Two replicas at equal positions whose state digests differ."""

    replica_id: str  # the replica that noticed
    peer_id: str
    positions: dict[str, int]
    mine: dict[str, int]  # every digest of the noticing replica
    theirs: dict[str, int]
    parts: tuple[str, ...]  # which of index/load/config differ (other differing keys too)

    def describe(self) -> str:
        """One log line with both digests (hex) and the differing parts."""
        pos = ",".join(f"{k}={self.positions.get(k, 0)}" for k in STREAM_KINDS)
        diff = " ".join(f"{p}:{self.mine.get(p, 0):016x}!={self.theirs.get(p, 0):016x}"
                        for p in self.parts)
        return (f"replica {self.replica_id} state {self.mine.get(STATE, 0):016x} != "
                f"peer {self.peer_id} state {self.theirs.get(STATE, 0):016x} at positions "
                f"[{pos}]; differing: {diff or 'state'}")

    def to_json(self) -> dict[str, object]:
        """Plain dict for ``/admin/replicas`` (digests as hex strings: JSON loses u64 in JS)."""
        return {"replica_id": self.replica_id, "peer_id": self.peer_id,
                "positions": dict(self.positions),
                "mine": {k: f"{v:016x}" for k, v in self.mine.items()},
                "theirs": {k: f"{v:016x}" for k, v in self.theirs.items()},
                "parts": list(self.parts)}


def same_positions(a: Mapping[str, int], b: Mapping[str, int]) -> bool:
    """Equal on every stream kind (a missing kind counts as 0, i.e. nothing applied)."""
    return all(a.get(k, 0) == b.get(k, 0) for k in {*STREAM_KINDS, *a, *b})


def differing_parts(mine: Mapping[str, int], theirs: Mapping[str, int]) -> tuple[str, ...]:
    """The digest parts (other than the ``state`` sum) that differ, known parts first."""
    keys = [p for p in PARTS if p in mine or p in theirs]
    keys += sorted(k for k in {*mine, *theirs} if k not in PARTS and k != STATE)
    return tuple(k for k in keys if mine.get(k) != theirs.get(k))


def compare(mine: HeartbeatLike, peers: Mapping[str, HeartbeatLike]) -> list[Divergence]:
    """Peers at exactly ``mine``'s positions whose ``state`` digest differs, sorted by peer id.

    A peer at other positions says nothing (it has applied different messages); a peer without a
    ``state`` digest (an older or partial heartbeat) is skipped rather than guessed at.
    """
    out: list[Divergence] = []
    my_state = mine.digests.get(STATE)
    if my_state is None:
        return out
    for peer_id in sorted(peers):
        peer = peers[peer_id]
        if peer_id == mine.replica_id or not same_positions(mine.positions, peer.positions):
            continue
        their_state = peer.digests.get(STATE)
        if their_state is None or their_state == my_state:
            continue
        out.append(Divergence(mine.replica_id, peer_id, dict(mine.positions), dict(mine.digests),
                              dict(peer.digests), differing_parts(mine.digests, peer.digests)))
    return out


@dataclass(slots=True)
class DivergenceDetector:
    """``compare`` across heartbeat rounds, reporting each divergence once.

    The same two replicas stay at the same positions for as long as the streams are quiet, so
    a plain ``compare`` each round would count one divergence many times. A divergence is new
    when the pair's (positions, both state digests) differs from what was last reported for that
    peer; memory is one entry per peer.
    """

    total: int = 0
    recent: list[Divergence] = field(default_factory=list)
    keep: int = 20
    _last: dict[str, tuple[object, ...]] = field(default_factory=dict)

    def observe(self, mine: HeartbeatLike,
                peers: Mapping[str, HeartbeatLike]) -> list[Divergence]:
        new: list[Divergence] = []
        for d in compare(mine, peers):
            key = (tuple(sorted(d.positions.items())), d.mine.get(STATE), d.theirs.get(STATE))
            if self._last.get(d.peer_id) == key:
                continue
            self._last[d.peer_id] = key
            new.append(d)
        self.total += len(new)
        self.recent = (self.recent + new)[-self.keep:]
        return new
