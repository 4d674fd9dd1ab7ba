"""subscribe_raw against real nats-server: the bytes as sent, beside ordinary subscriptions."""

from __future__ import annotations

import asyncio

from eventlog.raw_inbox import parse_headers, subscribe_raw
from tests.waiting import until

Raw = tuple[bytes, bytes, bytes, bytes | None]


async def test_a_raw_inbox_gets_the_bytes_and_others_keep_nats_py_s_path(js):
    nc, _ = js
    got: list[Raw] = []
    raw = await subscribe_raw(nc, lambda s, r, d, h: got.append((s, r, d, h)))
    plain: asyncio.Queue[bytes] = asyncio.Queue()

    async def on_plain(msg) -> None:  # an ordinary nats-py subscription on the same connection
        await plain.put(msg.headers["K"].encode() + msg.data)

    await nc.subscribe("plain.subject", cb=on_plain)
    await nc.publish(raw.subject, b"one", reply="reply.to")
    await nc.publish(raw.subject, b"two", headers={"K": "v"})
    await nc.publish("plain.subject", b"x", headers={"K": "v"})
    await until(lambda: len(got) == 2, timeout=10)
    assert got[0] == (raw.subject.encode(), b"reply.to", b"one", None)
    subject, reply, data, headers = got[1]
    assert (subject, reply, data) == (raw.subject.encode(), b"", b"two")
    assert headers is not None and b"K: v" in headers
    assert await asyncio.wait_for(plain.get(), 10) == b"vx"
    assert nc.stats["in_msgs"] >= 3


async def test_a_failing_handler_does_not_stop_the_connection_and_unsubscribe_stops_it(js):
    nc, _ = js
    got: list[bytes] = []

    def handler(subject: bytes, reply: bytes, data: bytes, headers: bytes | None) -> None:
        if data == b"boom":
            raise RuntimeError("handler bug")
        got.append(data)

    raw = await subscribe_raw(nc, handler)
    for data in (b"a", b"boom", b"b"):
        await nc.publish(raw.subject, data)
    await until(lambda: got == [b"a", b"b"], timeout=10)
    await raw.unsubscribe()
    await nc.publish(raw.subject, b"late")
    await nc.flush()
    second: list[bytes] = []
    other = await subscribe_raw(nc, lambda s, r, d, h: second.append(d))
    await nc.publish(other.subject, b"c")
    await until(lambda: second == [b"c"], timeout=10)
    assert got == [b"a", b"b"]


async def test_messages_nats_py_delivers_itself_still_reach_the_handler(js):
    """Should a nats-py release stop routing messages through the client's ``_process_msg``,
    the subscription's own callback hands the handler the same bytes, not nothing."""
    nc, _ = js
    got: list[Raw] = []
    raw = await subscribe_raw(nc, lambda s, r, d, h: got.append((s, r, d, h)))
    nc._process_msg = nc._jetrouter_raw_dispatch.original  # as if nats-py bypassed it
    await nc.publish(raw.subject, b"one", reply="reply.to")
    await nc.publish(raw.subject, b"two", headers={"K": "v", "Nats-Msg-Id": "m1"})
    await until(lambda: len(got) == 2, timeout=10)
    assert got[0] == (raw.subject.encode(), b"reply.to", b"one", None)
    subject, reply, data, headers = got[1]
    assert (subject, reply, data) == (raw.subject.encode(), b"", b"two")
    assert headers is not None and parse_headers(headers) == {"K": "v", "Nats-Msg-Id": "m1"}
