"""HTTP/1.1 responses from bytes: a state machine with no I/O, no clock and no asyncio.

:class:`ResponseParser` is fed what a connection received (:meth:`~ResponseParser.feed`, and
:meth:`~ResponseParser.feed_eof` when the peer closed it) and asked for what that makes
(:meth:`~ResponseParser.next_event`), one event at a time:

* a :class:`Head` — status, reason, headers, whether the connection may be reused, and how the
  body is framed (interim 1xx heads are consumed and never returned);
* ``bytes`` — body data, already de-chunked: everything decodable from what was fed so far, in
  one piece (the caller writes it on in one go);
* :data:`END` — the body is complete; the next event belongs to the next response on the same
  connection (keep-alive);
* :data:`NEED_DATA` — nothing more can be made until more bytes (or the end of the stream)
  are fed.

Bodies are framed by ``Transfer-Encoding: chunked`` (chunk extensions ignored, trailers kept in
:attr:`ResponseParser.trailers`), ``Content-Length``, or the end of the connection. The responses
are those to a POST (the only request :mod:`api.upstream` sends), so a 204 or 304 has no body.
Anything that is not HTTP/1.x raises :class:`ParseError`, and the parser is spent.
"""

from __future__ import annotations

from enum import Enum, IntEnum
from typing import NamedTuple, NoReturn

from errors.root import JetrouterError

MAX_HEAD_BYTES = 64 * 1024   # a response head (or trailer section) bigger than this is refused
MAX_CHUNK_LINE = 1024        # a chunk size line (with its extensions) longer than this too


class Framing(IntEnum):
    """How a response's body ends."""

    LENGTH = 0    # Content-Length bytes (0 for a 204, a 304 or no body)
    CHUNKED = 1   # Transfer-Encoding: chunked, up to the last (zero-size) chunk
    CLOSE = 2     # neither: the body runs until the server closes the connection


class _Marker(Enum):
    NEED_DATA = "need data"
    END = "end of body"


NEED_DATA = _Marker.NEED_DATA
END = _Marker.END


class ParseError(JetrouterError):
    """The bytes are not an HTTP/1.x response the parser can read."""


class Head(NamedTuple):
    status: int
    reason: str
    headers: dict[str, str]  # lower-case names; repeated headers joined with ", "
    keep_alive: bool         # the connection may carry another request after this body
    framing: Framing
    length: int              # body bytes for Framing.LENGTH, else 0


Event = Head | bytes | _Marker

# States of the parser; the chunked ones first (the hot path: one comparison). _ENDED: the body
# is complete and END is the next event.
(_CHUNK_SIZE, _CHUNK_DATA, _CHUNK_CRLF, _TRAILERS, _HEAD, _BODY_LENGTH, _BODY_CLOSE, _ENDED,
 _FAILED) = range(9)


class ResponseParser:
    """HTTP/1.1 responses from one connection's bytes, in order (see the module docstring)."""

    __slots__ = ("_buf", "_eof", "_remaining", "_state", "trailers")

    def __init__(self) -> None:
        self._buf = bytearray()
        self._state = _HEAD
        self._remaining = 0   # body bytes left (LENGTH) or of the current chunk (CHUNKED)
        self._eof = False
        self.trailers: dict[str, str] = {}  # of the last chunked body

    @property
    def buffered(self) -> int:
        """Bytes fed and not yet turned into events."""
        return len(self._buf)

    @property
    def in_head(self) -> bool:
        """Between responses: the next event, if any, is a :class:`Head`."""
        return self._state == _HEAD

    @property
    def body_complete(self) -> bool:
        """The current body is all out; the next event is :data:`END`."""
        return self._state == _ENDED

    @property
    def close_delimited(self) -> bool:
        """The current body ends when the connection does (:meth:`feed_eof`)."""
        return self._state == _BODY_CLOSE

    def feed(self, data: bytes) -> None:
        self._buf += data

    def feed_eof(self) -> None:
        """The peer closed the connection: a close-delimited body ends; anything else still
        incomplete is a :class:`ParseError` at the next event."""
        self._eof = True

    def next_event(self) -> Event:
        """The next event from what was fed (see the module docstring)."""
        state = self._state
        if state <= _TRAILERS:
            return self._chunked()
        if state == _BODY_LENGTH:
            return self._length_body()
        if state == _HEAD:
            return self._head()
        if state == _BODY_CLOSE:
            buf = self._buf
            if buf:
                data = bytes(buf)
                buf.clear()
                return data
            if self._eof:
                self._state = _HEAD
                return END
            return NEED_DATA
        if state == _ENDED:
            self._state = _HEAD
            return END
        raise ParseError("the parser failed earlier; the connection is unusable")

    # --- heads -------------------------------------------------------------------------------

    def _head(self) -> Event:
        buf = self._buf
        while True:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > MAX_HEAD_BYTES:
                    self._fail("response head too large")
                if self._eof and buf:
                    self._fail("the connection closed mid-head")
                return NEED_DATA  # at EOF with nothing buffered: no response came at all
            head = bytes(buf[:end])
            del buf[:end + 4]
            parsed = self._parse_head(head)
            if parsed is not None:
                return parsed  # else an interim 1xx: the real head follows

    def _parse_head(self, head: bytes) -> Head | None:
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
            self._fail(f"not an HTTP/1.x response: {lines[0][:60]!r}")
        try:
            status = int(parts[1])
        except ValueError:
            self._fail(f"bad status line {lines[0][:60]!r}")
        if not 100 <= status <= 999:
            self._fail(f"bad status line {lines[0][:60]!r}")
        headers = self._fields(lines[1:])
        if status < 200:
            return None
        keep_alive = parts[0] == b"HTTP/1.1"
        conn_hdr = headers.get("connection")
        if conn_hdr is not None:
            tokens = {x.strip() for x in conn_hdr.lower().split(",")}
            if "close" in tokens:
                keep_alive = False
            elif "keep-alive" in tokens:
                keep_alive = True
        reason = parts[2].decode("latin-1") if len(parts) > 2 else ""
        te = headers.get("transfer-encoding")
        if status in (204, 304):
            framing, length = Framing.LENGTH, 0
        elif te is not None and "chunked" in te.lower():
            framing, length = Framing.CHUNKED, 0
        elif (cl := headers.get("content-length")) is not None:
            try:
                length = int(cl)
            except ValueError:
                self._fail(f"bad content-length {cl!r}")
            if length < 0:
                self._fail(f"bad content-length {cl!r}")
            framing = Framing.LENGTH
        else:
            framing, length, keep_alive = Framing.CLOSE, 0, False
        if framing == Framing.CHUNKED:
            self._state = _CHUNK_SIZE
            self.trailers = {}
        elif framing == Framing.CLOSE:
            self._state = _BODY_CLOSE
        elif length:
            self._state = _BODY_LENGTH
            self._remaining = length
        else:
            self._state = _ENDED  # no body
        return Head(status, reason, headers, keep_alive, framing, length)

    def _fields(self, lines: list[bytes]) -> dict[str, str]:
        fields: dict[str, str] = {}
        for line in lines:
            name, sep, value = line.partition(b":")
            if not sep or not name.strip():
                self._fail(f"bad header line {line[:60]!r}")
            k = name.strip().lower().decode("latin-1")
            v = value.strip().decode("latin-1")
            fields[k] = f"{fields[k]}, {v}" if k in fields else v
        return fields

    # --- bodies ------------------------------------------------------------------------------

    def _length_body(self) -> Event:
        buf = self._buf
        if not buf:
            if self._eof:
                self._fail("the connection closed mid-body")
            return NEED_DATA
        remaining = self._remaining
        if len(buf) >= remaining:
            data = bytes(buf[:remaining])
            del buf[:remaining]
            self._remaining = 0
            self._state = _ENDED
            return data
        data = bytes(buf)
        buf.clear()
        self._remaining = remaining - len(data)
        return data

    def _chunked(self) -> Event:
        """Chunk data decoded from everything buffered, in one piece; END after the trailers.
        State lives in locals while the loop runs (it is the streaming hot path) and is written
        back once; a failure leaves the parser failed."""
        buf = self._buf
        state = self._state
        remaining = self._remaining
        out: list[bytes] = []
        while True:
            if state == _CHUNK_SIZE:
                i = buf.find(b"\r\n")
                if i < 0:
                    if len(buf) > MAX_CHUNK_LINE:
                        self._fail("malformed chunked body (chunk size line too long)")
                    break
                line = bytes(buf[:i])
                size_text = line.split(b";", 1)[0].rstrip() if b";" in line else line
                try:
                    if not size_text.isalnum():  # no sign, underscore or blank int() would take
                        raise ValueError
                    size = int(size_text, 16)
                except ValueError:
                    self._fail(f"malformed chunk size {line[:40]!r}")
                if size == 0:
                    del buf[:i + 2]
                    state = _TRAILERS
                    continue
                end = i + 2 + size
                if len(buf) >= end + 2:  # the whole chunk and its CRLF: the usual SSE read
                    if buf[end:end + 2] != b"\r\n":
                        self._fail("malformed chunked body (no CRLF after a chunk)")
                    out.append(bytes(buf[i + 2:end]))
                    del buf[:end + 2]
                    continue
                del buf[:i + 2]
                state, remaining = _CHUNK_DATA, size
            elif state == _CHUNK_DATA:
                if not buf:
                    break
                n = min(len(buf), remaining)
                out.append(bytes(buf[:n]))
                del buf[:n]
                remaining -= n
                if remaining == 0:
                    state = _CHUNK_CRLF
            elif state == _CHUNK_CRLF:
                if len(buf) < 2:
                    break
                if buf[:2] != b"\r\n":
                    self._fail("malformed chunked body (no CRLF after a chunk)")
                del buf[:2]
                state = _CHUNK_SIZE
            else:  # _TRAILERS: the section after the last chunk (almost always a bare CRLF)
                if buf[:2] == b"\r\n":
                    del buf[:2]
                else:
                    end = buf.find(b"\r\n\r\n")
                    if end < 0:
                        if len(buf) > MAX_HEAD_BYTES:
                            self._fail("trailer section too large")
                        break
                    self.trailers = self._fields(bytes(buf[:end]).split(b"\r\n"))
                    del buf[:end + 4]
                state = _ENDED
                break
        self._remaining = remaining
        if out:
            self._state = state
            return out[0] if len(out) == 1 else b"".join(out)
        if state == _ENDED:
            self._state = _HEAD
            return END
        self._state = state
        if self._eof:
            self._fail("the connection closed mid-body")
        return NEED_DATA

    def _fail(self, message: str) -> NoReturn:
        self._state = _FAILED
        raise ParseError(message)
