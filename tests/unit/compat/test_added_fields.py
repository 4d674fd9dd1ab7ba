"""Optional fields added to events without a new format (eventlog/wire.py, design.md §3).

``WorkerRegistered.bootstrap_port`` (an SGLang prefill engine's bootstrap server) and
``RequestRouted.transfer_blocks`` (a decode decision's KV hand-off, for the ledger) change no
state a replica computes, so they are no format change: a replica of the release before them
decodes the events (msgspec skips fields it does not know), applies the same state and reports
the same digests; it loads a snapshot that holds a bootstrap port (kept beside the worker
entries, whose keys it builds its workers from); and it serves an SGLang prefill engine's
requests as it did before (its prefill hop fails, the request is served aggregated).
"""

from __future__ import annotations

import msgspec

from eventlog import events as ev
from eventlog.names import KV, ROUTER
from replicas.core.state import RouterState, WorkerInfo
from tests.unit.compat.earlier_worker_registered import PreviousWorkerRegistered

# The keys a worker's snapshot entry had before bootstrap_port: the release before builds
# WorkerInfo(**entry) from exactly these.
PREVIOUS_WORKER_KEYS = {"worker_id", "url", "model", "block_size", "kv_total_blocks",
                        "max_num_batched_tokens", "dp_size", "registered_ts", "loras", "role",
                        "engine_kind"}


class PreviousRequestRouted(msgspec.Struct, frozen=True, tag="RequestRouted"):
    """The leading fields of RequestRouted as the release before transfer_blocks had them."""

    request_id: str
    replica_id: str
    worker_id: str
    phase: str = ""
    tenant_tokens: int = 0


def sglang_prefill(port: int) -> ev.WorkerRegistered:
    return ev.WorkerRegistered("p0", "http://10.0.0.7:30000", "m", 16, 100, 8192, 1.0,
                               role="prefill", engine_kind="sglang", bootstrap_port=port)


def decode_decision(blocks: int) -> ev.RequestRouted:
    return ev.RequestRouted("q", "r1", "p0", 0, 40, [1, 2], 0, 8, 0, 2.0, model="m",
                            block_size=16, phase="decode", transfer_blocks=blocks)


def test_the_release_before_decodes_the_new_fields_away() -> None:
    old = msgspec.msgpack.decode(ev.encode_batch([sglang_prefill(8998), decode_decision(3)]),
                                 type=list[PreviousWorkerRegistered | PreviousRequestRouted])
    assert isinstance(old[0], PreviousWorkerRegistered) and old[0].engine_kind == "sglang"
    assert isinstance(old[1], PreviousRequestRouted) and old[1].phase == "decode"


def test_an_older_message_reads_with_the_defaults() -> None:
    doc = msgspec.msgpack.decode(ev.encode_batch([sglang_prefill(8998), decode_decision(3)]))
    doc[0].pop("bootstrap_port")
    doc[1].pop("transfer_blocks")
    worker, routed = ev.decode_batch(msgspec.msgpack.encode(doc))
    assert isinstance(worker, ev.WorkerRegistered) and worker.bootstrap_port == 0
    assert isinstance(routed, ev.RequestRouted) and routed.transfer_blocks == -1


def test_the_new_fields_change_no_digest() -> None:
    with_fields, without = RouterState(), RouterState()
    with_fields.apply(KV, 1, [sglang_prefill(8998)])
    without.apply(KV, 1, [sglang_prefill(0)])
    with_fields.apply(ROUTER, 1, [decode_decision(3)])
    without.apply(ROUTER, 1, [decode_decision(-1)])
    assert with_fields.workers["p0"].bootstrap_port == 8998
    assert with_fields.digests() == without.digests()


def test_a_snapshot_keeps_the_port_beside_the_worker_entries() -> None:
    state = RouterState()
    state.apply(KV, 1, [sglang_prefill(8998)])
    doc = msgspec.msgpack.decode(state.encode())
    (entry,) = doc["workers"]
    assert set(entry) == PREVIOUS_WORKER_KEYS  # the release before builds its worker from it
    WorkerInfo(**entry)
    assert doc["bootstrap_ports"] == {"p0": 8998}
    back = RouterState.decode(state.encode())
    assert back.workers["p0"].bootstrap_port == 8998
    assert back.digests() == state.digests()
    doc.pop("bootstrap_ports")  # a snapshot written before the field
    assert RouterState.decode(msgspec.msgpack.encode(doc)).workers["p0"].bootstrap_port == 0
