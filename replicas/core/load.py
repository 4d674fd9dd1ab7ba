"""In-flight load per worker: active prefill tokens and active decode blocks (design.md §5).

Pure and deterministic: no clock (times arrive as arguments, taken from events), no randomness,
no I/O. Every routed request charges its worker with

- ``prefill_tokens`` until ``prefill_completed`` (the first output token), and
- its prompt's block sequence hashes as decode blocks until ``finish``. Blocks are refcounted per
  worker, so requests sharing a prefix on one worker charge the shared blocks once (the engine
  reuses those KV blocks, it does not allocate them twice);
- with output-block tracking (``--router-track-output-blocks``), placeholder decode blocks for
  its output: one per block boundary generation has crossed (``output_progress``), each weighted
  by what is left of the expected output length (``nvext.agent_hints.osl``; full weight without
  one). Weights are kept in integer thousandths of a block, so sums are exact in any order.

With ``--router-prefill-load-model linear`` a request's prefill tokens also decay while it is
the oldest modeled prefill on its worker rank (``replicas.core.prefill_model``): pass the event
time to ``active_prefill_tokens``.

The same figures are also kept as columns by slot, with each active block's holder bitmask once
a decision asks for them (``replicas.core.load_columns``): what a decision over hundreds of loaded
ranks reads instead of asking each rank. The per-rank methods here stay the reference.

Requests are owned by the router replica that routed them, so a lost replica frees exactly its own
requests. The digest is an order-independent sum of per-request mixes, maintained incrementally, so
two replicas that applied the same events agree on it whatever order the requests arrived in.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, KeysView, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

import numpy as np
import xxhash

from replicas.core.load_columns import LoadColumns
from replicas.core.prefill_model import WorkerPrefill

WorkerKey = tuple[str, int]
"""(worker_id, dp_rank)."""

_MASK64 = (1 << 64) - 1
# 1: hashes as int lists (still read); 2: hashes as "<u8" bytes; 3: + output tracking, the
# prefill model per request and the learned prefill figures per worker rank.
_PLAIN_VERSION = 3
_READABLE = (1, 2, _PLAIN_VERSION)
# Distinct salt so "prefill done" flips a request's contribution to an unrelated 64-bit value.
_DONE_SALT = 0x9E3779B97F4A7C15
MILLI = 1000  # output-block weights are counted in thousandths of a block


@dataclass(frozen=True, slots=True)
class OutputTracking:
    """What a request's output blocks are judged by: its prompt length and block size (where the
    block boundaries fall) and the client's expected output length (0: none given)."""

    isl_tokens: int
    block_size: int
    osl_hint: int = 0


def output_blocks(isl_tokens: int, output_tokens: int, block_size: int) -> int:
    """Block boundaries the sequence crossed while generating ``output_tokens``."""
    return (isl_tokens + output_tokens) // block_size - isl_tokens // block_size


def output_block_milli(track: OutputTracking, output_tokens: int) -> int:
    """A request's weighted output blocks, in thousandths of a block: each placeholder block
    weighs what is left of the expected output (``1 - generated / osl``, floored at 0), so a
    request near its end counts little future load; without an expected length, full weight."""
    blocks = output_blocks(track.isl_tokens, output_tokens, track.block_size)
    if blocks <= 0:
        return 0
    if track.osl_hint <= 0:
        return blocks * MILLI
    left = max(track.osl_hint - output_tokens, 0)
    return blocks * MILLI * left // track.osl_hint


@dataclass(slots=True)
class ActiveRequest:
    """One request in flight. Mutable only through ``ActiveLoad`` (``prefill_done``,
    ``output_tokens``)."""

    request_id: str
    replica_id: str
    worker: WorkerKey
    prefill_tokens: int
    block_seq_hashes: tuple[int, ...]
    ts: float
    prefill_done: bool = False
    base_mix: int = 0  # hash of the immutable fields; the digest mixes in the mutable ones
    output: OutputTracking | None = None  # None: output blocks not tracked
    output_tokens: int = 0  # generated so far, as the last ``output_progress`` reported
    modeled: bool = False  # its prefill decays (``--router-prefill-load-model linear``)


class _WorkerLoad:
    """Aggregates for one (worker_id, dp_rank), and its slot in the columns (load_columns.py)."""

    __slots__ = ("bit", "blocks", "output_milli", "prefill_tokens", "requests", "slot")

    def __init__(self, slot: int) -> None:
        self.prefill_tokens = 0
        self.output_milli = 0  # weighted output blocks, thousandths
        self.blocks: dict[int, int] = {}  # seq hash -> number of active requests holding it
        self.requests: set[str] = set()
        self.slot = slot
        self.bit = 1 << slot


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
    parts = [head, _FIXED.pack(req.worker[1], req.prefill_tokens, req.ts),
             _HEAD.pack(len(hashes)), hash_bytes]
    out = req.output
    if out is not None or req.modeled:  # absent for requests routed without either
        parts.append(_TRACKING.pack(out is not None,
                                    *((out.isl_tokens, out.block_size, out.osl_hint)
                                      if out else (0, 0, 0)), req.modeled))
    return xxhash.xxh3_64_intdigest(b"".join(parts))


_HEAD = struct.Struct("<I")
_FIXED = struct.Struct("<qqd")
_TRACKING = struct.Struct("<?qqq?")


def _contribution(req: ActiveRequest) -> int:
    if req.output_tokens:
        return xxhash.xxh3_64_intdigest(struct.pack(
            "<QQq", req.base_mix, _DONE_SALT if req.prefill_done else 0, req.output_tokens))
    if not req.prefill_done:
        return req.base_mix
    return xxhash.xxh3_64_intdigest(struct.pack("<QQ", req.base_mix, _DONE_SALT))


class ActiveLoad:
    """Requests in flight and the load they put on each worker."""

    def __init__(self) -> None:
        self._requests: dict[str, ActiveRequest] = {}
        self._workers: dict[WorkerKey, _WorkerLoad] = {}
        # The same figures as columns by slot, and each active block's holders (a decision
        # over hundreds of loaded ranks reads these, not each rank's aggregates).
        self._columns = LoadColumns()
        # Ranks with modeled prefills pending: their prefill reads depend on the time asked.
        self._decaying: set[WorkerKey] = set()
        self._by_replica: dict[str, set[str]] = {}
        self._digest = 0
        # Learned prefill throughput and the decaying anchor, per worker rank; kept when the
        # rank goes idle (what was learned stays true).
        self._prefill: dict[WorkerKey, WorkerPrefill] = {}
        # Per worker rank, the replica whose request last left its prefill (first token, or
        # an end before it): whose opening it made (replicas.core.release_turns). A hint for
        # turn-taking only: not in the digest nor in snapshots (a replica that restored one
        # lacks it until the next prefill ends there, and releases at once meanwhile).
        self._freed_by: dict[WorkerKey, str] = {}
        # Per replica, the ts of the newest decision it routed: the replicas that take turns.
        # The same kind of hint: not in the digest nor in snapshots.
        self._routed_at: dict[str, float] = {}

    # --- mutations ---------------------------------------------------------------------------

    def add(
        self,
        request_id: str,
        replica_id: str,
        worker: WorkerKey,
        prefill_tokens: int,
        block_seq_hashes: Sequence[int],
        ts: float,
        *,
        output: OutputTracking | None = None,
        modeled: bool = False,
    ) -> bool:
        """Charge a routed request to ``worker``. False (and no change) if already active.
        ``output``: track its output blocks; ``modeled``: decay its prefill (linear model)."""
        if request_id in self._requests:
            return False
        worker = (worker[0], int(worker[1]))
        if output is not None and output.block_size < 1:
            raise ValueError("output tracking needs a block size of at least 1")
        req = ActiveRequest(request_id, replica_id, worker, int(prefill_tokens),
                            tuple(block_seq_hashes), float(ts), output=output, modeled=modeled)
        req.base_mix = _request_mix(req)
        self._requests[request_id] = req
        columns = self._columns
        load = self._workers.get(worker)
        if load is None:
            load = self._workers[worker] = _WorkerLoad(columns.assign(worker))
        load.prefill_tokens += req.prefill_tokens
        load.requests.add(request_id)
        blocks = load.blocks
        get = blocks.get
        holders = columns.holders
        if holders is None:  # not kept (yet): nothing asked for them
            for h in req.block_seq_hashes:
                blocks[h] = get(h, 0) + 1
        else:
            hold = holders.setdefault
            bit = load.bit
            for h in req.block_seq_hashes:
                count = get(h)
                if count is None:
                    blocks[h] = 1
                    # most blocks have one holder: they share the rank's bit, allocating nothing
                    mask = hold(h, bit)
                    if mask is not bit:
                        holders[h] = mask | bit
                else:
                    blocks[h] = count + 1
        columns.prefill_view[load.slot] = load.prefill_tokens
        columns.blocks_view[load.slot] = len(blocks)
        owned = self._by_replica.get(replica_id)
        if owned is None:
            owned = self._by_replica[replica_id] = set()
        owned.add(request_id)
        self._routed_at[replica_id] = req.ts  # stream order: near enough to the newest
        self._digest = (self._digest + _contribution(req)) & _MASK64
        if modeled and req.prefill_tokens > 0:
            self._start_modeled(worker, request_id, req.ts)
        return True

    def _start_modeled(self, worker: WorkerKey, request_id: str, ts: float) -> None:
        self._prefill_of(worker).start(request_id, ts)
        self._decaying.add(worker)

    def _leave_modeled(self, worker: WorkerKey, request_id: str) -> None:
        wp = self._prefill_of(worker)
        wp.leave(request_id)
        if not wp.pending_ids:
            self._decaying.discard(worker)

    def _prefill_of(self, worker: WorkerKey) -> WorkerPrefill:
        wp = self._prefill.get(worker)
        if wp is None:
            wp = self._prefill[worker] = WorkerPrefill()
        return wp

    def prefill_completed(self, request_id: str, ts: float | None = None) -> bool:
        """Stop counting the request's prefill tokens. False if unknown or already completed.
        With ``ts`` (the first token's event time) the worker rank learns from it how fast it
        prefills."""
        req = self._requests.get(request_id)
        if req is None or req.prefill_done:
            return False
        self._set_progress(req, True, req.output_tokens)
        load = self._workers[req.worker]
        load.prefill_tokens -= req.prefill_tokens
        self._columns.prefill_view[load.slot] = load.prefill_tokens
        self._freed_by[req.worker] = req.replica_id
        if ts is not None and req.prefill_tokens > 0:
            self._prefill_of(req.worker).observe(request_id, req.prefill_tokens, req.ts,
                                                 float(ts))
        if req.modeled and req.prefill_tokens > 0:
            self._leave_modeled(req.worker, request_id)
        return True

    def output_progress(self, request_id: str, output_tokens: int) -> bool:
        """The request has generated ``output_tokens``. False (no change) if it is unknown, its
        output is not tracked, or the count does not advance."""
        req = self._requests.get(request_id)
        if req is None or req.output is None or output_tokens <= req.output_tokens:
            return False
        load = self._workers[req.worker]
        load.output_milli -= output_block_milli(req.output, req.output_tokens)
        self._set_progress(req, req.prefill_done, int(output_tokens))
        load.output_milli += output_block_milli(req.output, req.output_tokens)
        self._columns.milli_view[load.slot] = load.output_milli
        return True

    def _set_progress(self, req: ActiveRequest, prefill_done: bool, output_tokens: int) -> None:
        self._digest = (self._digest - _contribution(req)) & _MASK64
        req.prefill_done = prefill_done
        req.output_tokens = output_tokens
        self._digest = (self._digest + _contribution(req)) & _MASK64

    def finish(self, request_id: str) -> bool:
        """Free everything the request holds. False if it is not active."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        self._digest = (self._digest - _contribution(req)) & _MASK64
        load = self._workers[req.worker]
        if req.output is not None:
            load.output_milli -= output_block_milli(req.output, req.output_tokens)
        if not req.prefill_done:
            load.prefill_tokens -= req.prefill_tokens
            self._freed_by[req.worker] = req.replica_id
            if req.modeled and req.prefill_tokens > 0:
                self._leave_modeled(req.worker, request_id)
        load.requests.discard(request_id)
        blocks = load.blocks
        columns = self._columns
        holders = columns.holders
        if holders is None:
            for h in req.block_seq_hashes:
                left = blocks[h] - 1
                if left:
                    blocks[h] = left
                else:
                    del blocks[h]
        else:
            unhold = holders.pop
            bit = load.bit
            for h in req.block_seq_hashes:
                left = blocks[h] - 1
                if left:
                    blocks[h] = left
                else:
                    del blocks[h]
                    mask = unhold(h)
                    if mask != bit:
                        holders[h] = mask ^ bit
        if not load.requests:
            del self._workers[req.worker]
            columns.release(load.slot)
        else:
            slot = load.slot
            columns.prefill_view[slot] = load.prefill_tokens
            columns.blocks_view[slot] = len(blocks)
            columns.milli_view[slot] = load.output_milli
        owned = self._by_replica.get(req.replica_id)
        if owned is not None:
            owned.discard(request_id)
            if not owned:
                del self._by_replica[req.replica_id]
        return True

    def replica_lost(self, replica_id: str) -> list[str]:
        """Free exactly the requests owned by ``replica_id``; returns their ids, sorted."""
        self._routed_at.pop(replica_id, None)
        return self._finish_all(self._by_replica.get(replica_id, ()))

    def _finish_all(self, request_ids: Iterable[str]) -> list[str]:
        done = sorted(request_ids)
        for request_id in done:
            self.finish(request_id)
        return done

    # --- queries -----------------------------------------------------------------------------

    def active_prefill_tokens(self, worker: WorkerKey, now: float | None = None) -> float:
        """Prompt tokens still to prefill on ``worker``. With ``now`` (event time), the oldest
        modeled prefill counts only what its predicted duration leaves of it at ``now``."""
        load = self._workers.get(worker)
        if load is None:
            return 0
        tokens = load.prefill_tokens
        if now is None:
            return tokens
        wp = self._prefill.get(worker)
        if wp is None:
            return tokens
        anchor = wp.anchor()
        if anchor is None:
            return tokens
        held = self._requests[anchor[1]].prefill_tokens
        return tokens - held + wp.remaining(held, anchor, now)

    def active_decode_blocks(self, worker: WorkerKey) -> float:
        """Distinct prompt blocks held by active requests on ``worker``, plus their weighted
        output blocks when those are tracked (a float then)."""
        load = self._workers.get(worker)
        if load is None:
            return 0
        if load.output_milli:
            return len(load.blocks) + load.output_milli / MILLI
        return len(load.blocks)

    def active_output_blocks(self, worker: WorkerKey) -> float:
        """The weighted output blocks alone."""
        load = self._workers.get(worker)
        return load.output_milli / MILLI if load is not None else 0.0

    def prefill_throughput(self, worker: WorkerKey) -> float | None:
        """Prompt tokens per second ``worker`` was seen to prefill (None: nothing learned)."""
        wp = self._prefill.get(worker)
        return wp.throughput() if wp is not None else None

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

    @property
    def columns(self) -> LoadColumns:
        """The loaded ranks' figures as columns by slot, and each active block's holders: what
        ``active_prefill_tokens`` (without ``now``), ``active_decode_blocks`` and
        ``active_prefix_len`` answer, for every loaded rank at once (load_columns.py). Read
        only."""
        return self._columns

    def prefix_groups(self, seq_hashes: Sequence[int]) -> list[tuple[int, int]]:
        """Every loaded rank's ``active_prefix_len`` of ``seq_hashes`` at once, as
        ``(slot mask, length)`` groups (``LoadColumns.prefix_groups``). The first call starts
        keeping the blocks' holder bitmasks, built here from the ranks' blocks; from then on
        every event keeps them (until then no event pays for them)."""
        columns = self._columns
        if columns.holders is None:
            holders: dict[int, int] = {}
            hold = holders.setdefault
            for wl in self._workers.values():
                bit = wl.bit
                for h in wl.blocks:
                    mask = hold(h, bit)
                    if mask is not bit:
                        holders[h] = mask | bit
            columns.holders = holders
        return columns.prefix_groups(seq_hashes)

    def decaying_workers(self) -> AbstractSet[WorkerKey]:
        """The ranks whose ``active_prefill_tokens`` depends on ``now`` (a modeled prefill is
        pending there): for every other rank it is its prefill column. A live view."""
        return self._decaying

    def loaded_workers(self) -> KeysView[WorkerKey]:
        """The worker ranks with requests in flight (a live view: every other rank's load is 0
        and it holds no active block)."""
        return self._workers.keys()

    def workers(self) -> set[WorkerKey]:
        """Workers with at least one active request."""
        return set(self._workers)

    def replicas(self) -> set[str]:
        """Replicas that own at least one active request."""
        return {r for r, ids in self._by_replica.items() if ids}

    def routed_since(self, ts: float) -> set[str]:
        """Replicas that routed a decision at ``ts`` or later (event time), or own one still
        active; older entries are forgotten."""
        for replica in [r for r, at in self._routed_at.items() if at < ts]:
            del self._routed_at[replica]
        return {*self._routed_at, *self.replicas()}

    def prefilling(self, worker: WorkerKey) -> list[str]:
        """The requests on ``worker`` whose prompt is still being computed."""
        load, requests = self._workers.get(worker), self._requests
        return [r for r in load.requests if not requests[r].prefill_done
                and requests[r].prefill_tokens > 0] if load is not None else []

    def freed_by(self, worker: WorkerKey) -> str | None:
        """The replica whose request last left ``worker``'s prefill (None: none seen)."""
        return self._freed_by.get(worker)

    def owned(self, replica_id: str) -> int:
        """Active requests routed by ``replica_id``."""
        return len(self._by_replica.get(replica_id, ()))

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
        """Order-independent 64-bit digest of the active requests (incl. their prefill and
        output progress) and of the learned prefill figures per worker rank."""
        d = self._digest
        for (worker_id, rank), wp in self._prefill.items():
            if wp.done:
                d += xxhash.xxh3_64_intdigest(struct.pack("<Q", wp.digest) + worker_id.encode(),
                                              seed=rank)
        return d & _MASK64

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
                None if r.output is None else [r.output.isl_tokens, r.output.block_size,
                                               r.output.osl_hint, r.output_tokens],
                r.modeled,
            ]
            for r in sorted(self._requests.values(), key=lambda r: r.request_id)
        ]
        prefill = [[w[0], w[1], wp.plain()] for w, wp in sorted(self._prefill.items()) if wp.done]
        return {"v": _PLAIN_VERSION, "requests": rows, "prefill": prefill}

    @classmethod
    def from_plain(cls, obj: object) -> ActiveLoad:
        if not isinstance(obj, dict) or obj.get("v") not in _READABLE:
            raise ValueError("not an ActiveLoad snapshot (unknown format or version)")
        load = cls()
        for worker_id, rank, completions in obj.get("prefill", ()):
            load._prefill[(str(worker_id), int(rank))] = WorkerPrefill.from_plain(completions)
        per_worker: dict[WorkerKey, list[np.ndarray]] = {}
        for row in obj["requests"]:
            rid, replica, worker_id, rank, prefill, hashes, ts, done = row[:8]
            out, modeled = row[8:10] if len(row) >= 10 else (None, False)
            if isinstance(hashes, bytes):  # v2
                column = np.frombuffer(hashes, dtype=_U64)
                raw = hashes
            else:  # v1: a list of ints
                column = np.array(hashes, dtype=_U64)
                raw = column.tobytes()
            worker = (str(worker_id), int(rank))
            req = ActiveRequest(rid, replica, worker, int(prefill), tuple(column.tolist()),
                                float(ts), modeled=bool(modeled))
            if out is not None:
                isl, block_size, osl_hint, generated = out
                req.output = OutputTracking(int(isl), int(block_size), int(osl_hint))
                req.output_tokens = int(generated)
            if rid in load._requests:
                raise ValueError(f"request {rid!r} appears twice in an ActiveLoad snapshot")
            req.base_mix = _request_mix(req, raw)
            load._requests[rid] = req
            wl = load._workers.get(worker)
            if wl is None:
                wl = load._workers[worker] = _WorkerLoad(load._columns.assign(worker))
                per_worker[worker] = []
            wl.prefill_tokens += req.prefill_tokens
            wl.requests.add(rid)
            if req.output is not None:
                wl.output_milli += output_block_milli(req.output, req.output_tokens)
            per_worker[worker].append(column)
            load._by_replica.setdefault(replica, set()).add(rid)
            load._digest = (load._digest + _contribution(req)) & _MASK64
            if done:
                load.prefill_completed(rid)
            elif req.modeled and req.prefill_tokens > 0:
                load._start_modeled(worker, rid, req.ts)
        for worker, columns in per_worker.items():  # refcounts of shared blocks, in bulk
            ids, counts = np.unique(np.concatenate(columns), return_counts=True)
            wl = load._workers[worker]
            wl.blocks = dict(zip(ids.tolist(), counts.tolist(), strict=True))
            load._columns.prefill_view[wl.slot] = wl.prefill_tokens
            load._columns.blocks_view[wl.slot] = len(wl.blocks)
            load._columns.milli_view[wl.slot] = wl.output_milli
        return load


_U64 = np.dtype("<u8")
