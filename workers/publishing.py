"""Publish KV events from a custom engine, without a bridge (design.md §11).

This is the API jetrouter's own simulated engine uses (``workers/server.py``), made public, like
Dynamo's "KV events for custom engines". An engine written in Python creates one
:class:`KvPublisher` per process, registers itself, and hands over its cache changes as they
happen; the publisher numbers them (strictly increasing ``event_id``), appends them to
``<ns>.kv.<worker_id>`` exactly once (message ids, retries), publishes load gauges on
``<ns>.load.<worker_id>`` and answers re-announce requests from ``dump``::

    import time, uuid
    from workers.publishing import (KvPublisher, Names, Removed, WorkerRegistered,
                                    stored_blocks)

    pub = KvPublisher("nats://127.0.0.1:4222", Names("jr"), "my-engine-0", uuid.uuid4().hex,
                      dump=lambda: [(0, engine.cache_as_changes())],   # for re-announce
                      load=lambda: [{"dp_rank": 0, "num_running": 3, "num_waiting": 0}])
    await pub.start()
    pub.register(WorkerRegistered("my-engine-0", "http://10.0.0.7:8000", "my-model",
                                  block_size=16, kv_total_blocks=4096,
                                  max_num_batched_tokens=8192, ts=time.time()))
    # a prompt's first two full blocks were cached under engine block ids 17 and 18:
    pub.emit(0, [stored_blocks([17, 18], prompt_token_ids[:32], block_size=16)])
    pub.emit(0, [Removed([18])])                                       # block 18 evicted
    ...
    pub.retire("shutdown"); await pub.close()

Rules the router relies on: ``block_size`` equals the router's ``--kv-cache-block-size``;
``tokens_hash`` is :func:`eventlog.hashing.tokens_hashes` of the block's token ids (salted with
``adapter`` for a LoRA adapter, exactly as :func:`stored_blocks` does); a block is stored after its
parent (``parent_id``: the engine id of the block before it, None for a prompt's first block);
block ids are the engine's own, used only to find a block again on removal.
"""

from __future__ import annotations

from collections.abc import Sequence

from eventlog.events import WorkerRegistered, WorkerRetired
from eventlog.hashing import adapter_salt, salted, tokens_hashes
from eventlog.names import Names
from workers.kvcache import Cleared, KvChange, Removed, Stored
from workers.publisher import KvPublisher

__all__ = [
    "Cleared",
    "KvChange",
    "KvPublisher",
    "Names",
    "Removed",
    "Stored",
    "WorkerRegistered",
    "WorkerRetired",
    "stored_blocks",
]


def stored_blocks(block_ids: Sequence[int], token_ids: Sequence[int], *, block_size: int,
                  parent_id: int | None = None, adapter: str | None = None) -> Stored:
    """A :class:`Stored` change for consecutive full blocks: ``token_ids`` holds exactly
    ``len(block_ids) * block_size`` tokens; ``adapter`` names the LoRA adapter they were computed
    under (None: the base model)."""
    if len(token_ids) != len(block_ids) * block_size:
        raise ValueError(f"{len(block_ids)} blocks of {block_size} tokens need "
                         f"{len(block_ids) * block_size} token ids, got {len(token_ids)}")
    local = salted(tokens_hashes(token_ids, block_size), adapter_salt(adapter))
    return Stored(parent_id, list(zip(block_ids, local, strict=True)))
