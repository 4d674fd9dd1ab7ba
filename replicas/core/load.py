"""In-flight load per worker: active prefill tokens and active decode blocks (design.md §5).

Pure and deterministic: no clock (times arrive as arguments, taken from events), no randomness,
no I/O. Every routed request charges its worker with

- ``prefill_tokens`` until ``prefill_completed`` (the first output token), and
- its prompt's block sequence hashes as decode blocks until ``finish``. Blocks are refcounted per
  worker, so requests sharing a prefix on one worker charge the shared blocks once (the engine
  reuses those KV blocks, it does not allocate them twice).

Requests are owned by the router replica that routed them, so a lost replica frees exactly its own
requests. The digest is an order-independent sum of per-request mixes, maintained incrementally, so
two replicas that applied the same events agree on it whatever order the requests arrived in.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

WorkerKey = tuple[str, int]
"""(worker_id, dp_rank)."""

_MASK64 = (1 << 64) - 1
_PLAIN_VERSION = 2  # 1: hashes as int lists (still read); 2: hashes as "<u8" bytes
# Distinct salt so "prefill done" flips a request's contribution to an unrelated 64-bit value.
_DONE_SALT = 0x9E3779B97F4A7C15


@dataclass(slots=True)
class ActiveRequest:
    """One request in flight. Mutable only through ``ActiveLoad`` (``prefill_done``)."""

    request_id: str
    replica_id: str
    worker: WorkerKey
    prefill_tokens: int
    block_seq_hashes: tuple[int, ...]
    ts: float
    prefill_done: bool = False
    base_mix: int = 0  # hash of the immutable fields; the digest mixes in ``prefill_done``


class _WorkerLoad:
    """Aggregates for one (worker_id, dp_rank)."""

    __slots__ = ("blocks", "prefill_tokens", "requests")

    def __init__(self) -> None:
        self.prefill_tokens = 0
        self.blocks: dict[int, int] = {}  # seq hash -> number of active requests holding it
        self.requests: set[str] = set()


def _request_mix(req: ActiveRequest, hash_bytes: bytes | None = None) -> int:
    """Stable 64-bit hash of a request's immutable fields (independent of PYTHONHASHSEED).

    One xxh3 call over one buffer: per string ``<I`` length + UTF-8, then ``<qqd`` (dp rank,
    prefill tokens, ts), then ``<I`` count + ``<nQ`` block hashes. Hashing each piece through a
    streaming hasher cost a third of applying a peer's RequestRouted."""
    hashes = req.block_seq_hashes
    if hash_bytes is None:
        try:  # decoded hashes are unsigned 64-bit already; mask only what is not
            hash_bytes = struct.pack(f"<{len(hashes)}Q", *hashes)
        except struct.error:
            hash_bytes = struct.pack(f"<{len(hashes)}Q", *(x & _MASK64 for x in hashes))
    a, b, c = (t.encode() for t in (req.request_id, req.replica_id, req.worker[0]))
    head = _HEAD.pack(len(a)) + a + _HEAD.pack(len(b)) + b + _HEAD.pack(len(c)) + c
    return xxhash.xxh3_64_intdigest(
        b"".join((head, _FIXED.pack(req.worker[1], req.prefill_tokens, req.ts),
                  _HEAD.pack(len(hashes)), hash_bytes)))


_HEAD = struct.Struct("<I")
_FIXED = struct.Struct("<qqd")


def _contribution(req: ActiveRequest) -> int:
    if not req.prefill_done:
        return req.base_mix
    return xxhash.xxh3_64_intdigest(struct.pack("<QQ", req.base_mix, _DONE_SALT))


class ActiveLoad:
    """Requests in flight and the load they put on each worker."""

    def __init__(self) -> None:
        self._requests: dict[str, ActiveRequest] = {}
        self._workers: dict[WorkerKey, _WorkerLoad] = {}
        self._by_replica: dict[str, set[str]] = {}
        self._digest = 0

    # --- mutations ---------------------------------------------------------------------------

    def add(
        self,
        request_id: str,
        replica_id: str,
        worker: WorkerKey,
        prefill_tokens: int,
        block_seq_hashes: Sequence[int],
        ts: float,
    ) -> bool:
        """Charge a routed request to ``worker``. False (and no change) if already active."""
        if request_id in self._requests:
            return False
        worker = (worker[0], int(worker[1]))
        req = ActiveRequest(request_id, replica_id, worker, int(prefill_tokens),
                            tuple(block_seq_hashes), float(ts))
        req.base_mix = _request_mix(req)
        self._requests[request_id] = req
        load = self._workers.get(worker)
        if load is None:
            load = self._workers[worker] = _WorkerLoad()
        load.prefill_tokens += req.prefill_tokens
        load.requests.add(request_id)
        blocks = load.blocks
        get = blocks.get
        for h in req.block_seq_hashes:
            blocks[h] = get(h, 0) + 1
        owned = self._by_replica.get(replica_id)
        if owned is None:
            owned = self._by_replica[replica_id] = set()
        owned.add(request_id)
        self._digest = (self._digest + req.base_mix) & _MASK64
        return True

    def prefill_completed(self, request_id: str) -> bool:
        """Stop counting the request's prefill tokens. False if unknown or already completed."""
        req = self._requests.get(request_id)
        if req is None or req.prefill_done:
            return False
        self._digest = (self._digest - _contribution(req)) & _MASK64
        req.prefill_done = True
        self._digest = (self._digest + _contribution(req)) & _MASK64
        self._workers[req.worker].prefill_tokens -= req.prefill_tokens
        return True

    def finish(self, request_id: str) -> bool:
        """Free everything the request holds. False if it is not active."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        self._digest = (self._digest - _contribution(req)) & _MASK64
        load = self._workers[req.worker]
        if not req.prefill_done:
            load.prefill_tokens -= req.prefill_tokens
        load.requests.discard(request_id)
        blocks = load.blocks
        for h in req.block_seq_hashes:
            left = blocks[h] - 1
            if left:
                blocks[h] = left
            else:
                del blocks[h]
        if not load.requests:
            del self._workers[req.worker]
        owned = self._by_replica.get(req.replica_id)
        if owned is not None:
            owned.discard(request_id)
            if not owned:
                del self._by_replica[req.replica_id]
        return True

    def replica_lost(self, replica_id: str) -> list[str]:
        """Free exactly the requests owned by ``replica_id``; returns their ids, sorted."""
        return self._finish_all(self._by_replica.get(replica_id, ()))

    def _finish_all(self, request_ids: Iterable[str]) -> list[str]:
        done = sorted(request_ids)
        for request_id in done:
            self.finish(request_id)
        return done

    # --- queries -----------------------------------------------------------------------------

    def active_prefill_tokens(self, worker: WorkerKey) -> int:
        load = self._workers.get(worker)
        return load.prefill_tokens if load is not None else 0

    def active_decode_blocks(self, worker: WorkerKey) -> int:
        """Distinct blocks held by active requests on ``worker``."""
        load = self._workers.get(worker)
        return len(load.blocks) if load is not None else 0

    def active_prefix_len(self, worker: WorkerKey, seq_hashes: Sequence[int]) -> int:
        """How many leading ``seq_hashes`` are already held by active requests on ``worker``.

        Each request holds a whole prefix chain and a sequence hash determines its whole prefix,
        so membership is monotone along ``seq_hashes``: binary search needs O(log n) lookups.
        """
        load = self._workers.get(worker)
        if load is None:
            return 0
        blocks = load.blocks
        lo, hi = 0, len(seq_hashes)
        while lo < hi:
            mid = (lo + hi) >> 1
            if seq_hashes[mid] in blocks:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def workers(self) -> set[WorkerKey]:
        """Workers with at least one active request."""
        return set(self._workers)

    def replicas(self) -> set[str]:
        """Replicas that own at least one active request."""
        return {r for r, ids in self._by_replica.items() if ids}

    def owner(self, request_id: str) -> str | None:
        """Replica that routed an active request."""
        req = self._requests.get(request_id)
        return req.replica_id if req is not None else None

    def request(self, request_id: str) -> ActiveRequest | None:
        return self._requests.get(request_id)

    def __len__(self) -> int:
        return len(self._requests)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._requests

    @property
    def digest(self) -> int:
        """Order-independent 64-bit digest of the active requests (incl. their prefill state)."""
        return self._digest

    # --- snapshot encoding -------------------------------------------------------------------

    def to_plain(self) -> object:
        """Plain lists/dicts/bytes (msgpack friendly), deterministic order (by request id).

        v2 keeps each request's block hashes as one little-endian uint64 buffer: restoring
        thousands of long prompts then hashes and counts them in bulk, not int by int."""
        rows = [
            [
                r.request_id,
                r.replica_id,
                r.worker[0],
                r.worker[1],
                r.prefill_tokens,
                np.array(r.block_seq_hashes, dtype=_U64).tobytes(),
                r.ts,
                r.prefill_done,
            ]
            for r in sorted(self._requests.values(), key=lambda r: r.request_id)
        ]
        return {"v": _PLAIN_VERSION, "requests": rows}

    @classmethod
    def from_plain(cls, obj: object) -> ActiveLoad:
        if not isinstance(obj, dict) or obj.get("v") not in (1, _PLAIN_VERSION):
            raise ValueError("not an ActiveLoad snapshot (unknown format or version)")
        load = cls()
        per_worker: dict[WorkerKey, list[np.ndarray]] = {}
        for row in obj["requests"]:
            rid, replica, worker_id, rank, prefill, hashes, ts, done = row
            if isinstance(hashes, bytes):  # v2
                column = np.frombuffer(hashes, dtype=_U64)
                raw = hashes
            else:  # v1: a list of ints
                column = np.array(hashes, dtype=_U64)
                raw = column.tobytes()
            worker = (str(worker_id), int(rank))
            req = ActiveRequest(rid, replica, worker, int(prefill), tuple(column.tolist()),
                                float(ts))
            if rid in load._requests:
                raise ValueError(f"request {rid!r} appears twice in an ActiveLoad snapshot")
            req.base_mix = _request_mix(req, raw)
            load._requests[rid] = req
            wl = load._workers.get(worker)
            if wl is None:
                wl = load._workers[worker] = _WorkerLoad()
                per_worker[worker] = []
            wl.prefill_tokens += req.prefill_tokens
            wl.requests.add(rid)
            per_worker[worker].append(column)
            load._by_replica.setdefault(replica, set()).add(rid)
            load._digest = (load._digest + _contribution(req)) & _MASK64
            if done:
                load.prefill_completed(rid)
        for worker, columns in per_worker.items():  # refcounts of shared blocks, in bulk
            ids, counts = np.unique(np.concatenate(columns), return_counts=True)
            load._workers[worker].blocks = dict(zip(ids.tolist(), counts.tolist(), strict=True))
        return load


_U64 = np.dtype("<u8")
