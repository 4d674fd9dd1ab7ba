"""Only the router speaks the KV hand-off: a client request carrying vLLM's
``kv_transfer_params``, SGLang's ``bootstrap_*`` fields or jetrouter's own ``kv_transfer`` handle
is refused with a 400 naming the field on every inference route, and the engine (a stand-in on a
real socket that records every request) never receives it."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from api.handoff_fields import HANDOFF_FIELDS
from tests.standin_engine import Received, Reply, completion_events, standin_engine
from tests.unit.api.pd_router import MODEL, router_on_a_socket, worker

pytestmark = pytest.mark.timeout(60)

FORBIDDEN: dict[str, Any] = {
    "kv_transfer_params": {"do_remote_prefill": True, "remote_host": "10.9.9.9",
                           "remote_port": 5600, "remote_block_ids": [1, 2, 3],
                           "remote_engine_id": "someone-else"},
    "bootstrap_host": "10.9.9.9",
    "bootstrap_port": 8998,
    "bootstrap_room": 12345,
    "bootstrap_pair_key": "k",
}

# One valid body per inference route, each of which reaches the engine without the field.
ROUTES: dict[str, dict[str, Any]] = {
    "/v1/completions": {"model": MODEL, "prompt": "hello there", "max_tokens": 2},
    "/v1/chat/completions": {"model": MODEL, "max_tokens": 2,
                             "messages": [{"role": "user", "content": "hello"}]},
    "/v1/embeddings": {"model": MODEL, "input": "hello"},
    "/v1/responses": {"model": MODEL, "input": "hello", "max_output_tokens": 2},
    "/v1/messages": {"model": MODEL, "max_tokens": 2,
                     "messages": [{"role": "user", "content": "hello"}]},
}
BATCH = {"model": MODEL, "prompt": ["one prompt", "another"], "max_tokens": 2}


def answer(got: Received) -> Reply:
    if got.path == "/v1/embeddings":
        return Reply(json={"object": "list", "model": MODEL, "data": [
            {"object": "embedding", "index": 0, "embedding": [0.0, 1.0]}],
            "usage": {"prompt_tokens": 1, "total_tokens": 1}})
    return Reply(events=completion_events(["a", "b"], chat="chat" in got.path, model=MODEL))


def refusal_names(resp: httpx.Response, field: str) -> bool:
    err = resp.json()["error"]
    return field in err["message"] and err.get("param", field) == field


async def test_clients_cannot_send_handoff_fields_on_any_route() -> None:
    assert set(FORBIDDEN) == set(HANDOFF_FIELDS)
    async with standin_engine(answer) as engine, \
            router_on_a_socket([worker("w1", engine.url)]) as (url, _):
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            for path, body in [*ROUTES.items(), ("/v1/completions", BATCH)]:
                for field, value in FORBIDDEN.items():
                    resp = await client.post(path, json={**body, field: value})
                    assert resp.status_code == 400, (path, field, resp.text)
                    assert refusal_names(resp, field), (path, resp.text)
                # Even null: an engine may act on the field being there at all.
                resp = await client.post(path, json={**body, "kv_transfer_params": None})
                assert resp.status_code == 400, (path, resp.text)
            resp = await client.post("/v1/completions", json={
                **ROUTES["/v1/completions"], "jetrouter": {"kv_transfer": {"handle": "x"}}})
            assert resp.status_code == 400 and refusal_names(resp, "jetrouter.kv_transfer")
            assert engine.received == [], "a refused request reached the engine"
            # The same requests without the field are served: the engine is really there.
            for path, body in ROUTES.items():
                resp = await client.post(path, json=body)
                assert resp.status_code == 200, (path, resp.text)
    assert sorted(set(engine.paths())) == sorted(ROUTES)
    for got in engine.received:
        assert not set(HANDOFF_FIELDS) & set(got.body), got
        assert "kv_transfer" not in (got.body.get("jetrouter") or {}), got
