"""Every fact jetrouter knows, as typed events (design.md §3).

Pure module: no I/O, no clock. Time travels inside events as ``ts`` (float seconds since the epoch,
stamped by whoever produced the event). One JetStream message carries one *batch*: a msgpack array
of tagged events, so a worker's cache changes that happened together are applied together.
"""

from __future__ import annotations

import msgspec

BlockPair = tuple[int, int]
"""(block_hash, tokens_hash): the engine's opaque id and jetrouter's hash of the block's tokens."""

CandidateRow = tuple[str, int, int, float, float, float, bool]
"""(worker_id, dp_rank, overlap_blocks, prefill_blocks, decode_blocks, cost, busy): one
candidate's cost terms in a routing decision, kept for the decision ledger."""


class _Event(msgspec.Struct, frozen=True, tag=True, array_like=False, omit_defaults=False):
    pass


# --- KV stream: jr.kv.<worker_id> -------------------------------------------------------------


class WorkerRegistered(_Event, frozen=True, tag=True):
    worker_id: str
    url: str
    model: str
    block_size: int
    kv_total_blocks: int
    max_num_batched_tokens: int
    ts: float
    dp_size: int = 1
    # LoRA adapters the engine serves besides ``model`` (requests naming one route here, and
    # their blocks hash under the adapter's salt: eventlog.hashing.adapter_salt).
    loras: list[str] = []


class WorkerRetired(_Event, frozen=True, tag=True):
    worker_id: str
    reason: str
    ts: float


class BlocksStored(_Event, frozen=True, tag=True):
    worker_id: str
    event_id: int
    dp_rank: int
    parent_hash: int | None
    blocks: list[BlockPair]
    ts: float
    # Storage tier the blocks went to; None = the device (GPU) tier. Only device blocks count
    # for prefix overlap (replicas/state.py): others are carried, counted and not indexed.
    medium: str | None = None


class BlocksRemoved(_Event, frozen=True, tag=True):
    worker_id: str
    event_id: int
    dp_rank: int
    block_hashes: list[int]
    ts: float
    medium: str | None = None  # tier the blocks left; None = the device (GPU) tier


class AllBlocksCleared(_Event, frozen=True, tag=True):
    worker_id: str
    event_id: int
    dp_rank: int
    ts: float


# --- Router stream: jr.router.<replica_id> ----------------------------------------------------


class RequestRouted(_Event, frozen=True, tag=True):
    request_id: str
    replica_id: str
    worker_id: str
    dp_rank: int
    isl_tokens: int
    block_seq_hashes: list[int]
    overlap_blocks: int
    expected_osl: int
    priority: int
    ts: float
    candidates: list[CandidateRow] = []
    model: str = ""
    # Tokens per block the decision was made with (0: not recorded, older messages), so the
    # predicted reuse in tokens is overlap_blocks * block_size wherever the event is read.
    block_size: int = 0


class PrefillCompleted(_Event, frozen=True, tag=True):
    request_id: str
    ts: float


class RequestFinished(_Event, frozen=True, tag=True):
    request_id: str
    outcome: str  # "ok" | "error" | "cancelled" | "migrated" | "expired"
    output_tokens: int
    ts: float
    # Prompt tokens the engine reports it served from its prefix cache
    # (usage.prompt_tokens_details.cached_tokens); -1 = the engine did not say (older messages).
    cached_tokens: int = -1


class ReplicaLost(_Event, frozen=True, tag=True):
    replica_id: str
    ts: float


# --- Control stream: jr.control.<kind> --------------------------------------------------------


class BusyThresholdsSet(_Event, frozen=True, tag=True):
    model: str
    active_decode_blocks_threshold: float | None
    active_prefill_tokens_threshold: int | None
    active_prefill_tokens_threshold_frac: float | None
    ts: float


class SnapshotThresholdSet(_Event, frozen=True, tag=True):
    threshold: int
    ts: float


class SnapshotTaken(_Event, frozen=True, tag=True):
    snapshot_id: str
    positions: dict[str, int]
    size: int
    sha256: str
    created_by: str
    trigger: str
    ts: float


class StateReset(_Event, frozen=True, tag=True):
    """Clear the index and the load. `positions` are the KV and router stream sequences the reset
    cuts at: messages at or below them belong to the old epoch (they are purged), messages above
    them to the new one, whatever order a replica happens to apply the streams in."""

    epoch: int
    reason: str
    ts: float
    positions: dict[str, int] = {}


class WorkerHealthChanged(_Event, frozen=True, tag=True):
    worker_id: str
    status: str  # "healthy" | "suspicious" | "unhealthy"
    reason: str
    ts: float


KvEvent = WorkerRegistered | WorkerRetired | BlocksStored | BlocksRemoved | AllBlocksCleared
RouterEvent = RequestRouted | PrefillCompleted | RequestFinished | ReplicaLost
ControlEvent = (
    BusyThresholdsSet | SnapshotThresholdSet | SnapshotTaken | StateReset | WorkerHealthChanged
)
Event = KvEvent | RouterEvent | ControlEvent

Batch = list[Event]


class MalformedMessage(ValueError):
    """A stream message that is not a valid batch of events (garbage bytes or wrong schema)."""


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(list[Event])


def encode_batch(events: list[Event] | tuple[Event, ...]) -> bytes:
    """Encode events as one stream message (a msgpack array of tagged maps)."""
    return _encoder.encode(list(events))


def decode_batch(data: bytes) -> list[Event]:
    """Decode one stream message; raise :class:`MalformedMessage` if it is not a batch."""
    try:
        return _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise MalformedMessage(str(exc)) from exc
