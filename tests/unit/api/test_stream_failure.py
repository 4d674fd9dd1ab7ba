"""A fault of the router's own after a stream's head went out: the client reads an OpenAI-style
error event and a complete chunked body, never a cut one, and the replica logs it once.

The router app is served by a real uvicorn on a loopback socket (the chunked framing is what is
under test), in front of a simulated engine on another; the fault is injected into the code that
turns the engine's events into the client's.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import openai
import pytest

from api.forward.continuation import Continuation
from eventlog.events import EngineKind
from replicas.runtime.replica import Replica
from tests.unit.api.pd_router import BLOCK_SIZE, router_on_a_socket, worker
from tests.unit.api.test_app import ENGINE, MODEL, simulated_engine
from tests.waiting import until

pytestmark = pytest.mark.timeout(60)


@contextlib.asynccontextmanager
async def router_before_an_engine() -> AsyncIterator[tuple[str, Replica]]:
    """A simulated engine registered as w1, and a router on a socket in front of it: (the
    router's URL, its replica)."""
    # What pd_router.worker registers: EngineConfig's defaults.
    assert (ENGINE.block_size, ENGINE.num_gpu_blocks, ENGINE.max_num_batched_tokens) == (
        BLOCK_SIZE, 4096, 8192)
    async with simulated_engine("w1") as engine, router_on_a_socket(
            [worker("w1", engine, kind=EngineKind.JETROUTER, model=MODEL)]) as served:
        yield served


@pytest.fixture
def fault_after_first_token(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The router's event handling fails on the engine's third event (tokens already sent)."""
    real = Continuation.on_event
    seen = [0]

    def failing(self: Continuation, hop: Any, raw: bytes, payload: bytes | None
                ) -> tuple[bytes | None, bool]:
        seen[0] += 1
        if seen[0] == 3:
            raise RuntimeError("injected fault while streaming")
        return real(self, hop, raw, payload)

    monkeypatch.setattr(Continuation, "on_event", failing)
    yield


def stream_failures(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if "failed while streaming" in r.getMessage()]


async def test_a_raw_client_reads_an_error_event_and_a_complete_body(
        fault_after_first_token: None, caplog: pytest.LogCaptureFixture) -> None:
    async with router_before_an_engine() as (url, replica):
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            async with client.stream("POST", "/v1/completions", json={
                    "model": MODEL, "max_tokens": 16, "stream": True,
                    "prompt": "Tell me about routers."}) as response:
                assert response.status_code == 200
                body = (await response.aread()).decode()  # raises if the body is cut
            request_id = response.headers["x-jetrouter-request-id"]
            # The connection stays usable: the chunked body ended where it should.
            assert (await client.get("/v1/models")).status_code == 200
        events = [e.removeprefix("data: ") for e in body.split("\n\n") if e]
        assert events[-1] == "[DONE]"
        assert '"type":"server_error"' in events[-2] and '"code":500' in events[-2]
        assert any('"text"' in e for e in events[:-2])  # tokens before the fault got out
        failures = stream_failures(caplog)
        assert len(failures) == 1 and request_id in failures[0].getMessage()
        await until(lambda: replica.pending_decisions(), lambda n: n == 0, timeout=10,
                    what="the failed request's decision settled")


async def test_the_openai_client_raises_the_error_event(
        fault_after_first_token: None, caplog: pytest.LogCaptureFixture) -> None:
    async with router_before_an_engine() as (url, _):
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        stream = await client.completions.create(model=MODEL, prompt="Tell me about routers.",
                                                 max_tokens=16, stream=True)
        texts: list[str] = []
        with pytest.raises(openai.APIError) as raised:
            async for chunk in stream:
                texts.append(chunk.choices[0].text)
        assert "router failed while streaming" in str(raised.value)
        assert texts  # what came before the fault was delivered
        await client.close()
        assert len(stream_failures(caplog)) == 1


async def test_a_non_streamed_request_answers_500_with_openai_error_json(
        fault_after_first_token: None) -> None:
    async with router_before_an_engine() as (url, _):
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            response = await client.post("/v1/completions", json={
                "model": MODEL, "max_tokens": 16, "prompt": "Tell me about routers."})
        assert response.status_code == 500
        assert response.json()["error"]["type"] == "server_error"


async def test_a_passthrough_stream_ends_with_an_error_event_too(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # n > 1 is relayed verbatim (api/forward/passthrough.py): the same promise holds there.
    from api.forward.passthrough import Passthrough

    real = Passthrough._on_payload
    seen = [0]

    def failing(self: Passthrough, payload: bytes) -> None:
        seen[0] += 1
        if seen[0] == 3:
            raise RuntimeError("injected fault while streaming")
        real(self, payload)

    monkeypatch.setattr(Passthrough, "_on_payload", failing)
    async with router_before_an_engine() as (url, _):
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            async with client.stream("POST", "/v1/completions", json={
                    "model": MODEL, "max_tokens": 16, "stream": True, "n": 2,
                    "prompt": "Tell me about routers."}) as response:
                assert response.status_code == 200
                body = (await response.aread()).decode()  # raises if the body is cut
    assert '"type":"server_error"' in body.rstrip().split("\n\n")[-1]
    assert len(stream_failures(caplog)) == 1
