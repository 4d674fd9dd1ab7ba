"""Proxying one routed request to its engine, and watching the answer go by.

The watcher sees every byte the client sees: it marks prefill complete at the first output token,
counts output tokens, picks up `usage` (including the engine's cached-token count), and reports the
outcome once — ok, error or cancelled — whatever way the exchange ends.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import httpx
import msgspec

_json = msgspec.json.Decoder()


@dataclass(slots=True)
class Exchange:
    """What one proxied request did; filled in while the answer passes through."""

    started: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    last_token_at: float | None = None
    output_tokens: int = 0
    usage_completion_tokens: int | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    itl: list[float] = field(default_factory=list)
    outcome: str = "error"

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.started

    @property
    def tokens(self) -> int:
        return self.usage_completion_tokens if self.usage_completion_tokens is not None \
            else self.output_tokens

    def take_usage(self, usage: object) -> None:
        if not isinstance(usage, dict):
            return
        ct = usage.get("completion_tokens")
        if isinstance(ct, int):
            self.usage_completion_tokens = ct
        pt = usage.get("prompt_tokens")
        if isinstance(pt, int):
            self.prompt_tokens = pt
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            self.cached_tokens = details["cached_tokens"]


def _has_token(choice: object) -> bool:
    if not isinstance(choice, dict):
        return False
    if choice.get("text"):
        return True
    delta = choice.get("delta")
    return isinstance(delta, dict) and bool(delta.get("content"))


class SseWatcher:
    """Incremental SSE parser: feed raw chunks, it updates the Exchange."""

    def __init__(self, exchange: Exchange, on_first_token: Callable[[], None]) -> None:
        self.ex = exchange
        self.on_first_token = on_first_token
        self._buf = b""
        self.saw_done = False
        self.error: object | None = None

    def feed(self, chunk: bytes) -> None:
        self._buf += chunk
        while True:
            i = self._buf.find(b"\n\n")
            if i < 0:
                return
            event, self._buf = self._buf[:i], self._buf[i + 2:]
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    self._data(line[5:].strip())

    def _data(self, payload: bytes) -> None:
        if payload == b"[DONE]":
            self.saw_done = True
            return
        try:
            obj = _json.decode(payload)
        except msgspec.DecodeError:
            return
        if not isinstance(obj, dict):
            return
        if "error" in obj:
            self.error = obj["error"]
        if obj.get("usage"):
            self.ex.take_usage(obj["usage"])
        choices = obj.get("choices") or ()
        n = sum(1 for c in choices if _has_token(c))
        if n:
            now = time.perf_counter()
            if self.ex.first_token_at is None:
                self.ex.first_token_at = now
                self.on_first_token()
            elif self.ex.last_token_at is not None:
                self.ex.itl.append(now - self.ex.last_token_at)
            self.ex.last_token_at = now
            self.ex.output_tokens += n


def sse_error(message: str, *, type_: str = "upstream_error", code: int = 502) -> bytes:
    body = msgspec.json.encode({"error": {"message": message, "type": type_, "param": None,
                                          "code": code}})
    return b"data: " + body + b"\n\n"


async def relay(response: httpx.Response, watcher: SseWatcher) -> AsyncIterator[bytes]:
    """Pass the engine's stream through chunk by chunk; a broken stream ends in an SSE error."""
    try:
        async for chunk in response.aiter_raw():
            watcher.feed(chunk)
            yield chunk
        if watcher.saw_done and watcher.error is None:
            watcher.ex.outcome = "ok"
        elif not watcher.saw_done:
            yield sse_error("the inference engine closed the stream before finishing")
            yield b"data: [DONE]\n\n"
    except (httpx.TransportError, httpx.StreamError) as exc:
        yield sse_error(f"the inference engine failed mid-stream: {type(exc).__name__}")
        yield b"data: [DONE]\n\n"
    finally:
        await response.aclose()
