"""parse_headers: the header blocks a JetStream reader meets, as nats-py would read them."""

from __future__ import annotations

import pytest

from eventlog.raw_inbox import header_block, parse_headers


@pytest.mark.parametrize(("block", "expected"), [
    (b"NATS/1.0\r\nNats-Msg-Id: w1-7\r\n\r\n", {"Nats-Msg-Id": "w1-7"}),
    (b"NATS/1.0\r\nNats-Msg-Id: a\r\nJr-Format: 3\r\n\r\n", {"Nats-Msg-Id": "a", "Jr-Format": "3"}),
    (b"NATS/1.0\r\nJr-Format:2\r\n\r\n", {"Jr-Format": "2"}),
    (b"NATS/1.0 404 No Messages\r\n\r\n", {"Status": "404", "Description": "No Messages"}),
    (b"NATS/1.0 408\r\n\r\n", {"Status": "408"}),
    (b"NATS/1.0 100 Idle Heartbeat\r\nNats-Last-Consumer: 12\r\nNats-Last-Stream: 40\r\n\r\n",
     {"Status": "100", "Description": "Idle Heartbeat", "Nats-Last-Consumer": "12",
      "Nats-Last-Stream": "40"}),
    (b"NATS/1.0 409 Consumer Deleted\r\n\r\n",
     {"Status": "409", "Description": "Consumer Deleted"}),
    # lines nats-py leaves out: no colon, a name with a space or non-ASCII bytes
    (b"NATS/1.0\r\nno colon here\r\nBad Name: x\r\n\xc3\xa9: y\r\nOk: v\r\n\r\n", {"Ok": "v"}),
    (b"NATS/1.0\r\nNote: caf\xc3\xa9\r\n\r\n", {"Note": "caf\u00e9"}),
])
def test_header_blocks(block: bytes, expected: dict[str, str]) -> None:
    assert parse_headers(block) == expected
    # nats-py's dict written back (the raw inbox's fallback) reads as the same headers
    assert parse_headers(header_block(expected) or b"") == expected
