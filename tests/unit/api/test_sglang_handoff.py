"""The router's side of SGLang's KV hand-off, against stand-in SGLang engines on real sockets.

SGLang itself is not run. The stand-ins check what SGLang's own router sends a prefill/decode
pair (api/forward/sglang_handoff.py): the client's request with ``bootstrap_host``,
``bootstrap_port`` and ``bootstrap_room`` on both, the same room, sent concurrently. The
prefill stand-in answers only once the decode stand-in has its request, as a real prefill engine
answers only once the decode engine pulled the blocks: a router that waited for the prefill
answer before asking the decode engine would never finish (each test has a deadline).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from api.forward.sglang_handoff import bootstrap_fields, bootstrap_host, prompt_blocks
from eventlog import events as ev
from eventlog.events import EngineKind, Role
from tests.standin_engine import Received, Reply, completion_events, standin_engine
from tests.unit.api.pd_router import (
    BLOCK_SIZE,
    MODEL,
    counter,
    router_events,
    router_on_a_socket,
    worker,
)
from tests.waiting import until

pytestmark = pytest.mark.timeout(60)

DISAGG = "jetrouter_disaggregated_requests_total"
FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
PORT = 8998
DEADLINE = 15.0  # well under the router's stream idle timeout (30 s): no hop may wait it out
PROMPT = "the quick brown fox jumps over the lazy dog " * 8


def prefill_answer(chat: bool) -> dict[str, Any]:
    """A one-token answer, as an SGLang prefill engine gives one (the router drops it)."""
    usage = {"prompt_tokens": 100, "completion_tokens": 1, "total_tokens": 101,
             "prompt_tokens_details": {"cached_tokens": 32}}
    if chat:
        return {"id": "p", "object": "chat.completion", "created": 1, "model": MODEL,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "A"},
                             "finish_reason": "length"}], "usage": usage}
    return {"id": "p", "object": "text_completion", "created": 1, "model": MODEL,
            "choices": [{"index": 0, "text": "A", "finish_reason": "length"}], "usage": usage}


class Pair:
    """An SGLang prefill stand-in that answers once the decode stand-in got its request."""

    def __init__(self, chat: bool, *, prefill_status: int = 200,
                 head_first: bool = False) -> None:
        self.chat = chat
        self.prefill_status = prefill_status
        self.head_first = head_first  # a waiting decode engine has sent its response head
        self.decode_arrived = asyncio.Event()
        self.release = asyncio.Event()  # set at the end: frees a decode request still held
        self.decoded = ["Dis", "agg", "regated"]
        self.aggregated = ["Agg", "regated"]

    def answer_prefill(self, got: Received) -> Reply:
        body = prefill_answer(self.chat) if self.prefill_status == 200 else {
            "error": {"message": "prefill failed", "code": self.prefill_status}}
        return Reply(status=self.prefill_status, json=body, hold=self.decode_arrived)

    def answer_decode(self, got: Received) -> Reply:
        if "bootstrap_room" not in got.body:  # the fallback: computes the prompt itself
            return Reply(events=completion_events(self.aggregated, chat=self.chat, model=MODEL))
        self.decode_arrived.set()
        if self.prefill_status != 200:  # waits for blocks that never come
            if self.head_first:
                return Reply(events=[], hold_events=self.release)
            return Reply(events=[], hold=self.release)
        return Reply(events=completion_events(self.decoded, chat=self.chat, model=MODEL))


@contextlib.asynccontextmanager
async def sglang_pair(pair: Pair) -> AsyncIterator[tuple[Any, Any, str, Any]]:
    async with standin_engine(pair.answer_prefill) as pre, \
            standin_engine(pair.answer_decode) as dec, \
            router_on_a_socket([
                worker("p0", pre.url, Role.PREFILL, EngineKind.SGLANG, bootstrap_port=PORT),
                worker("d0", dec.url, Role.DECODE, EngineKind.SGLANG)]) as (url, replica):
        try:
            yield pre, dec, url, replica
        finally:
            pair.release.set()


def client_body(chat: bool) -> tuple[str, dict[str, Any]]:
    if chat:
        return "/v1/chat/completions", {"model": MODEL, "max_tokens": 8, "stream": True,
                                        "messages": [{"role": "user", "content": PROMPT}]}
    return "/v1/completions", {"model": MODEL, "max_tokens": 8, "prompt": PROMPT}


def text_of(resp: httpx.Response, chat: bool) -> str:
    if not chat:
        return str(resp.json()["choices"][0]["text"])
    out = []
    for line in resp.text.split("\n\n"):
        if line.startswith("data: {"):
            obj = httpx.Response(200, content=line[6:]).json()
            for c in obj.get("choices") or []:
                out.append((c.get("delta") or {}).get("content") or "")
    return "".join(out)


async def finished(replica: Any, request_ids: set[str]) -> list[ev.Event]:
    """The router stream once every one of ``request_ids`` has its RequestFinished (the prefill
    hop of an SGLang hand-off ends in the background)."""
    events: list[ev.Event] = await until(
        lambda: router_events(replica.log),
        lambda events: request_ids <= {e.request_id for e in events
                                       if isinstance(e, ev.RequestFinished)},
        timeout=DEADLINE, what=f"{sorted(request_ids)} finished")
    return events


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
async def test_both_engines_get_the_bootstrap_fields_concurrently(chat: bool) -> None:
    pair = Pair(chat)
    path, body = client_body(chat)
    async with sglang_pair(pair) as (pre, dec, url, replica):
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            resp = await asyncio.wait_for(client.post(path, json=body), DEADLINE)
            rid = resp.headers["x-jetrouter-request-id"]
            events = await finished(replica, {rid, rid + "~prefill"})
            metrics = (await client.get("/metrics")).text
    assert resp.status_code == 200, resp.text
    assert text_of(resp, chat) == "".join(pair.decoded)  # the decode engine's answer

    # One request each, on the client's route, with the same three fields.
    assert pre.paths() == [path] and dec.paths() == [path]
    p, d = pre.received[0].body, dec.received[0].body
    assert {k: p[k] for k in FIELDS} == {k: d[k] for k in FIELDS}
    assert p["bootstrap_host"] == "127.0.0.1" and p["bootstrap_port"] == PORT
    room = p["bootstrap_room"]
    assert type(room) is int and 0 <= room < 2**63
    # Otherwise the client's request: the prefill one not streamed, the decode one streamed
    # (the router always streams from the engine, usage included).
    assert {k: v for k, v in p.items() if k not in FIELDS} == {**body, "stream": False}
    assert d["stream"] is True and d["stream_options"]["include_usage"] is True
    assert {k: v for k, v in d.items() if k not in (*FIELDS, "stream", "stream_options")} == {
        k: v for k, v in body.items() if k not in ("stream", "stream_options")}

    # Both decisions are events on the router stream: the prefill one over the prefill pool,
    # the decode one over the decode pool, recording the blocks its engine receives.
    routed = {e.request_id: e for e in events if isinstance(e, ev.RequestRouted)}
    assert (routed[rid + "~prefill"].phase, routed[rid + "~prefill"].worker_id) == \
        ("prefill", "p0")
    dec_event = routed[rid]
    assert (dec_event.phase, dec_event.worker_id) == ("decode", "d0")
    assert dec_event.transfer_blocks == prompt_blocks(dec_event.isl_tokens, BLOCK_SIZE) > 0
    assert routed[rid + "~prefill"].transfer_blocks == -1
    outcomes = {e.request_id: (e.outcome, e.cached_tokens) for e in events
                if isinstance(e, ev.RequestFinished)}
    assert outcomes[rid + "~prefill"] == ("ok", 32)  # the prefill engine's cached_tokens
    assert outcomes[rid][0] == "ok"
    assert counter(metrics, DISAGG, "outcome") == {"disaggregated": 1.0}


@pytest.mark.parametrize("head_first", [False, True], ids=["before-head", "after-head"])
async def test_a_failed_prefill_ends_the_waiting_decode_hop_and_falls_back(
        head_first: bool) -> None:
    """The prefill engine answers 500 while the decode engine waits for blocks (a real one
    would wait for its own timeout), before or after sending its response head: the router
    ends that hop at once, without blaming the decode engine, and sends the request again
    without the hand-off."""
    pair = Pair(False, prefill_status=500, head_first=head_first)
    path, body = client_body(False)
    async with sglang_pair(pair) as (_, dec, url, replica):
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            resp = await asyncio.wait_for(client.post(path, json=body), DEADLINE)
            rid = resp.headers["x-jetrouter-request-id"]
            events = await finished(replica, {rid, rid + "~prefill", rid + "~1"})
            metrics = (await client.get("/metrics")).text
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] == "".join(pair.aggregated)
    assert resp.headers["x-jetrouter-migrations"] == "1"
    assert [all(f in r.body for f in FIELDS) for r in dec.received] == [True, False]
    outcomes = {e.request_id: e.outcome for e in events if isinstance(e, ev.RequestFinished)}
    assert outcomes == {rid + "~prefill": "error", rid: "migrated", rid + "~1": "ok"}
    routed = {e.request_id: e for e in events if isinstance(e, ev.RequestRouted)}
    assert routed[rid + "~1"].worker_id == "d0"  # not excluded: it was not at fault
    assert counter(metrics, DISAGG, "outcome") == {"prefill_failed": 1.0}
    assert counter(metrics, "jetrouter_migrations_total", "reason") == {"stream_error": 1.0}


async def test_a_dead_decode_engine_cancels_the_prefill_and_the_client_gets_502() -> None:
    """The decode engine refuses the connection: the prefill request (whose blocks would go
    nowhere) is cancelled, and with no other engine to take the request the client gets a 502
    that says so, at once."""
    pair = Pair(False)
    path, body = client_body(False)
    async with standin_engine(pair.answer_decode) as gone:
        dead = gone.url
    async with standin_engine(pair.answer_prefill) as pre, \
            router_on_a_socket([
                worker("p0", pre.url, Role.PREFILL, EngineKind.SGLANG, bootstrap_port=PORT),
                worker("d0", dead, Role.DECODE, EngineKind.SGLANG)]) as (url, replica):
        try:
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                resp = await asyncio.wait_for(client.post(path, json=body), DEADLINE)
                rid = resp.headers["x-jetrouter-request-id"]
                events = await finished(replica, {rid, rid + "~prefill"})
                metrics = (await client.get("/metrics")).text
        finally:
            pair.decode_arrived.set()
    assert resp.status_code == 502, resp.text
    assert "no other engine" in resp.json()["error"]["message"]
    assert all(f in pre.received[0].body for f in FIELDS)
    outcomes = {e.request_id: e.outcome for e in events if isinstance(e, ev.RequestFinished)}
    assert outcomes == {rid + "~prefill": "cancelled", rid: "error"}
    assert counter(metrics, DISAGG, "outcome") == {"prefill_failed": 1.0}


def test_fields_follow_sglangs_router() -> None:
    one = bootstrap_fields("http://10.0.0.7:30000", 8998, 1)
    assert (one["bootstrap_host"], one["bootstrap_port"]) == ("10.0.0.7", 8998)
    assert 0 <= one["bootstrap_room"] < 2**63
    assert bootstrap_fields("http://h:1", 0, 1)["bootstrap_port"] is None  # not given
    three = bootstrap_fields("http://h:1", 9000, 3)  # n choices: one room each
    assert three["bootstrap_host"] == ["h"] * 3 and three["bootstrap_port"] == [9000] * 3
    assert len(set(three["bootstrap_room"])) == 3
    assert bootstrap_host("http://[fd00::1]:8000") == "[fd00::1]"
    assert prompt_blocks(33, 16) == 3 and prompt_blocks(32, 16) == 2

