"""An engine stand-in on a real loopback socket: a raw asyncio HTTP/1.1 server that records every
request it receives and answers what the test's ``answer`` function says, as JSON or as an SSE
stream (chunked, as uvicorn sends it).

Used where the test is about what the router *sends* (which fields reach an engine) and about
how it reads real engine answers replayed from recordings (tests/data/vllm_pd/): the answers are
the recorded bodies, the transport is a real socket with real framing. Started with
``accepting=False`` it is an engine too busy to take connections (its accept queue full,
tests/full_accept_queue.py) until :meth:`StandinEngine.accept`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from tests.full_accept_queue import FullAcceptQueue


@dataclass(frozen=True)
class Received:
    method: str
    path: str
    headers: dict[str, str]
    body: Any  # the decoded JSON body (None when empty)


@dataclass
class Reply:
    status: int = 200
    json: Any = None                 # a JSON answer, or
    events: list[Any] | None = None  # an SSE stream: JSON objects (or "[DONE]") in order
    # Stop after this many events without ending the chunked body (an engine dying mid-stream).
    break_after: int | None = None
    text: str | None = None          # a plain-text answer (a Prometheus page)
    hold: asyncio.Event | None = None  # answer only once this is set (an engine that is stuck)
    # Send the head of the stream at once, its events only once this is set (an engine that
    # accepted the request and waits for something before its first token).
    hold_events: asyncio.Event | None = None


Answer = Callable[[Received], Reply]


@dataclass
class StandinEngine:
    answer: Answer
    received: list[Received] = field(default_factory=list)
    url: str = ""
    queue: FullAcceptQueue | None = None  # while it takes no connection

    async def accept(self) -> None:
        """An engine started with ``accepting=False`` catches up: it accepts from now on."""
        assert self.queue is not None, "the engine accepts already"
        await self.queue.accepting(self._serve)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {k.strip().lower(): v.strip()
                           for k, v in (ln.split(":", 1) for ln in lines[1:] if ":" in ln)}
                size = int(headers.get("content-length", "0"))
                raw = await reader.readexactly(size) if size else b""
                got = Received(method, path, headers, json.loads(raw) if raw else None)
                self.received.append(got)
                if not await self._reply(writer, self.answer(got)):
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def _reply(self, writer: asyncio.StreamWriter, reply: Reply) -> bool:
        """Write one answer; False when the connection must close (a broken stream)."""
        if reply.hold is not None:
            await reply.hold.wait()
        if reply.text is not None:
            body = reply.text.encode()
            writer.write(f"HTTP/1.1 {reply.status} X\r\ncontent-type: text/plain\r\n"
                         f"content-length: {len(body)}\r\n\r\n".encode() + body)
            await writer.drain()
            return True
        if reply.events is None:
            body = json.dumps(reply.json).encode()
            writer.write(f"HTTP/1.1 {reply.status} X\r\ncontent-type: application/json\r\n"
                         f"content-length: {len(body)}\r\n\r\n".encode() + body)
            await writer.drain()
            return True
        writer.write(f"HTTP/1.1 {reply.status} X\r\ncontent-type: text/event-stream\r\n"
                     "transfer-encoding: chunked\r\n\r\n".encode())
        if reply.hold_events is not None:
            await writer.drain()
            await reply.hold_events.wait()
        for i, event in enumerate(reply.events):
            if reply.break_after is not None and i >= reply.break_after:
                await writer.drain()
                return False
            data = event if isinstance(event, str) else json.dumps(event)
            chunk = f"data: {data}\n\n".encode()
            writer.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        return True

    def paths(self) -> list[str]:
        return [r.path for r in self.received]


@contextlib.asynccontextmanager
async def standin_engine(answer: Answer, *, accepting: bool = True
                         ) -> AsyncIterator[StandinEngine]:
    engine = StandinEngine(answer)
    if not accepting:
        engine.queue = FullAcceptQueue()
        engine.url = engine.queue.url
        try:
            yield engine
        finally:
            await engine.queue.close()
        return
    server = await asyncio.start_server(engine._serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    engine.url = f"http://127.0.0.1:{port}"
    try:
        yield engine
    finally:
        server.close()
        await server.wait_closed()


def completion_events(texts: list[str], *, chat: bool = False, model: str = "m",
                      prompt_tokens: int = 1, cached_tokens: int = 0) -> list[Any]:
    """An OpenAI SSE stream of ``texts`` (one token each) with a usage chunk and [DONE]."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    events: list[Any] = []
    for i, text in enumerate(texts):
        last = i == len(texts) - 1
        choice: dict[str, Any] = ({"index": 0, "delta": {"content": text}} if chat
                                  else {"index": 0, "text": text})
        choice["finish_reason"] = "length" if last else None
        events.append({"id": "x", "object": obj, "created": 1, "model": model,
                       "choices": [choice]})
    events.append({"id": "x", "object": obj, "created": 1, "model": model, "choices": [],
                   "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(texts),
                             "total_tokens": prompt_tokens + len(texts),
                             "prompt_tokens_details": {"cached_tokens": cached_tokens}}})
    events.append("[DONE]")
    return events
