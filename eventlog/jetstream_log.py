"""The :class:`eventlog.log.EventLog` over JetStream: the appender, the reader and the stream
helpers of this package behind one object, so the runtime names the log, not the server."""

from __future__ import annotations

from collections.abc import Sequence

from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from eventlog.appender import Appender
from eventlog.events import Decode, Event, decode_batch
from eventlog.log import StoredMessage
from eventlog.names import STREAM_KINDS, Names
from eventlog.reader import StreamReader
from eventlog.streams import ensure_streams, stream_bounds


class JetStreamLog:
    """JetStream streams as an event log; ``appender`` carries the retry policy of its owner."""

    def __init__(self, js: JetStreamContext, appender: Appender | None = None) -> None:
        self.js = js
        self.appender = appender if appender is not None else Appender(js)

    async def ensure_streams(self, names: Names, *, max_bytes: int | None = None,
                             kinds: tuple[str, ...] = STREAM_KINDS) -> None:
        await ensure_streams(self.js, names, max_bytes=max_bytes, kinds=kinds)

    async def append(self, subject: str, events: Sequence[Event], msg_id: str,
                     headers: dict[str, str] | None = None) -> int:
        return await self.appender.append(subject, events, msg_id, headers)

    async def append_raw(self, subject: str, payload: bytes, msg_id: str,
                         extra_headers: dict[str, str] | None = None) -> int:
        return await self.appender.append_raw(subject, payload, msg_id, extra_headers)

    def reader(self, stream: str, *, start_seq: int = 1, time_decode: bool = True,
               decode: Decode = decode_batch) -> StreamReader:
        return StreamReader(self.js, stream, start_seq=start_seq, time_decode=time_decode,
                            decode=decode)

    async def bounds(self, stream: str) -> tuple[int, int]:
        return await stream_bounds(self.js, stream)

    async def purge(self, stream: str, *, keep_from: int | None = None) -> None:
        if keep_from is None:
            await self.js.purge_stream(stream)
        else:
            await self.js.purge_stream(stream, seq=keep_from)

    async def last_message(self, stream: str, subject: str) -> StoredMessage | None:
        try:
            msg = await self.js.get_last_msg(stream, subject)
        except NotFoundError:
            return None
        return StoredMessage(int(msg.seq or 0), msg.subject or subject, msg.data or b"",
                             dict(msg.headers) if msg.headers else None)
