"""The overhead bench's own parts: its raw HTTP client over a real socket, and its statistics."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

from bench.overhead import (
    PhaseResult,
    RawConnection,
    closed_loop,
    percentile,
    proc_cpu_seconds,
    prompt_body,
    split_url,
)
from launch.children import children_of


async def _serve(chunked: bool) -> tuple[asyncio.Server, int, list[bytes]]:
    """A tiny keep-alive HTTP/1.1 server answering every POST with a JSON body or an SSE stream."""
    seen: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length"))
                seen.append(await reader.readexactly(length))
                if chunked:
                    writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
                    for part in (b"data: {\"t\":1}\n\n", b"data: [DONE]\n\n"):
                        writer.write(b"%x\r\n%s\r\n" % (len(part), part))
                    writer.write(b"0\r\n\r\n")
                else:
                    body = b'{"ok":true}'
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s"
                                 % (len(body), body))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], seen


async def test_raw_connection_reads_both_framings_on_one_connection() -> None:
    for chunked in (False, True):
        server, port, seen = await _serve(chunked)
        async with server:
            conn = RawConnection("127.0.0.1", port)
            for i in range(3):
                status, body, first = await conn.post("/v1/completions", b'{"n":%d}' % i,
                                                      first_chunk=True)
                assert status == 200
                assert first is not None and first >= 0
                if chunked:
                    assert body == b'data: {"t":1}\n\ndata: [DONE]\n\n'
                else:
                    assert json.loads(body) == {"ok": True}
            conn.close()
        assert seen == [b'{"n":0}', b'{"n":1}', b'{"n":2}']


async def test_closed_loop_sends_exactly_the_requested_count() -> None:
    server, port, seen = await _serve(chunked=True)
    async with server:
        result = await closed_loop(f"http://127.0.0.1:{port}", "/v1/completions",
                                   prompt_body("m", 64, 4, stream=True), 5, requests=23,
                                   stream=True, result=PhaseResult("direct", 5))
    assert (result.ok, result.errors, len(result.ttft)) == (23, 0, 23)
    bodies = [json.loads(b) for b in seen]
    assert len({b["prompt"] for b in bodies}) == 23  # every prompt distinct
    assert all(len(b["prompt"]) == 64 and b["stream"] for b in bodies)


def test_percentile_and_url_helpers() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile(list(range(101)), 99) == 99
    assert split_url("http://127.0.0.1:8123/") == ("127.0.0.1", 8123)


def test_cpu_per_request_and_children_from_proc() -> None:
    res = PhaseResult("router", 1, ok=200, seconds=2.0)
    res.add_cpu({"replica": 0.3, "projector": 0.1})
    res.add_cpu({"replica": 0.1})
    report = res.cpu_report()
    assert report["ms_per_request"] == {"replica": 2.0, "projector": 0.5}
    assert report["cores"] == {"replica": 0.2, "projector": 0.05}
    # A real child process is found under its parent, and its CPU time is readable.
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    try:
        assert child.pid in children_of(os.getpid())
        assert (proc_cpu_seconds(child.pid) or 0.0) >= 0.0
    finally:
        child.communicate(b"", timeout=30)
    assert children_of(2**22 + 12345) == []  # no such process


def test_prompts_share_one_of_k_prefixes_and_differ_after_it() -> None:
    body = prompt_body("m", 80, 8, stream=True, prefix_chars=64, prefixes=8)
    prompts = [json.loads(body(n))["prompt"] for n in range(17)]
    assert all(len(p) == 80 for p in prompts)
    assert len({p[:64] for p in prompts}) == 8  # request n takes prefix n % 8
    assert prompts[0][:64] == prompts[8][:64] == prompts[16][:64] != prompts[1][:64]
    assert len(set(prompts)) == 17  # every request's own part differs
    default = prompt_body("m", 512, 8, stream=True)
    assert json.loads(default(0))["prompt"][:256] == json.loads(default(1))["prompt"][:256]
