"""An in-process stand-in for a real engine's *outside*: vLLM's ZMQ KV-event publisher (PUB +
ROUTER replay with a bounded buffer, frames exactly as vLLM 0.32 sends them, or SGLang's
positional layout) and its HTTP side (/v1/models with LoRA adapters, Prometheus /metrics,
/health) on real sockets. It keeps the ground truth of what it caches, so tests can compare the
router state built from JR_KV with the engine's real cache.

Not a model: "requests" are just prompts whose blocks the test decides to store or evict.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections import deque
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.asyncio

from eventlog.events import BlocksStored, WorkerRegistered
from eventlog.hashing import adapter_salt, tokens_hashes
from replicas.core.state import RouterState, StateConfig

END_SEQ = b"\xff" * 8


@dataclass
class CachedBlock:
    parent: int | None
    tokens: list[int]
    lora: str | None


@dataclass
class EngineSim:
    block_size: int = 16
    num_gpu_blocks: int = 4096
    model: str = "tiny"
    loras: tuple[str, ...] = ()
    layout: str = "map"  # "map" (vLLM >= 0.26) | "array" (SGLang: signed hashes, no topic)
    topic: str = "kv-events"
    buffer_steps: int = 100_000
    seed: int = 1
    healthy: bool = True
    # False: /health and /metrics get no answer until it is True again (an engine whose HTTP
    # side is too busy to answer; its ZMQ side goes on)
    responsive: asyncio.Event = field(default_factory=asyncio.Event)
    seq: int = 0
    start_time: float = field(default_factory=time.time)
    # ground truth per dp rank: engine block hash (unsigned) -> block
    cache: dict[int, dict[int, CachedBlock]] = field(default_factory=dict)
    running: int = 0
    waiting: int = 0
    # /metrics answers to requests that arrived while the HTTP side was responsive (requests
    # held back while it was not are answered late, to a client that may have given up)
    metrics_answered: int = 0

    async def start(self) -> EngineSim:
        self.responsive.set()
        self.rng = random.Random(self.seed)
        self.ctx = zmq.asyncio.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind("tcp://127.0.0.1:0")
        self.events_endpoint = self.pub.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind("tcp://127.0.0.1:0")
        self.replay_endpoint = self.router.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=self.buffer_steps)
        self.replay_requests: list[int] = []
        # Batches the next replay answer leaves out, as a ROUTER socket whose send queue
        # overflowed while the reader was slow drops them (silently, at ZMQ's high-water mark).
        self.replay_drops: set[int] = set()
        # When set, the next replay answer stops after that many batches, as one whose send
        # queue overflowed to its end: its end marker is lost too (the reader hears silence)
        # unless ``replay_cut_keeps_end``.
        self.replay_cut_after: int | None = None
        self.replay_cut_keeps_end = False
        self.http = await asyncio.start_server(self._serve_http, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.http.sockets[0].getsockname()[1]}"
        self._replay_task = asyncio.create_task(self._serve_replay())
        return self

    async def stop(self) -> None:
        self.responsive.set()  # HTTP answers held back go out before the sockets close
        self._replay_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._replay_task
        self.http.close()
        await self.http.wait_closed()
        self.ctx.destroy(linger=0)

    # --- engine life -----------------------------------------------------------------------

    def restart(self) -> None:
        """A new engine run: empty cache, seq from 0, empty replay buffer, new start time."""
        self.cache.clear()
        self.seq = 0
        self.buffer.clear()
        self.start_time = time.time() + self.rng.random()

    # --- KV events -------------------------------------------------------------------------

    def _wire_hash(self, h: int) -> int:
        if self.layout == "array" and h >= 1 << 63:
            return h - (1 << 64)  # SGLang publishes signed int64
        return h

    def _encode_event(self, event: dict[str, object]) -> object:
        kind = event["type"]
        if self.layout == "map":
            return event
        if kind == "BlockStored":
            return ["BlockStored", event["block_hashes"], event["parent_block_hash"],
                    event["token_ids"], event["block_size"], event["lora_id"], event["medium"]]
        if kind == "BlockRemoved":
            return ["BlockRemoved", event["block_hashes"]]
        return ["AllBlocksCleared"]

    def publish(self, events: list[dict[str, object]], dp_rank: int = 0, *,
                send: bool = True) -> int:
        """One batch: buffered for replay, and sent live unless ``send`` is False (a drop)."""
        payload = msgspec.msgpack.encode([time.time(), [self._encode_event(e) for e in events],
                                          dp_rank])
        seq = self.seq
        self.seq += 1
        self.buffer.append((seq, payload))
        if send:
            frames = [seq.to_bytes(8, "big"), payload]
            self.pub.send_multipart([self.topic.encode(), *frames])
        return seq

    def new_hash(self) -> int:
        return self.rng.getrandbits(64)

    def store(self, tokens: list[int], *, dp_rank: int = 0, lora: str | None = None,
              send: bool = True) -> list[int]:
        """Cache every full block of ``tokens`` not cached yet (one BlockStored for the run of
        missing blocks, like vLLM); returns the chain's block hashes."""
        bs = self.block_size
        blocks = self.cache.setdefault(dp_rank, {})
        chain: list[int] = []
        parent: int | None = None
        new: list[tuple[int, list[int]]] = []
        for i in range(len(tokens) // bs):
            chunk = tokens[i * bs:(i + 1) * bs]
            found = next((h for h, b in blocks.items()
                          if b.parent == parent and b.tokens == chunk and b.lora == lora), None)
            if found is not None and not new:
                parent = found
                chain.append(found)
                continue
            h = self.new_hash()
            new.append((h, chunk))
            chain.append(h)
        if new:
            first_parent = chain[len(chain) - len(new) - 1] if len(chain) > len(new) else None
            p = first_parent
            for h, chunk in new:
                blocks[h] = CachedBlock(p, chunk, lora)
                p = h
            lora_id = (self.loras.index(lora) + 1) if lora else None
            self.publish([{
                "type": "BlockStored",
                "block_hashes": [self._wire_hash(h) for h, _ in new],
                "parent_block_hash": None if first_parent is None
                else self._wire_hash(first_parent),
                "token_ids": [t for _, chunk in new for t in chunk],
                "block_size": bs, "lora_id": lora_id, "medium": "GPU", "lora_name": lora,
            }], dp_rank, send=send)
        return chain

    def evict(self, count: int, *, dp_rank: int = 0, send: bool = True) -> list[int]:
        """Evict up to ``count`` leaf blocks (engines free a chain tail first)."""
        blocks = self.cache.get(dp_rank, {})
        victims: list[int] = []
        for _ in range(count):
            parents = {b.parent for b in blocks.values()}
            leaves = [h for h in blocks if h not in parents]
            if not leaves:
                break
            victim = self.rng.choice(leaves)
            del blocks[victim]
            victims.append(victim)
        if victims:
            self.publish([{"type": "BlockRemoved", "block_hashes": [self._wire_hash(h)],
                           "medium": "GPU"} for h in victims], dp_rank, send=send)
        return victims

    def random_step(self, prefixes: list[list[int]], *, send: bool = True) -> None:
        """Store a prompt that extends a shared prefix, then keep the cache under capacity."""
        prefix = self.rng.choice(prefixes)
        tail = [self.rng.randrange(30_000) for _ in range(self.rng.randrange(1, 4)
                                                          * self.block_size)]
        self.store(prefix + tail, send=send)
        over = sum(map(len, self.cache.values())) - self.num_gpu_blocks
        if over > 0:
            self.evict(over, send=send)

    def truth_state(self, worker_id: str) -> RouterState:
        """A router state holding exactly what the engine caches (computed independently of the
        bridge: tokens_hash straight from eventlog.hashing)."""
        state = RouterState(StateConfig(block_size=self.block_size))
        events: list[object] = [WorkerRegistered(worker_id, "x", self.model, self.block_size,
                                                 self.num_gpu_blocks, 8192, 0.0)]
        eid = 1
        for rank, blocks in self.cache.items():
            order = _topological(blocks)
            for h in order:
                b = blocks[h]
                th = tokens_hashes(b.tokens, self.block_size)[0] ^ adapter_salt(b.lora)
                events.append(BlocksStored(worker_id, eid, rank, b.parent, [(h, th)], 0.0))
                eid += 1
        state.apply("kv", 1, events)  # type: ignore[arg-type]
        return state

    # --- replay socket ---------------------------------------------------------------------

    async def _serve_replay(self) -> None:
        while True:
            frames = await self.router.recv_multipart()
            client, _empty, start_raw = frames[0], frames[1], frames[2]
            start = int.from_bytes(start_raw, "big")
            self.replay_requests.append(start)
            drops, self.replay_drops = self.replay_drops, set()
            cut, self.replay_cut_after = self.replay_cut_after, None
            sent = 0
            for seq, payload in list(self.buffer):
                if cut is not None and sent == cut:
                    break
                if seq >= start and seq not in drops:
                    head = [self.topic.encode()] if self.layout == "map" else []
                    await self.router.send_multipart(
                        [client, b"", *head, seq.to_bytes(8, "big"), payload])
                    sent += 1
            if cut is not None and not self.replay_cut_keeps_end:
                continue
            await self.router.send_multipart([client, b"", b"", END_SEQ, b""]
                                             if self.layout == "map"
                                             else [client, b"", END_SEQ, b""])

    # --- HTTP ------------------------------------------------------------------------------

    def _metrics(self) -> str:
        used = sum(map(len, self.cache.values()))
        labels = f'model_name="{self.model}",engine="0"'
        return "\n".join([
            "# HELP process_start_time_seconds Start time of the process since unix epoch.",
            "# TYPE process_start_time_seconds gauge",
            f"process_start_time_seconds {self.start_time!r}",
            "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
            "# TYPE vllm:cache_config_info gauge",
            f'vllm:cache_config_info{{block_size="{self.block_size}",enable_prefix_caching='
            f'"True",engine="0",num_gpu_blocks="{self.num_gpu_blocks}"}} 1.0',
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{labels}}} {self.running}.0",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{{{labels}}} {self.waiting}.0",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{{{labels}}} {used / self.num_gpu_blocks!r}",
            "",
        ])

    async def _serve_http(self, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            path = head.split(b" ", 2)[1].decode()
            status, ctype, body = 404, "text/plain", b"not found"
            on_time = self.responsive.is_set()
            if path in ("/health", "/metrics"):
                await self.responsive.wait()
            if path == "/health":
                status, body = (200, b"") if self.healthy else (503, b"unhealthy")
            elif path == "/v1/models":
                data = [{"id": self.model, "object": "model", "root": "/models/tiny",
                         "parent": None}]
                data += [{"id": name, "object": "model", "root": f"/loras/{name}",
                          "parent": self.model} for name in self.loras]
                status, ctype = 200, "application/json"
                body = json.dumps({"object": "list", "data": data}).encode()
            elif path == "/metrics":
                status, ctype, body = 200, "text/plain; version=0.0.4", self._metrics().encode()
                self.metrics_answered += on_time
            reason = {200: "OK", 404: "Not Found", 503: "Service Unavailable"}[status]
            writer.write(f"HTTP/1.1 {status} {reason}\r\ncontent-type: {ctype}\r\n"
                         f"content-length: {len(body)}\r\nconnection: close\r\n\r\n".encode()
                         + body)
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def _topological(blocks: dict[int, CachedBlock]) -> list[int]:
    out: list[int] = []
    seen: set[int] = set()
    for h in blocks:
        path = []
        cur: int | None = h
        while cur is not None and cur not in seen and cur in blocks:
            path.append(cur)
            cur = blocks[cur].parent
        for x in reversed(path):
            seen.add(x)
            out.append(x)
    return out
