"""The HTTP/1.1 response parser on byte fixtures: every framing, fed whole and split at every
byte offset (the answer never depends on how the bytes arrived), and malformed input."""

from __future__ import annotations

import pytest

from api.http1_parser import (
    END,
    MAX_HEAD_BYTES,
    NEED_DATA,
    Framing,
    Head,
    ParseError,
    ResponseParser,
)

Outcome = tuple[list[Head], bytes, int]  # heads, body bytes (all responses), END count


def drain(parser: ResponseParser, heads: list[Head], body: list[bytes]) -> int:
    ends = 0
    while (event := parser.next_event()) is not NEED_DATA:
        if isinstance(event, Head):
            heads.append(event)
        elif event is END:
            ends += 1
        else:
            assert isinstance(event, bytes) and event, "body data is never empty"
            body.append(event)
    return ends


def parse(pieces: list[bytes], *, eof: bool = False) -> Outcome:
    return feed(ResponseParser(), pieces, eof=eof)


def feed(parser: ResponseParser, pieces: list[bytes], *, eof: bool = False) -> Outcome:
    """``pieces`` fed to ``parser`` in turn (then the end of input, with ``eof``), every event
    drained after each."""
    heads: list[Head] = []
    body: list[bytes] = []
    ends = 0
    for piece in pieces:
        parser.feed(piece)
        ends += drain(parser, heads, body)
    if eof:
        parser.feed_eof()
        ends += drain(parser, heads, body)
    return heads, b"".join(body), ends


def splits(raw: bytes) -> list[list[bytes]]:
    """``raw`` whole, cut in two at every offset, and one byte at a time."""
    return [[raw], *([raw[:i], raw[i:]] for i in range(1, len(raw))),
            [raw[i:i + 1] for i in range(len(raw))]]


CHUNKED = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
           b"Transfer-Encoding: chunked\r\n\r\n"
           b"7\r\ndata: a\r\n"
           b"C;name=value;other\r\n\n\ndata: bcd\n\r\n"
           b"0;last=yes\r\nX-Checksum: abc\r\nX-Other: 1\r\n\r\n")
CHUNKED_BODY = b"data: a\n\ndata: bcd\n"


@pytest.mark.parametrize("pieces", splits(CHUNKED))
def test_chunked_with_extensions_and_trailers(pieces: list[bytes]) -> None:
    parser = ResponseParser()
    heads, body, ends = feed(parser, pieces)
    assert [(h.status, h.reason, h.framing, h.keep_alive) for h in heads] == [
        (200, "OK", Framing.CHUNKED, True)]
    assert heads[0].headers["content-type"] == "text/event-stream"
    assert body == CHUNKED_BODY
    assert ends == 1
    assert parser.trailers == {"x-checksum": "abc", "x-other": "1"}
    assert parser.buffered == 0 and parser.in_head


LENGTH = b"HTTP/1.1 201 Created\r\nContent-Length: 11\r\n\r\nhello world"


@pytest.mark.parametrize("pieces", splits(LENGTH))
def test_content_length(pieces: list[bytes]) -> None:
    heads, body, ends = parse(pieces)
    assert [(h.status, h.framing, h.length) for h in heads] == [(201, Framing.LENGTH, 11)]
    assert (body, ends) == (b"hello world", 1)


CLOSE = b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n{\"a\": 1}"


@pytest.mark.parametrize("pieces", splits(CLOSE))
def test_close_delimited_ends_at_the_end_of_the_stream(pieces: list[bytes]) -> None:
    heads, body, ends = parse(pieces)
    assert [(h.framing, h.keep_alive) for h in heads] == [(Framing.CLOSE, False)]
    assert (body, ends) == (b'{"a": 1}', 0)  # no end until the connection says so
    assert parse(pieces, eof=True)[1:] == (b'{"a": 1}', 1)


KEEP_ALIVE = (b"HTTP/1.1 100 Continue\r\n\r\n"
              b"HTTP/1.1 204 No Content\r\nX-A: 1\r\n\r\n"
              b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
              b"HTTP/1.1 500 Oops\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
              b"4\r\nfail\r\n0\r\n\r\n")


@pytest.mark.parametrize("pieces", splits(KEEP_ALIVE))
def test_responses_in_a_row_interim_heads_skipped(pieces: list[bytes]) -> None:
    heads, body, ends = parse(pieces)
    assert [(h.status, h.framing, h.keep_alive) for h in heads] == [
        (204, Framing.LENGTH, True), (200, Framing.LENGTH, True),
        (500, Framing.CHUNKED, False)]
    assert (body, ends) == (b"okfail", 3)


def test_the_last_bytes_of_a_body_say_it_is_complete() -> None:
    parser = ResponseParser()
    parser.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nab")
    assert isinstance(parser.next_event(), Head)
    assert (parser.next_event(), parser.body_complete) == (b"ab", False)
    parser.feed(b"c")
    assert (parser.next_event(), parser.body_complete) == (b"c", True)
    assert parser.next_event() is END
    parser.feed(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nx\r\n0\r\n\r\n")
    assert isinstance(parser.next_event(), Head)
    assert (parser.next_event(), parser.body_complete) == (b"x", True)


def test_repeated_headers_are_joined_and_connection_tokens_read() -> None:
    heads, _, _ = parse([b"HTTP/1.0 200 OK\r\nSet-X: a\r\nset-x: b\r\n"
                         b"Connection: Keep-Alive\r\nContent-Length: 0\r\n\r\n"])
    assert heads[0].headers["set-x"] == "a, b"
    assert heads[0].keep_alive


@pytest.mark.parametrize(("raw", "message"), [
    (b"SSH-2.0-OpenSSH\r\n\r\n", "not an HTTP/1.x response"),
    (b"HTTP/1.1 abc OK\r\n\r\n", "bad status line"),
    (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "bad header line"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: many\r\n\r\n", "bad content-length"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", "bad content-length"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "malformed chunk size"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n-1\r\n", "malformed chunk size"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabXY", "no CRLF after a chunk"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"1" * 2000,
     "chunk size line too long"),
    (b"HTTP/1.1 200 OK\r\n" + b"X-Big: y\r\n" * (MAX_HEAD_BYTES // 8), "response head too large"),
])
def test_malformed_input_is_a_clear_error(raw: bytes, message: str) -> None:
    parser = ResponseParser()
    parser.feed(raw)
    with pytest.raises(ParseError, match=message):
        drain(parser, [], [])
    with pytest.raises(ParseError, match="failed earlier"):
        parser.next_event()


@pytest.mark.parametrize("raw", [
    b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab",
    b"HTTP/1.1 200 OK\r\nContent-",
])
def test_the_end_of_the_stream_mid_response_is_an_error(raw: bytes) -> None:
    parser = ResponseParser()
    parser.feed(raw)
    drain(parser, [], [])
    parser.feed_eof()
    with pytest.raises(ParseError, match="closed mid-"):
        drain(parser, [], [])


def test_the_end_of_the_stream_between_responses_is_no_error() -> None:
    parser = ResponseParser()
    parser.feed_eof()
    assert parser.next_event() is NEED_DATA and parser.buffered == 0
