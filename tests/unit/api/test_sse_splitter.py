"""SseSplitter against the plain reading of the SSE framing, over streams cut anywhere."""

from __future__ import annotations

import random

from api.forward.engine import SseSplitter


def reference_events(stream: bytes) -> tuple[list[tuple[bytes, bytes | None]], bytes]:
    """Whole events of everything received so far (CRLF as LF), and what is left over: each
    event with its blank-line terminator, and its `data:` lines' values joined by LF."""
    text = stream.replace(b"\r\n", b"\n")
    out: list[tuple[bytes, bytes | None]] = []
    while (i := text.find(b"\n\n")) >= 0:
        event, text = text[:i], text[i + 2:]
        data = [line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:")]
        out.append((event + b"\n\n", b"\n".join(data) if data else None))
    return out, text


PIECES = [b"data: a\n\n", b"data: x\r\ndata:  y \r\n\r\n", b": keep-alive\n\n",
          b"event: e\ndata: z\n\n", b"\n\n", b"data:\n\n", b"id: 1\n\n", b"data: [DONE]\n\n",
          b"data: q\r", b"\n\r\n", b"retry: 5\ndata:p\ndata:q\n\n",
          b'data: {"choices":[{"text":" tok"}]}\n\n']


def test_events_are_the_reference_reading_however_the_stream_is_cut() -> None:
    rng = random.Random(11)
    for _ in range(2000):
        stream = b"".join(rng.choice(PIECES) for _ in range(rng.randint(0, 12)))
        cuts = sorted(rng.sample(range(len(stream) + 1), min(len(stream) + 1, rng.randint(0, 6))))
        splitter, got, prev = SseSplitter(), [], 0
        for cut in [*cuts, len(stream)]:
            got += splitter.feed(stream[prev:cut])
            prev = cut
        want, rest = reference_events(stream)
        assert got == want, stream
        assert splitter._buf.replace(b"\r\n", b"\n") == rest


def test_a_torn_event_waits_for_its_end() -> None:
    s = SseSplitter()
    assert s.feed(b"data: {\"a\":1}\n\ndata: {\"b\"") == [(b"data: {\"a\":1}\n\n", b"{\"a\":1}")]
    assert s.feed(b"") == []
    assert s.feed(b":2}\r\n\r\n") == [(b"data: {\"b\":2}\n\n", b"{\"b\":2}")]
