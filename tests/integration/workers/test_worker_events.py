"""The worker's KV events on a real nats-server: registration, stored chains, removals,
re-announce, load gauges, retirement on SIGTERM."""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from eventlog.events import (
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    Event,
    WorkerRegistered,
    WorkerRetired,
    decode_batch,
)
from eventlog.hashing import tokens_hashes
from eventlog.names import Names
from tests.waiting import until
from tokenization.tokens import encode
from workers.procs import WorkerProcess

NAMES = Names("jr")


class KvFeed:
    """Every event on one worker's KV subject, in stream order."""

    def __init__(self, js: JetStreamContext, worker_id: str) -> None:
        self.js = js
        self.subject = NAMES.kv_subject(worker_id)
        self.events: list[Event] = []
        self.messages = 0

    async def start(self) -> KvFeed:
        async def on_msg(msg) -> None:  # type: ignore[no-untyped-def]
            self.messages += 1
            self.events.extend(decode_batch(msg.data))
        self.sub = await self.js.subscribe(self.subject, cb=on_msg, ordered_consumer=True)
        return self

    async def wait_for(self, predicate: Callable[[list[Event]], bool],
                       timeout: float = 60.0) -> list[Event]:
        return await until(lambda: self.events, predicate, timeout=timeout, interval=0.02,
                           what=f"the events wanted on {self.subject}")


def stored_pairs(events: list[Event]) -> list[tuple[int | None, int, int]]:
    """(parent, engine block id, tokens_hash) of every stored block, in order."""
    out = []
    for e in events:
        if isinstance(e, BlocksStored):
            parent = e.parent_hash
            for block_id, th in e.blocks:
                out.append((parent, block_id, th))
                parent = block_id
    return out


def event_ids(events: list[Event]) -> list[int]:
    return [e.event_id for e in events if hasattr(e, "event_id")]  # type: ignore[attr-defined]


async def complete(url: str, prompt: str, max_tokens: int = 1) -> dict:  # type: ignore[type-arg]
    async with httpx.AsyncClient(base_url=url, timeout=20) as http:
        resp = await http.post("/v1/completions", json={"prompt": prompt,
                                                        "max_tokens": max_tokens})
        resp.raise_for_status()
        return resp.json()


async def test_registration_stored_chains_reannounce_and_retirement(
        js: tuple[NATS, JetStreamContext], nats_url: str) -> None:
    nc, context = js
    loads: list[dict] = []  # type: ignore[type-arg]

    async def on_load(msg) -> None:  # type: ignore[no-untyped-def]
        loads.append(json.loads(msg.data))
    await nc.subscribe(NAMES.load_subject("ev-w"), cb=on_load)
    feed = await KvFeed(context, "ev-w").start()
    with WorkerProcess(["--worker-id", "ev-w", "--nats-url", nats_url, "--speedup-ratio", "20",
                        "--num-gpu-blocks", "64"]) as proc:
        events = await feed.wait_for(lambda ev: len(ev) >= 1)
        reg = events[0]
        assert isinstance(reg, WorkerRegistered)
        assert (reg.worker_id, reg.url, reg.block_size, reg.kv_total_blocks) == (
            "ev-w", proc.url, 16, 64)

        prompt = "0123456789abcdef" * 6 + "tail"  # 6 full blocks + a partial one
        body = await complete(proc.url, prompt)
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        want = tokens_hashes(encode(prompt), 16)
        await feed.wait_for(lambda ev: len(stored_pairs(ev)) >= 6)
        pairs = stored_pairs(feed.events)
        assert [th for _, _, th in pairs] == want
        assert pairs[0][0] is None  # the chain starts at the root
        assert {bid for _, bid, _ in pairs}.isdisjoint(want)  # engine ids are its own
        assert feed.messages == 2  # registration, then one batch for the step

        second = await complete(proc.url, prompt[:48] + "-different suffix, long enough")
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 48
        await feed.wait_for(lambda ev: len(stored_pairs(ev)) >= 7)
        branch = stored_pairs(feed.events)[6]
        assert branch[0] == pairs[2][1]  # child of the 3rd block of the first chain

        ids = event_ids(feed.events)
        assert ids == list(range(1, len(ids) + 1))

        # Re-announce: the whole cache again, parents first, same engine ids.
        before = len(feed.events)
        reply = await nc.request(NAMES.reannounce_subject("ev-w"), b"", timeout=5)
        assert reply.data == b"ok"
        await feed.wait_for(lambda ev: len(stored_pairs(ev[before:])) >= 7)
        again = feed.events[before:]
        assert isinstance(again[0], AllBlocksCleared)
        assert set(stored_pairs(again)) == set(stored_pairs(feed.events[:before]))
        seen: set[int | None] = {None}
        for parent, block_id, _ in stored_pairs(again):  # parents always come first
            assert parent in seen
            seen.add(block_id)
        assert event_ids(feed.events) == list(range(1, len(event_ids(feed.events)) + 1))
        before = len(feed.events)
        await nc.publish(NAMES.reannounce_subject("all"), b"")
        await feed.wait_for(lambda ev: any(isinstance(e, AllBlocksCleared) for e in ev[before:]))

        await feed.wait_for(lambda ev: bool(loads))  # gauges arrive on core NATS
        assert {"active_decode_blocks", "kv_total_blocks", "active_prefill_tokens",
                "num_running", "num_waiting"} <= set(loads[-1])
        assert loads[-1]["worker_id"] == "ev-w" and loads[-1]["kv_total_blocks"] == 64

        proc.terminate()
        assert proc.wait(20) == 0
        await feed.wait_for(lambda ev: isinstance(ev[-1], WorkerRetired))
        assert feed.events[-1].reason == "shutdown"  # type: ignore[union-attr]


async def test_eviction_publishes_removals_leaf_first(
        js: tuple[NATS, JetStreamContext], nats_url: str) -> None:
    _, context = js
    feed = await KvFeed(context, "evict-w").start()
    with WorkerProcess(["--worker-id", "evict-w", "--nats-url", nats_url, "--speedup-ratio", "20",
                        "--num-gpu-blocks", "8"]) as proc:
        first = "A" * 16 * 5
        await complete(proc.url, first)
        await complete(proc.url, "B" * 16 * 5)  # needs 5 blocks, 3 free: evict 2 of the first
        await feed.wait_for(lambda ev: any(isinstance(e, BlocksRemoved) for e in ev))
        removed = [e for e in feed.events if isinstance(e, BlocksRemoved)]
        chain = [bid for _, bid, th in stored_pairs(feed.events)][:5]
        assert removed[0].block_hashes == [chain[4], chain[3]]
        again = await complete(proc.url, first)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 3 * 16
