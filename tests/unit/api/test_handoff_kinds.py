"""The KV hand-off per engine kind (api/forward/handoff.py): the registry, and each kind's
request, decode fields and block count, without I/O."""

from __future__ import annotations

from typing import Any

from api.forward.handoff import HANDOFFS, handoff_for
from api.forward.jetrouter_handoff import PREFILL_PATH, JetrouterHandoff
from api.forward.vllm_handoff import KV_TRANSFER_PARAMS, VllmHandoff
from eventlog.events import EngineKind
from eventlog.names import TRANSFER_KEY
from replicas.runtime.replica import Routed, RouteRequest

REQ = RouteRequest(request_id="r-1", model="m", token_ids=[1, 2, 3])
PRE: Any = type("Pre", (), {"dp_rank": 2})()  # the one field of a Routed a hand-off reads


def test_every_kind_has_its_handoff_and_an_unknown_one_speaks_the_simulated_engines() -> None:
    assert isinstance(handoff_for(EngineKind.VLLM), VllmHandoff)
    assert isinstance(handoff_for(EngineKind.JETROUTER), JetrouterHandoff)
    assert isinstance(handoff_for("some-future-engine"), JetrouterHandoff)
    assert set(HANDOFFS) >= {EngineKind.VLLM, EngineKind.JETROUTER}


def test_the_simulated_engines_handoff() -> None:
    h = JetrouterHandoff()
    pre: Routed = PRE
    assert h.prefill_request("chat", None, REQ, pre) == (PREFILL_PATH, {
        "model": "m", "prompt": [1, 2, 3], "max_tokens": 1, "jetrouter": {"dp_rank": 2}})
    handle = {"block_hashes": [7, 8]}
    fields = h.decode_fields({TRANSFER_KEY: handle})
    assert fields == {"jetrouter": {TRANSFER_KEY: handle}}
    assert h.blocks(fields) == 2  # type: ignore[arg-type]
    assert isinstance(h.decode_fields({}), str)


def test_vllms_handoff_needs_the_clients_body() -> None:
    h = VllmHandoff()
    pre: Routed = PRE
    assert isinstance(h.prefill_request("chat", None, REQ, pre), str)
    path, body = h.prefill_request("chat", {"model": "m", "messages": [], "stream": True},
                                   REQ, pre)  # type: ignore[misc]
    assert path == "/v1/chat/completions" and body["stream"] is False
    params = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [1, 2, 3]}
    fields = h.decode_fields({KV_TRANSFER_PARAMS: params})
    assert fields == {KV_TRANSFER_PARAMS: params}
    assert h.blocks(fields) == 3  # type: ignore[arg-type]
    assert isinstance(h.decode_fields({KV_TRANSFER_PARAMS: None}), str)
