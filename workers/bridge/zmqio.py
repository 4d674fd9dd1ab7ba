"""The engine's ZMQ KV-event sockets: the live PUB stream and the replay service.

Live (vLLM, SGLang): a SUB socket (filtered by topic) receives 3 frames per batch:
``topic, seq (u64 big-endian, from 0 at each engine start), payload``.

Replay: a DEALER sends ``[b"", start_seq as 8 bytes big-endian]`` to the engine's ROUTER socket;
the engine answers one message per buffered batch with ``seq >= start_seq``, ``[b"", topic, seq,
payload]`` (SGLang and older vLLM: ``[b"", seq, payload]``), then an end marker whose seq frame is
``0xFF * 8`` (-1 as a signed int). Both layouts are accepted.

The engine's ROUTER socket drops, silently, whatever overflows its send queue (ZMQ's high-water
mark, 1000 messages by default, vLLM's too): an answer of thousands of batches sent in one burst
comes with holes (measured on loopback: 2-14 % of 10 000 small batches, in the middle), and one
whose queue is still full at its end can stop short or lose its end marker. An answer that goes
silent before its end marker hands what it brought to the caller, which asks again from there.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

import zmq
import zmq.asyncio

from errors.root import JetrouterError

END_SEQ = b"\xff" * 8


class ReplayUnavailable(JetrouterError, RuntimeError):
    """No replay endpoint, or it did not finish answering in time; ``received``: the batches
    that came before the silence (an answer whose end was dropped: module docstring)."""

    def __init__(self, why: str, received: list[Frame] | None = None) -> None:
        super().__init__(why)
        self.received = received or []


@dataclass(frozen=True, slots=True)
class Frame:
    seq: int
    payload: bytes


def parse_seq(raw: bytes) -> int:
    if len(raw) != 8:
        raise ValueError(f"sequence frame has {len(raw)} bytes, not 8")
    return int.from_bytes(raw, "big")


def replay_request(start_seq: int) -> list[bytes]:
    """The DEALER request asking for every buffered batch from ``start_seq`` on."""
    return [b"", start_seq.to_bytes(8, "big")]


def parse_replay_reply(frames: list[bytes]) -> Frame | None:
    """One replay reply as received by a DEALER; None for the end marker."""
    if frames and frames[0] == b"":
        frames = frames[1:]  # the empty delimiter
    if len(frames) == 3:
        _topic, seq_raw, payload = frames
    elif len(frames) == 2:
        seq_raw, payload = frames
    else:
        raise ValueError(f"replay reply with {len(frames)} frames")
    if seq_raw == END_SEQ:
        return None
    return Frame(parse_seq(seq_raw), payload)


class LiveFeed:
    """The engine's PUB stream (SUB socket, connected on :meth:`open`)."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, topic: str) -> None:
        self.endpoint = endpoint
        self.topic = topic.encode()
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        # A bounded queue: if the bridge falls behind, ZMQ drops and the seq gap is replayed.
        self.sock.setsockopt(zmq.RCVHWM, 100_000)
        self.bad_frames = 0

    def open(self) -> None:
        self.sock.setsockopt(zmq.SUBSCRIBE, self.topic)
        self.sock.connect(self.endpoint)

    async def receive(self) -> Frame:
        """The next well-formed batch (malformed multipart messages are counted and skipped)."""
        while True:
            frames = await self.sock.recv_multipart()
            if len(frames) == 3:
                with contextlib.suppress(ValueError):
                    return Frame(parse_seq(frames[1]), frames[2])
            self.bad_frames += 1

    def ready(self) -> bool:
        """A message is queued (the next :meth:`receive` will not wait for the engine)."""
        return bool(self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN)

    def close(self) -> None:
        self.sock.close(linger=0)


async def replay(ctx: zmq.asyncio.Context, endpoint: str, start_seq: int,
                 timeout: float = 5.0) -> list[Frame]:
    """Every batch the engine still buffers from ``start_seq`` on, in order.

    Raises :class:`ReplayUnavailable` if the engine does not finish answering within ``timeout``
    seconds of silence, with the batches received until then (a fresh socket per request: a
    late answer can never be mistaken for the next request's)."""
    if not endpoint:
        raise ReplayUnavailable("no replay endpoint configured")
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        await sock.send_multipart(replay_request(start_seq))
        out: list[Frame] = []
        while True:
            try:
                frames = await asyncio.wait_for(sock.recv_multipart(), timeout)
            except TimeoutError:
                raise ReplayUnavailable(f"replay from {endpoint} went silent for {timeout:.1f}s "
                                        f"after {len(out)} batches, before its end", out
                                        ) from None
            try:
                frame = parse_replay_reply(frames)
            except ValueError:
                continue  # a malformed reply: skip it (a seq gap shows what it cost)
            if frame is None:
                return out
            out.append(frame)
    finally:
        sock.close(linger=0)
