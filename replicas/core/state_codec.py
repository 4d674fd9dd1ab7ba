"""A router state as a snapshot: one msgpack blob, and back (design.md §8).

``RouterState.encoder`` / ``encode`` / ``decode`` (``state.py``) call these. Pure: no I/O; the
snapshot store (``snapshots/store.py``) compresses, checksums and stores the bytes.

Formats. The state carries its format in the blob (``format``); the store records it in the
object meta too, so a reader can pass over a snapshot it cannot read without fetching it. The
promise (``eventlog/wire.py``): this format and the one before are read, a newer one raises
``NewerFormat``; ``tests/unit/compat/test_golden_fixtures.py`` loads a snapshot the previous
release wrote. A state is written in the *oldest* format that carries it (``snapshot_format``),
so the previous release keeps loading what this one writes:

* 1 — the first; still read, so a replica upgraded in place restores its predecessors' blobs;
* 2 — columnar index and load (``index_codec.py``, ``load.py``);
* 3 — adds API keys (tenants): written only while a key is set;
* 4 — the compact index as its arrays (``index_arrays.py``, index v4), written only by
  replicas running ``--router-index-form compact``; a release before it skips such a snapshot as
  newer and falls back to an older one;
* 5 — the same arrays packed (index v5: ~0.9 byte a pair less) with XXH3 checksums, so that
  the snapshot store keeps it uncompressed (``snapshots/store.py``: zlib saved ~6 % on these
  random hashes and cost ~0.5 s of inflating at 10 M pairs on the way to ``/ready``). Written by
  compact-form replicas in place of 4; a release reading only up to 4 passes over it as newer.
* 6 — the same without the node table's cells (index v6: ~0.45 byte a pair less): the node
  table is loaded in bulk from the owners' sequence hashes, and the other rows name their
  node's owner by its ordinal. Written by compact-form replicas in place of 5 (which is still
  read); a release reading only up to 5 passes over it as newer.

Decoding reads the blob's top level as raw slices and the compact index's columns as views of
the blob (``index_arrays.plain_from_msgpack``), not copies: at 10 M pairs that is ~160 MB not
copied and ~40 k page faults not taken on the way to ``/ready``.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, Protocol

import msgspec

from eventlog.names import KV, STREAM_KINDS
from eventlog.wire import NewerFormat
from replicas.core import index as compact_index
from replicas.core import index_arrays
from replicas.core.ended import EndedRequests
from replicas.core.index_capture import IndexChanged
from replicas.core.load import ActiveLoad
from replicas.core.selection import BusyThresholds
from replicas.core.sessions import SessionTable
from replicas.core.stored_responses import StoredResponses
from replicas.core.tenants import TenantBook
from replicas.core.worker_info import WorkerInfo

SNAPSHOT_FORMAT = 6  # the newest state format written (see the module docstring)
READABLE_FORMATS = (1, 2, 3, 4, 5, 6)


class RouterState(Protocol):
    """What encoding and decoding read and fill of ``replicas.core.state.RouterState`` (which
    calls them), as a port, so the two modules do not import each other."""

    index: Any  # either index form: both have plain_encoder and from_plain
    load: ActiveLoad
    sessions: SessionTable
    responses: StoredResponses
    tenants: TenantBook
    positions: dict[str, int]
    epoch: int
    now: float
    workers: dict[str, WorkerInfo]
    lost_workers: dict[str, WorkerInfo]
    refused_workers: dict[str, WorkerInfo]
    thresholds: dict[str, BusyThresholds]
    snapshot_threshold: int | None
    health: dict[str, str]
    last_event_id: dict[str, int]
    out_of_sync: set[str]
    snapshot_floor: dict[str, int]
    _expiry: list[tuple[float, str]]
    _ended: EndedRequests
    _routed_ts: dict[str, float]


def snapshot_format(state: RouterState) -> int:
    """The oldest state format that carries this state: 3 adds API keys (tenants), so a state
    without any is written as format 2, which the previous release reads; 6 is the compact
    index's packed arrays (index_arrays.py), so a compact-form state is always format 6."""
    if isinstance(state.index, compact_index.PrefixIndex):
        return 6
    return 3 if state.tenants.keys else 2


def encoder(state: RouterState, *, copy: bool = True) -> Callable[[], bytes]:
    """Capture the state now and return a function that encodes that capture.

    Capturing is cheap next to encoding (the reference index's per-worker maps are
    shallow-copied at C speed, ~20 ms per million blocks; the compact index's cells ~15-20 ms
    per million pairs; the rest is small); the returned function does the heavy part (columns,
    msgpack) on the copies only, so it may run in a worker thread while this state keeps
    applying events on the event loop. Call it with no ``await`` between reading
    ``positions`` and capturing, so the snapshot and its positions agree."""
    return _encoder(state, state.index.plain_encoder(copy=copy))


class Capture(NamedTuple):
    """A state being captured for a snapshot (``capture``): iterate ``steps`` to the end, then
    call ``encode`` (in a worker thread if you like) for the snapshot's bytes."""

    steps: Iterator[None]
    encode: Callable[[], bytes]


def capture(state: RouterState) -> Capture:
    """Capture the state for a snapshot, its largest part — the prefix index — in steps.

    Everything but the index is captured now (call it with no ``await`` after reading
    ``positions``); the index is copied by iterating ``steps`` (a few ms each: the compact
    form's tables, ``index_capture.py``, or the reference form's maps, one worker's a step,
    ``index_reference_capture.py``). The snapshot is the state at those positions only if the
    index does not change until the last step: the caller holds the KV stream meanwhile
    (outside approximate mode the only stream that changes the index); the last step raises
    ``IndexChanged`` if a KV message was applied all the same. In approximate mode (where the
    router stream and the passing of event time change the index too) the index is captured
    whole now, and ``steps`` is empty."""
    index = state.index
    if index.approximate:
        return Capture(iter(()), encoder(state))
    copies = index.plain_capture()
    kv_at = state.positions[KV]

    def steps() -> Iterator[None]:
        yield from copies.steps()
        if state.positions[KV] != kv_at:
            raise IndexChanged(f"KV messages {kv_at + 1}-{state.positions[KV]} were applied "
                               f"while the prefix index was copied for a snapshot")

    return Capture(steps(), _encoder(state, copies.build))


def _encoder(state: RouterState, index_plain: Callable[[], object]) -> Callable[[], bytes]:
    """Capture all but the index now; the returned function encodes it with ``index_plain()``."""
    doc: dict[str, object] = {
        "format": snapshot_format(state),
        "epoch": state.epoch,
        "now": state.now,
        "positions": dict(state.positions),
        "workers": [worker_doc(w) for w in state.workers.values()],
        "lost_workers": [worker_doc(w) for w in state.lost_workers.values()],
        "refused_workers": [worker_doc(w) for w in state.refused_workers.values()],
        "thresholds": {m: [t.active_decode_blocks_threshold, t.active_prefill_tokens_threshold,
                           t.active_prefill_tokens_threshold_frac]
                       for m, t in state.thresholds.items()},
        "snapshot_threshold": state.snapshot_threshold,
        "health": dict(state.health),
        "last_event_id": dict(state.last_event_id),
        "out_of_sync": sorted(state.out_of_sync),
        "index": None,  # filled in by the returned function
        "load": state.load.to_plain(),
        "sessions": state.sessions.to_plain(),
        "responses": state.responses.to_plain(),
        "tenants": state.tenants.to_plain(),
        # Only live entries: finished requests linger in the heap until they age out.
        "expiry": sorted(x for x in state._expiry if state.load.request(x[1]) is not None),
        # Replicas of earlier versions read "ended" (id -> routed ts): left empty for them,
        # they only miss the duplicate guard for what ended before the snapshot.
        "ended": {},
        "ended_buckets": state._ended.to_plain(),
        "snapshot_floor": dict(state.snapshot_floor),
        # Beside the workers, not in their entries: see worker_doc.
        "bootstrap_ports": {w.worker_id: w.bootstrap_port for w in state.workers.values()
                            if w.bootstrap_port},
    }

    def encode() -> bytes:
        return msgpack_columns_apart(doc, "index", index_plain())

    return encode


def msgpack_columns_apart(doc: dict[str, object], key: str, plain: object) -> bytes:
    """``msgspec.msgpack.encode({**doc, key: plain})``, the same object, with ``plain``'s
    ``columns`` (a compact index's: ~165 MB at 10 M pairs) written apart: msgspec holds the GIL
    for all it copies (~0.1 s at 10 M pairs, an event-loop stall although it runs in a worker
    thread) where ``bytes.join`` lets it go for large copies. ``key`` comes last in the map and
    ``columns`` last in ``plain`` (decoders read maps by key)."""
    columns = plain.get("columns") if isinstance(plain, dict) else None
    if not isinstance(columns, dict) or not all(
            isinstance(v, bytes | bytearray) for v in columns.values()):
        return msgspec.msgpack.encode({**doc, key: plain})
    assert isinstance(plain, dict)
    top = {k: v for k, v in doc.items() if k != key}
    top[key] = {**{k: v for k, v in plain.items() if k != "columns"}, "columns": None}
    head = msgspec.msgpack.encode(top)  # ends with the nil of "columns", replaced below
    assert head[-1:] == b"\xc0"
    parts: list[bytes | bytearray] = [head[:-1], _map_header(len(columns))]
    for name, value in columns.items():
        parts += [msgspec.msgpack.encode(name), _bin_header(len(value)), value]
    return b"".join(parts)


def _map_header(n: int) -> bytes:
    return bytes([0x80 | n]) if n < 16 else b"\xde" + n.to_bytes(2, "big")


def _bin_header(n: int) -> bytes:
    if n < 1 << 8:
        return b"\xc4" + n.to_bytes(1, "big")
    return b"\xc5" + n.to_bytes(2, "big") if n < 1 << 16 else b"\xc6" + n.to_bytes(4, "big")


def restore(state: RouterState, data: bytes) -> None:
    """Fill a fresh state (``RouterState(config)``) from a snapshot's bytes; its index form
    is the config's."""
    top = msgspec.msgpack.decode(data, type=dict[str, msgspec.Raw])
    doc = {k: msgspec.msgpack.decode(v) for k, v in top.items() if k != "index"}
    doc["index"] = index_arrays.plain_from_msgpack(top["index"]) if "index" in top else None
    if isinstance(doc.get("format"), int) and doc["format"] > SNAPSHOT_FORMAT:
        raise NewerFormat("snapshot", doc["format"], SNAPSHOT_FORMAT)
    if doc.get("format") not in READABLE_FORMATS:
        raise ValueError(f"unsupported state format {doc.get('format')!r}")
    state.epoch = doc["epoch"]
    state.now = doc["now"]
    state.positions = {k: int(doc["positions"].get(k, 0)) for k in STREAM_KINDS}
    state.workers = {w["worker_id"]: WorkerInfo(**w) for w in doc["workers"]}
    state.lost_workers = {w["worker_id"]: WorkerInfo(**w) for w in doc.get("lost_workers", [])}
    state.refused_workers = {w["worker_id"]: WorkerInfo(**w)
                             for w in doc.get("refused_workers", [])}
    for worker_id, port in doc.get("bootstrap_ports", {}).items():  # absent in older blobs
        if worker_id in state.workers:
            state.workers[worker_id].bootstrap_port = port
    state.thresholds = {m: BusyThresholds(*t) for m, t in doc["thresholds"].items()}
    state.snapshot_threshold = doc["snapshot_threshold"]
    state.health = dict(doc["health"])
    state.last_event_id = dict(doc["last_event_id"])
    state.out_of_sync = set(doc["out_of_sync"])
    state.index = type(state.index).from_plain(doc["index"])
    state.load = ActiveLoad.from_plain(doc["load"])
    state.sessions = SessionTable.from_plain(doc.get("sessions", []))  # absent in older blobs
    state.responses = StoredResponses.from_plain(doc.get("responses", []))  # likewise
    state.tenants = TenantBook.from_plain(doc.get("tenants"))  # likewise
    state._expiry = [tuple(x) for x in doc["expiry"]]  # type: ignore[misc]
    heapq.heapify(state._expiry)
    state._routed_ts = {rid: ts for ts, rid in state._expiry}
    state._ended = (EndedRequests.from_plain(doc["ended_buckets"]) if "ended_buckets" in doc
                    else EndedRequests.from_ids(doc["ended"]))  # older blobs: id -> ts
    state.snapshot_floor = dict(doc.get("snapshot_floor", {}))  # absent in older blobs


def worker_doc(w: WorkerInfo) -> dict[str, object]:
    """A worker in a snapshot. ``engine_kind`` is left out while it is the default, so a
    snapshot of a fleet without vLLM or SGLang engines is one the release before the field
    reads (it builds WorkerInfo from exactly these keys); decoding fills the default back in.
    ``bootstrap_port`` is never in the entry: the snapshot keeps the live workers' ports in a
    map of its own (``bootstrap_ports``), a key the release before the field does not read, so
    that release still loads the snapshot (and serves SGLang prefill engines as it did)."""
    doc = {name: getattr(w, name) for name in w.__slots__}
    del doc["bootstrap_port"]
    if w.engine_kind == "jetrouter":
        del doc["engine_kind"]
    return doc
