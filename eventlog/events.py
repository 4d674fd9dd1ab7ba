"""Every fact jetrouter knows, as typed events (design.md §3).

Pure module: no I/O, no clock. Time travels inside events as ``ts`` (float seconds since the epoch,
stamped by whoever produced the event). One JetStream message carries one *batch*: a msgpack array
of tagged events, so a worker's cache changes that happened together are applied together.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import StrEnum
from typing import Annotated, Literal

import msgspec

from errors.root import JetrouterError
from eventlog.packed_pairs import PackedPairs

# Bounds every decoded event must respect. Anything else on a stream is malformed: counted and
# skipped by every replica alike, never applied
# (docs/decisions/0022-absurd-events-are-malformed.md). They keep each
# value inside what the state can hold — sizes below 2**53 so that sums of them stay exact and
# within struct's signed 64-bit packing, hashes as unsigned 64-bit (the snapshot's columns),
# timestamps finite and non-negative (a NaN or infinite ``ts`` would poison event time).
Id = Annotated[str, msgspec.Meta(min_length=1, max_length=512)]
# The largest integer / ratio an event may carry (JSON readers elsewhere hold numbers as
# doubles); the HTTP API refuses larger ones with a 400 instead of appending an event that
# every replica would skip as malformed.
MAX_COUNT = 2**53 - 1
MAX_RATIO = 1e12
Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNT)]
Seq = Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNT)]
Rank = Annotated[int, msgspec.Meta(ge=0, lt=2**16)]
Hash = Annotated[int, msgspec.Meta(ge=0)]  # msgpack carries at most 2**64 - 1
Ts = Annotated[float, msgspec.Meta(ge=0.0, le=1e11)]
Fraction = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
Ratio = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_RATIO)]
Priority = Annotated[int, msgspec.Meta(ge=-(2**31), lt=2**31)]

# A tenant's id: short, so that it can be a metric label and a subject of admin calls.
TenantId = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]

BlockPair = tuple[Hash, Hash]
"""(block_hash, tokens_hash): the engine's opaque id and jetrouter's hash of the block's tokens."""

CandidateRow = tuple[str, int, int, float, float, float, bool]
"""(worker_id, dp_rank, overlap_blocks, prefill_blocks, decode_blocks, cost, busy): one
candidate's cost terms in a routing decision, kept for the decision ledger. A decision carries
the chosen candidate's row and the cheapest others', cheapest first (``--decision-candidates``);
with 0, and in messages of releases before it, every candidate's in candidate order. Readers
take any number of rows in any order, and no replica's state reads them."""


class Outcome(StrEnum):
    """How a request (or one hop of it) ended: ``RequestFinished.outcome``. The field stays a
    plain string on the wire, so an outcome a newer producer adds is carried, not malformed."""

    OK = "ok"
    ERROR = "error"
    CANCELLED = "cancelled"
    MIGRATED = "migrated"      # a hop moved to another engine; the request goes on
    EXPIRED = "expired"
    NOT_ROUTED = "not_routed"  # the decision's append failed; closed in case it landed later


class Role(StrEnum):
    """What an engine does in disaggregated serving: ``WorkerRegistered.role``. See
    replicas/core/disagg.py."""

    PREFILL = "prefill"  # computes prompts and hands their KV blocks over
    DECODE = "decode"    # receives KV blocks and generates
    BOTH = "both"        # everything (the only kind before disaggregation)


class EngineKind(StrEnum):
    """Which engine software serves a worker: ``WorkerRegistered.engine_kind``. It decides the
    protocol of the KV hand-off in disaggregated serving (api/forward/prefill.py)."""

    JETROUTER = "jetrouter"  # the simulated engine: POST /v1/prefill and a jetrouter handle
    VLLM = "vllm"            # kv_transfer_params on /v1/completions and /v1/chat/completions
    SGLANG = "sglang"


class Phase(StrEnum):
    """Which of a request's routing decisions a ``RequestRouted`` is."""

    AGGREGATED = ""      # an ordinary decision: one engine prefills and decodes
    PREFILL = "prefill"  # the engine computing the prompt of a disaggregated request
    DECODE = "decode"    # the engine receiving its KV blocks and generating


class _Event(msgspec.Struct, frozen=True, tag=True, array_like=False, omit_defaults=False):
    pass


# --- KV stream: jr.kv.<worker_id> -------------------------------------------------------------


class WorkerRegistered(_Event, frozen=True, tag=True):
    worker_id: Id
    url: str
    model: str
    block_size: Annotated[int, msgspec.Meta(ge=1, le=2**16)]
    kv_total_blocks: Count
    max_num_batched_tokens: Count
    ts: Ts
    dp_size: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 1
    # LoRA adapters the engine serves besides ``model`` (requests naming one route here, and
    # their blocks hash under the adapter's salt: eventlog.hashing.adapter_salt).
    loras: list[str] = []
    # What the engine does in disaggregated serving: "prefill" engines compute prompts and hand
    # their KV blocks over, "decode" engines receive them and generate, "both" does everything
    # (the only kind before disaggregation; older events decode as it).
    role: str = Role.BOTH  # a Role
    # The engine software (an EngineKind; the bridge finds it in the engine's /metrics). Older
    # events decode as "jetrouter", the only hand-off protocol routers spoke before.
    engine_kind: Annotated[str, msgspec.Meta(max_length=32)] = EngineKind.JETROUTER
    # An SGLang prefill engine's bootstrap server port (--disaggregation-bootstrap-port), which
    # the router names to both engines of a hand-off (api/forward/sglang_handoff.py); 0: not
    # given. Releases before the field skip it (msgspec ignores unknown fields) and serve such
    # an engine's requests as they did before; the state leaves it out of its digest.
    bootstrap_port: Annotated[int, msgspec.Meta(ge=0, lt=2**16)] = 0


class WorkerRetired(_Event, frozen=True, tag=True):
    worker_id: Id
    reason: str
    ts: Ts


class BlocksStored(_Event, frozen=True, tag=True):
    worker_id: Id
    event_id: Seq
    dp_rank: Rank
    parent_hash: Hash | None
    blocks: list[BlockPair]
    ts: Ts
    # Storage tier the blocks went to; None = the device (GPU) tier. Only device blocks count
    # for prefix overlap (replicas/core/state.py): others are carried, counted and not indexed.
    medium: str | None = None


class BlocksRemoved(_Event, frozen=True, tag=True):
    worker_id: Id
    event_id: Seq
    dp_rank: Rank
    block_hashes: list[Hash]
    ts: Ts
    medium: str | None = None  # tier the blocks left; None = the device (GPU) tier


class AllBlocksCleared(_Event, frozen=True, tag=True):
    worker_id: Id
    event_id: Seq
    dp_rank: Rank
    ts: Ts


# --- Router stream: jr.router.<replica_id> ----------------------------------------------------


class RequestRouted(_Event, frozen=True, tag=True):
    request_id: Id
    replica_id: Id
    worker_id: Id
    dp_rank: Rank
    isl_tokens: Count
    block_seq_hashes: list[Hash]
    overlap_blocks: Count
    expected_osl: Count
    priority: Priority
    ts: Ts
    candidates: list[CandidateRow] = []
    model: str = ""
    # Tokens per block the decision was made with (0: not recorded, older messages), so the
    # predicted reuse in tokens is overlap_blocks * block_size wherever the event is read.
    block_size: Annotated[int, msgspec.Meta(ge=0, le=2**16)] = 0
    # Disaggregated serving: "prefill" is the decision that picked the engine computing the
    # prompt, "decode" the one that picked the engine receiving its KV blocks; "" is an ordinary
    # (aggregated) decision. ``kv_reuse`` False (--no-router-assume-kv-reuse) makes a decode
    # decision's blocks count as this request's own, never shared with another request's.
    phase: str = Phase.AGGREGATED  # a Phase
    kv_reuse: bool = True
    # Output blocks tracked for this request (--router-track-output-blocks of the replica that
    # routed it), weighted by progress toward ``osl_hint`` (nvext.agent_hints.osl; 0: none given,
    # full weight). Progress arrives as ``OutputProgress``.
    track_output_blocks: bool = False
    osl_hint: Count = 0
    # How its prefill load decays (--router-prefill-load-model): "none" or "linear"; any other
    # value (a model a newer replica knows) counts as "none".
    prefill_load_model: Annotated[str, msgspec.Meta(max_length=32)] = "none"
    # The tenant the request was admitted for ("": none, and every older message) and the
    # tokens its admission reserved against the tenant's tokens-per-minute budget (prompt +
    # max_tokens; 0 on a later hop of the same request, which was admitted once).
    tenant: Annotated[str, msgspec.Meta(max_length=128)] = ""
    tenant_tokens: Count = 0
    # A decode decision's KV hand-off: the blocks its engine receives from the prefill hop
    # (vLLM: the remote block ids the prefill answer names; SGLang: the prompt's blocks), for
    # the decision ledger. -1: not a hand-off, or an older message. No replica's state reads
    # it, so releases before the field (which skip it) compute the same state.
    transfer_blocks: Annotated[int, msgspec.Meta(ge=-1, le=MAX_COUNT)] = -1


class PrefillCompleted(_Event, frozen=True, tag=True):
    request_id: Id
    ts: Ts


class OutputProgress(_Event, frozen=True, tag=True):
    """A tracked request's generation crossed a block boundary: ``output_tokens`` so far."""

    request_id: Id
    output_tokens: Count
    ts: Ts


class RequestFinished(_Event, frozen=True, tag=True):
    request_id: Id
    outcome: str  # an Outcome
    output_tokens: Count
    ts: Ts
    # Prompt tokens the engine reports it served from its prefix cache
    # (usage.prompt_tokens_details.cached_tokens); -1 = the engine did not say (older messages).
    cached_tokens: Annotated[int, msgspec.Meta(ge=-1, lt=2**53)] = -1
    # When the request's first token came, for a request whose PrefillCompleted was folded into
    # this event (it had not been written yet when the request ended: one event instead of two).
    # None: a PrefillCompleted was written on its own, or the request never produced a token.
    prefill_ts: Ts | None = None


class ReplicaLost(_Event, frozen=True, tag=True):
    replica_id: Id
    ts: Ts


class SessionPinned(_Event, frozen=True, tag=True):
    """A sticky session is (still) on this engine: appended in the same message as the decision
    of each of its turns, so the pin and the decision land together or not at all. ``ttl`` is a
    sliding window in event time from ``ts`` (replicas/core/sessions.py)."""

    session_id: Id
    worker_id: Id
    dp_rank: Rank
    model: str
    ttl: Annotated[float, msgspec.Meta(gt=0.0, le=1e9)]
    ts: Ts
    request_id: str = ""  # the decision this pin came with
    # "open" | "bind" (a client's turn), "repin" (the pinned engine was retired or unhealthy)
    reason: str = "bind"


class SessionReleased(_Event, frozen=True, tag=True):
    session_id: Id
    reason: str  # "closed" (the client's last turn) | "engine_gone"
    ts: Ts


class ResponseStored(_Event, frozen=True, tag=True):
    """An engine stored a Responses API response (``store`` true, the default): a later request
    naming it as ``previous_response_id`` can only be answered by that engine, which holds the
    conversation. ``ttl`` is a window in event time from ``ts``, as for a session pin
    (replicas/core/stored_responses.py)."""

    response_id: Id
    worker_id: Id
    dp_rank: Rank
    model: str
    ttl: Annotated[float, msgspec.Meta(gt=0.0, le=1e9)]
    ts: Ts
    request_id: str = ""  # the routing decision that produced the response


# --- Control stream: jr.control.<kind> --------------------------------------------------------


class BusyThresholdsSet(_Event, frozen=True, tag=True):
    model: str
    active_decode_blocks_threshold: Fraction | None
    active_prefill_tokens_threshold: Count | None
    active_prefill_tokens_threshold_frac: Ratio | None
    ts: Ts


class SnapshotThresholdSet(_Event, frozen=True, tag=True):
    threshold: Annotated[int, msgspec.Meta(ge=1, le=MAX_COUNT)]
    ts: Ts


class SnapshotTaken(_Event, frozen=True, tag=True):
    snapshot_id: str
    positions: dict[str, Seq]
    size: Count
    sha256: str
    created_by: str
    trigger: str
    ts: Ts


class StateReset(_Event, frozen=True, tag=True):
    """Clear the index and the load. `positions` are the KV and router stream sequences the reset
    cuts at: messages at or below them belong to the old epoch (they are purged), messages above
    them to the new one, whatever order a replica happens to apply the streams in."""

    epoch: Seq
    reason: str
    ts: Ts
    positions: dict[str, Seq] = {}


class WorkerHealthChanged(_Event, frozen=True, tag=True):
    worker_id: Id
    status: Literal["healthy", "suspicious", "unhealthy"]
    reason: str
    ts: Ts


class TenantLimitsSet(_Event, frozen=True, tag=True):
    """A tenant's limits, replacing any earlier ones (replicas/core/tenants.py). None: no limit
    of that kind. ``weight`` is its share under fair queueing; ``isolated`` keeps its prompts'
    cache apart from other tenants'."""

    tenant: TenantId
    requests_per_minute: Count | None
    tokens_per_minute: Count | None
    max_concurrent: Count | None
    weight: Annotated[float, msgspec.Meta(gt=0.0, le=1e6)]
    isolated: bool
    ts: Ts
    # An isolated tenant's prompts go to engines with this as vLLM's cache_salt, and the router
    # hashes them under it: drawn at random when isolation is first set, so no other client
    # can name it; the same on every replica because it travels here.
    cache_salt: Annotated[str, msgspec.Meta(max_length=128)] = ""


class TenantDeleted(_Event, frozen=True, tag=True):
    tenant: TenantId
    ts: Ts


# SHA-256 of an API key, lowercase hex: the key itself never travels or is stored.
KeySha256 = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$")]


class ApiKeySet(_Event, frozen=True, tag=True):
    """The API key whose SHA-256 is ``key_sha256`` names ``tenant`` (api/tenancy.py). The key
    is shown once to whoever created it through the admin API; only its digest is kept."""

    key_sha256: KeySha256
    tenant: TenantId
    ts: Ts


class ApiKeyRevoked(_Event, frozen=True, tag=True):
    key_sha256: KeySha256
    ts: Ts


KvEvent = WorkerRegistered | WorkerRetired | BlocksStored | BlocksRemoved | AllBlocksCleared
RouterEvent = (
    RequestRouted | PrefillCompleted | OutputProgress | RequestFinished | ReplicaLost
    | SessionPinned | SessionReleased | ResponseStored
)
ControlEvent = (
    BusyThresholdsSet | SnapshotThresholdSet | SnapshotTaken | StateReset | WorkerHealthChanged
    | TenantLimitsSet | TenantDeleted | ApiKeySet | ApiKeyRevoked
)
Event = KvEvent | RouterEvent | ControlEvent

Batch = list[Event]


class MalformedMessage(JetrouterError, ValueError):
    """A stream message that is not a valid batch of events (garbage bytes or wrong schema)."""


def _encode_other(obj: object) -> object:
    """Blocks a reader left packed (``kv_decode.py``) are encoded as the list they equal."""
    if isinstance(obj, PackedPairs):
        return list(obj)
    raise NotImplementedError(f"cannot encode {type(obj).__name__} in an event")


_encoder = msgspec.msgpack.Encoder(enc_hook=_encode_other)
_decoder = msgspec.msgpack.Decoder(list[Event])


def encode_batch(events: list[Event] | tuple[Event, ...]) -> bytes:
    """Encode events as one stream message (a msgpack array of tagged maps)."""
    return _encoder.encode(list(events))


Decode = Callable[[bytes], list[Event]]
"""How a reader decodes a message: ``decode_batch``, or one that gives what it gives."""


def decode_batch(data: bytes) -> list[Event]:
    """Decode one stream message; raise :class:`MalformedMessage` if it is not a batch."""
    try:
        return _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise MalformedMessage(str(exc)) from exc
