"""The engine kind a worker registers with (``WorkerRegistered.engine_kind``): older events and
snapshots, written before the field, read as "jetrouter"; a snapshot keeps a vLLM engine's kind
and leaves the default out (the release before the field builds its workers from exactly the
keys it knows)."""

from __future__ import annotations

import msgspec

from eventlog import events as ev
from eventlog.names import KV
from replicas.core.state import RouterState


def registered(worker_id: str, **extra: object) -> ev.WorkerRegistered:
    return ev.WorkerRegistered(worker_id, "http://e", "m", 16, 100, 8192, 1.0, **extra)


def test_an_event_without_the_field_reads_as_the_jetrouter_protocol() -> None:
    doc = msgspec.msgpack.decode(ev.encode_batch([registered("w1")]))
    for item in doc:
        item.pop("engine_kind")  # as an older bridge wrote it
    (event,) = ev.decode_batch(msgspec.msgpack.encode(doc))
    assert isinstance(event, ev.WorkerRegistered) and event.engine_kind == ev.EngineKind.JETROUTER


def test_snapshots_keep_a_vllm_engines_kind_and_leave_the_default_out() -> None:
    state = RouterState()
    state.apply(KV, 1, [registered("sim"), registered("real", role="prefill",
                                                         engine_kind=ev.EngineKind.VLLM)])
    assert state.workers["real"].engine_kind == "vllm"
    doc = msgspec.msgpack.decode(state.encode())
    keys = {w["worker_id"]: set(w) for w in doc["workers"]}
    assert "engine_kind" not in keys["sim"] and "engine_kind" in keys["real"]
    back = RouterState.decode(state.encode())
    assert back.workers["sim"].engine_kind == "jetrouter"
    assert back.workers["real"].engine_kind == "vllm"
    assert back.digests() == state.digests()
