"""The public publisher API (workers/publishing.py) used the way its docstring shows, by a
"custom engine" in this process, against a real nats-server: a router state built from the
stream matches the engine's prompts, drops evicted blocks, and keeps LoRA blocks apart."""

from __future__ import annotations

import time

import nats
import pytest

from eventlog.events import decode_batch
from eventlog.hashing import prompt_hashes
from natsops.server import NatsServer
from replicas.core.state import RouterState, StateConfig
from tests.waiting import until
from workers.publishing import KvPublisher, Names, Removed, WorkerRegistered, stored_blocks

BS = 16


@pytest.mark.timeout(60)
async def test_custom_engine_publishes_through_the_public_api(nats_server: NatsServer) -> None:
    names = Names("jr")
    prompt = list(range(100, 100 + 3 * BS))
    cache = [(0, [stored_blocks([17, 18, 19], prompt, block_size=BS)])]
    pub = KvPublisher(nats_server.url, names, "custom-0", "run1",
                      dump=lambda: cache,
                      load=lambda: [{"dp_rank": 0, "num_running": 1, "num_waiting": 0}],
                      load_interval=0.1)
    await pub.start()
    pub.register(WorkerRegistered("custom-0", "http://127.0.0.1:9", "my-model", BS, 4096, 8192,
                                  time.time(), loras=["my-lora"]))
    pub.emit(0, [stored_blocks([17, 18, 19], prompt, block_size=BS)])
    pub.emit(0, [stored_blocks([30, 31], prompt[:2 * BS], block_size=BS, adapter="my-lora")])
    pub.emit(0, [Removed([19])])
    assert await pub.flush(20)

    nc = await nats.connect(nats_server.url)
    try:
        js = nc.jetstream()
        state = RouterState(StateConfig(block_size=BS))

        async def applied() -> dict[tuple[str, str, str], int]:
            info = await js.stream_info(names.stream("kv"))
            for seq in range(state.positions["kv"] + 1, info.state.last_seq + 1):
                msg = await js.get_msg(names.stream("kv"), seq)
                state.apply("kv", seq, decode_batch(msg.data or b""))
            return state.stats.counts

        # The publisher may merge queued batches into one message: wait for the removal.
        await until(applied, lambda c: ("kv", "BlocksRemoved", "ok") in c,
                    what="registration, stores and the removal applied")
        find = state.index.find_matches
        assert find(prompt_hashes(prompt, BS)).scores == {("custom-0", 0): 2}
        assert find(prompt_hashes(prompt, BS, adapter="my-lora")).scores == {("custom-0", 0): 2}
        assert state.workers["custom-0"].loras == ["my-lora"]
        with pytest.raises(ValueError):
            stored_blocks([1], prompt, block_size=BS)
    finally:
        pub.retire("shutdown")
        await pub.close()
        await nc.close()
