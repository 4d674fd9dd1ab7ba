"""An inbox whose messages reach a plain function as the bytes NATS sent (design.md §7).

nats-py turns every delivered message into a ``Msg``: it decodes subject and reply, parses the
header block line by line into a dict, queues the message for the subscription's task, and that
task awaits the callback. For a replica catching up on a tail of 100 k messages that is most of
the reader's CPU (~7 of ~13 us a message), and the reader needs none of it: it reads the stream
sequences in the reply subject, the payload, and a header only when a message is marked with a
format or is a status.

:func:`subscribe_raw` subscribes through nats-py as usual (so the subscription is renewed on
reconnect and unsubscribed the usual way), then registers a handler for its sid in a dispatcher
installed once per connection in front of the client's ``_process_msg``: messages for a
registered sid go straight from the protocol parser to ``handler(subject, reply, data,
headers)`` — all ``bytes``, ``headers`` the raw header block or None — synchronously and without
a ``Msg``; every other message takes nats-py's own path. The handler runs inside the client's
read loop: it must be quick and must not raise (an exception there is logged and swallowed, since
one escaping would stop the connection's reader).

:func:`parse_headers` reads such a header block, inline status included, when one is needed.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

log = logging.getLogger(__name__)

RawHandler = Callable[[bytes, bytes, bytes, bytes | None], None]
_ProcessMsg = Callable[[int, bytes, bytes, bytes, bytes | None], Awaitable[None]]

_DISPATCH_ATTR = "_jetrouter_raw_dispatch"
_HEADER_LINE = b"NATS/1.0"
_CRLF = b"\r\n"
STATUS = "Status"
DESCRIPTION = "Description"


class _Dispatch:
    """Sits in front of one client's ``_process_msg``: registered sids bypass it."""

    def __init__(self, nc: Any) -> None:
        self.nc = nc
        self.handlers: dict[int, RawHandler] = {}
        self.original: _ProcessMsg = nc._process_msg
        nc._process_msg = self.process

    async def process(self, sid: int, subject: bytes, reply: bytes, data: bytes,
                      headers: bytes | None) -> None:
        handler = self.handlers.get(sid)
        if handler is None:
            await self.original(sid, subject, reply, data, headers)
            return
        stats = self.nc.stats
        stats["in_msgs"] += 1
        stats["in_bytes"] += len(data)
        try:
            handler(subject, reply, data, headers)
        except Exception:  # never out into the client's read loop: it would stop reading
            log.exception("raw inbox handler failed on %r", subject)


class RawSubscription:
    """A subscription on a fresh inbox whose messages go to a :data:`RawHandler`."""

    def __init__(self, sub: Any, dispatch: _Dispatch) -> None:
        self._sub = sub
        self._dispatch = dispatch
        self.subject: str = sub.subject

    async def unsubscribe(self) -> None:
        """Stop handing messages over at once, then unsubscribe on the server (raises as
        nats-py's ``unsubscribe`` does when the connection is closed)."""
        self._dispatch.handlers.pop(self._sub._id, None)
        await self._sub.unsubscribe()


async def subscribe_raw(nc: Any, handler: RawHandler) -> RawSubscription:
    """Subscribe ``handler`` to a new inbox of ``nc`` (a connected ``nats.aio.client.Client``)."""
    dispatch = getattr(nc, _DISPATCH_ATTR, None)
    if dispatch is None:
        dispatch = _Dispatch(nc)
        setattr(nc, _DISPATCH_ATTR, dispatch)
    # The dispatcher takes the sid's messages before nats-py builds a Msg, so the callback is
    # never called while it does. The callback is the safety net should a nats-py release stop
    # routing messages through ``_process_msg``: the handler then gets the same bytes, rebuilt
    # from nats-py's Msg (slower, still correct), instead of nothing. Nothing is delivered to a
    # fresh inbox before the caller asks for it, so registering after the SUB loses nothing.
    async def through_nats_py(msg: Any) -> None:
        try:
            handler(msg.subject.encode(), (msg.reply or "").encode(), msg.data,
                    header_block(msg.headers))
        except Exception:
            log.exception("raw inbox handler failed on %r", msg.subject)

    sub = await nc.subscribe(nc.new_inbox(), cb=through_nats_py)
    dispatch.handlers[sub._id] = handler
    return RawSubscription(sub, dispatch)


def header_block(headers: dict[str, str] | None) -> bytes | None:
    """nats-py's header dict written back as the header block :func:`parse_headers` reads
    (an inline status as nats-py parsed it out, included)."""
    if not headers:
        return None
    first = _HEADER_LINE.decode()
    if status := headers.get(STATUS):
        first += f" {status}"
        if description := headers.get(DESCRIPTION):
            first += f" {description}"
    lines = [first, *(f"{k}: {v}" for k, v in headers.items() if k not in (STATUS, DESCRIPTION))]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def parse_headers(raw: bytes) -> dict[str, str]:
    """A NATS header block (``NATS/1.0[ <status>[ <description>]]\\r\\nName: value\\r\\n...``)
    as a dict; an inline status becomes ``Status`` (and ``Description``). Lines without a colon
    or with a name that is not one ASCII token are left out, as nats-py leaves them out."""
    out: dict[str, str] = {}
    first, _, rest = raw.partition(_CRLF)
    if first.startswith(_HEADER_LINE):
        status_line = first[len(_HEADER_LINE):].strip()
        if status_line:
            code, _, desc = status_line.partition(b" ")
            if code.isdigit():
                out[STATUS] = code.decode()
            if desc.strip():
                out[DESCRIPTION] = desc.strip().decode("utf-8", "replace")
    else:
        rest = raw
    for line in rest.split(_CRLF):
        name, sep, value = line.partition(b":")
        if not sep:
            continue
        key_bytes = name.strip()
        if not key_bytes or not key_bytes.isascii() or len(key_bytes.split()) != 1:
            continue
        out[key_bytes.decode("ascii")] = value.strip().decode("utf-8", "replace")
    return out
