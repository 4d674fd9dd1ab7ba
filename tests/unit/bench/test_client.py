"""The replay client against a real local HTTP server (uvicorn on a free port), including
failover from a URL whose port refuses connections, and the `jetrouter bench --url` command."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from api.cli import main as jetrouter_main
from bench.client import FAILED, OK, REJECTED, BenchOptions, run_trace_bench
from bench.trace import TraceRecord


@dataclass
class FakeRouter:
    """A tiny OpenAI-style streaming server; ``reject`` makes it answer 503 like a busy router."""

    url: str = ""
    reject: bool = False
    bodies: list[dict[str, Any]] = field(default_factory=list)
    seen_prefixes: dict[tuple[int, ...], int] = field(default_factory=dict)

    def app(self) -> Starlette:
        async def models(_: Request) -> Response:
            return JSONResponse({"object": "list", "data": [{"id": "fake-model"}]})

        async def completions(request: Request) -> Response:
            body = await request.json()
            self.bodies.append(body)
            if self.reject:
                return JSONResponse({"error": {"message": "All workers are busy, please retry "
                                               "later", "type": "service_unavailable"}},
                                    status_code=503)
            prompt = body["prompt"]
            # cached tokens: how many leading 32-token runs were seen before (a toy prefix cache)
            cached = 0
            for end in range(32, len(prompt) + 1, 32):
                key = tuple(prompt[:end])
                if key in self.seen_prefixes:
                    cached = end
                self.seen_prefixes[key] = 1

            async def events() -> AsyncIterator[bytes]:
                for i in range(body["max_tokens"]):
                    chunk = {"choices": [{"index": 0, "text": chr(97 + i % 26),
                                          "finish_reason": None}]}
                    yield f"data: {json.dumps(chunk)}\n\n".encode()
                    await asyncio.sleep(0.001)  # a decode step, so inter-token gaps exist
                usage = {"prompt_tokens": len(prompt), "completion_tokens": body["max_tokens"],
                         "prompt_tokens_details": {"cached_tokens": cached}}
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode()
                yield b"data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream",
                                     headers={"x-jetrouter-worker": f"w{len(prompt) % 2}",
                                              "x-jetrouter-replica": "r0"})

        return Starlette(routes=[Route("/v1/models", models),
                                 Route("/v1/completions", completions, methods=["POST"])])


@pytest.fixture
def fake_router() -> Iterator[FakeRouter]:
    fake = FakeRouter()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(fake.app(), log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    # A thread with its own loop, so sync tests (the CLI runs asyncio.run) can use it too.
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "fake router did not start"
        time.sleep(0.01)
    fake.url = f"http://127.0.0.1:{port}"
    yield fake
    server.should_exit = True
    thread.join(timeout=10)
    sock.close()


@pytest.fixture
def dead_url() -> Iterator[str]:
    """A bound but never-listening port: connecting is refused, reliably, while the test runs."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()


def _trace(n: int, gap_ms: float = 5.0) -> list[TraceRecord]:
    # Every request shares hash id 0, then its own block: the toy cache sees the shared prefix.
    return [TraceRecord(i * gap_ms, 2 * 512, 4, (0, 100 + i)) for i in range(n)]


async def test_replay_records_latencies_usage_and_headers(fake_router: FakeRouter) -> None:
    result = await run_trace_bench([fake_router.url + "/v1/"], _trace(6),
                                   BenchOptions(concurrency=2, progress=False, label="t"))
    assert [r.outcome for r in result.records] == [OK] * 6
    assert result.model == "fake-model"
    first = fake_router.bodies[0]
    assert first["stream"] is True and first["stream_options"] == {"include_usage": True}
    assert first["max_tokens"] == 4 and len(first["prompt"]) == 64
    assert all(isinstance(t, int) for t in first["prompt"])
    for r in result.records:
        assert r.ttft_s is not None and r.e2e_s is not None and r.ttft_s <= r.e2e_s
        assert len(r.itl_s) == 3 and r.output_tokens == 4
        assert r.prompt_tokens == 64 and r.worker == "w0" and r.replica == "r0"
    # the first request misses; later ones hit the shared 32-token prefix
    assert sorted(r.cached_tokens or 0 for r in result.records) == [0] + [32] * 5


async def test_output_tokens_capped_and_open_loop_schedule(fake_router: FakeRouter) -> None:
    trace = [TraceRecord(0.0, 100, 50, (1,)), TraceRecord(400.0, 100, 2, (2,))]
    result = await run_trace_bench([fake_router.url], trace, BenchOptions(
        max_output_tokens=5, speedup=2.0, progress=False, model="m"))
    assert [b["max_tokens"] for b in fake_router.bodies] == [5, 2]
    assert fake_router.bodies[0]["model"] == "m"
    # the second arrival is at 400 ms / 2 = 0.2 s of the run
    assert result.records[1].scheduled_s == pytest.approx(0.2)
    assert result.duration_s >= 0.2


async def test_fails_over_from_a_refused_url(fake_router: FakeRouter, dead_url: str) -> None:
    result = await run_trace_bench([dead_url, fake_router.url], _trace(6),
                                   BenchOptions(progress=False, model="m"))
    assert [r.outcome for r in result.records] == [OK] * 6
    assert all(r.url == fake_router.url for r in result.records)
    # round-robin: half the requests started on the dead URL and failed over once
    assert sorted(r.failovers for r in result.records) == [0, 0, 0, 1, 1, 1]


async def test_all_urls_dead_means_failed(dead_url: str) -> None:
    result = await run_trace_bench([dead_url], _trace(2), BenchOptions(progress=False, model="m"))
    assert [r.outcome for r in result.records] == [FAILED, FAILED]
    assert "ConnectError" in (result.records[0].error or "")


async def test_http_503_is_rejected(fake_router: FakeRouter) -> None:
    fake_router.reject = True
    result = await run_trace_bench([fake_router.url], _trace(3),
                                   BenchOptions(progress=False, model="m"))
    assert [r.outcome for r in result.records] == [REJECTED] * 3
    assert "All workers are busy" in (result.records[0].error or "")


def test_bench_command_with_url_prints_and_saves_report(
        fake_router: FakeRouter, dead_url: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    out, per_request = tmp_path / "report.json", tmp_path / "requests.jsonl"
    code = jetrouter_main(["bench", "--url", f"{dead_url},{fake_router.url}", "--generate",
                           "--gen-sessions", "3", "--gen-turns", "2", "--gen-rate", "200",
                           "--gen-think", "0.01", "--max-output-tokens", "3", "--no-progress",
                           "--cache-blocks", "100", "--out", str(out),
                           "--requests-out", str(per_request)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "workload" in printed and "TTFT p50" in printed and "ideal hit (fleet LRU)" in printed
    saved = json.loads(out.read_text())
    run = saved["runs"][0]
    assert run["requests"]["ok"] == 6 and run["requests"]["failed"] == 0
    assert saved["workload"]["source"] == "generator"
    assert saved["workload"]["generator"]["sessions"] == 3
    assert run["ideal"]["finite"]["capacity_blocks"] == 100
    assert run["prefix_hit"]["engine_rate"] > 0
    rows = [json.loads(line) for line in per_request.read_text().splitlines()]
    assert [r["index"] for r in rows] == list(range(6))
    assert {r["run"] for r in rows} == {"run"} and {r["outcome"] for r in rows} == {OK}
    assert all(r["url"] == fake_router.url and r["worker"] and r["status"] == 200 for r in rows)
    # half the requests started on the dead URL and failed over to the live one
    assert sum(r["failovers"] for r in rows) == 3
    assert all(0 < r["ttft_s"] <= r["e2e_s"] for r in rows)


def test_bench_trace_subcommand_reads_a_trace_file(
        fake_router: FakeRouter, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps(r.to_json()) + "\n" for r in _trace(4)))
    code = jetrouter_main(["bench", "--no-progress", "trace", "--url", fake_router.url,
                           "--trace", str(trace), "--max-requests", "3", "--label", "mine"])
    assert code == 0
    assert len(fake_router.bodies) == 3
    assert "mine" in capsys.readouterr().out
