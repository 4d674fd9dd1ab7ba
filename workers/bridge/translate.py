"""Translate decoded engine batches into jetrouter KV events, and mirror what they put in the index.

Pure: no I/O, no clock (``ts`` comes from the engine's batch).

* ``BlockStored`` -> ``BlocksStored(blocks=[(engine block hash, tokens_hash), ...], parent_hash)``
  with ``tokens_hash`` computed by :mod:`eventlog.hashing` from the event's ``token_ids`` (one
  vLLM event may carry many blocks: ``len(token_ids) == blocks * block_size``). Engine hashes stay
  opaque ids. Blocks cached under a LoRA adapter are salted with ``adapter_salt(lora_name)``;
  an adapter known only by its numeric ``lora_id`` (older vLLM, SGLang) is salted as
  ``"lora-id:<id>"``, a name no request can carry, so such blocks never match any request rather
  than matching the wrong one. Blocks with non-null ``extra_keys`` (multimodal inputs, a cache
  salt) are salted by those keys for the same reason: their KV depends on more than the tokens.
* ``BlockRemoved`` -> ``BlocksRemoved``; ``AllBlocksCleared`` -> ``AllBlocksCleared``.
* ``medium`` is carried (None for the device tier).

``event_id`` is strictly increasing per worker: the translator owns the counter and the bridge
seeds it from the stream when it resumes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from eventlog.events import AllBlocksCleared, BlocksRemoved, BlocksStored, Event
from eventlog.hashing import MASK64, adapter_salt, extra_keys_salt, tokens_hashes
from workers.bridge.decode import (
    DEVICE_MEDIUM,
    EngineBatch,
    EngineCleared,
    EngineRemoved,
    EngineStored,
)


def adapter_of(stored: EngineStored) -> str | None:
    """The adapter name blocks are salted by (None: the base model)."""
    if stored.lora_name:
        return stored.lora_name
    if stored.lora_id:  # vLLM and SGLang use None (or 0) for the base model
        return f"lora-id:{stored.lora_id}"
    return None


_extra_salt = extra_keys_salt  # the router salts a cache_salt request's first block alike


def _medium(medium: str) -> str | None:
    return None if medium == DEVICE_MEDIUM else medium


@dataclass(slots=True)
class Translator:
    worker_id: str
    block_size: int
    next_event_id: int = 1
    skipped: dict[str, int] = field(default_factory=dict)

    def take_id(self) -> int:
        eid = self.next_event_id
        self.next_event_id += 1
        return eid

    def _skip(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1

    def translate(self, batch: EngineBatch) -> list[Event]:
        out: list[Event] = []
        if batch.malformed:
            self.skipped["malformed"] = self.skipped.get("malformed", 0) + batch.malformed
        for event in batch.events:
            if isinstance(event, EngineStored):
                stored = self._stored(event, batch)
                if stored is not None:
                    out.append(stored)
            elif isinstance(event, EngineRemoved):
                if event.block_hashes:
                    out.append(BlocksRemoved(self.worker_id, self.take_id(), batch.dp_rank,
                                             event.block_hashes, batch.ts,
                                             medium=_medium(event.medium)))
            elif isinstance(event, EngineCleared):
                out.append(AllBlocksCleared(self.worker_id, self.take_id(), batch.dp_rank,
                                            batch.ts))
        return out

    def _stored(self, event: EngineStored, batch: EngineBatch) -> BlocksStored | None:
        n = len(event.block_hashes)
        if n == 0:
            return None
        if event.block_size != self.block_size:
            # Hashing with another block size would index blocks no request can ever match.
            self._skip("block_size_mismatch")
            return None
        if len(event.token_ids) != n * self.block_size:
            self._skip("token_count_mismatch")
            return None
        try:
            local = tokens_hashes(event.token_ids, self.block_size)
        except ValueError:  # a token id that is not an integer
            self._skip("malformed")
            return None
        salt = adapter_salt(adapter_of(event))
        extra = event.extra_keys or ()
        pairs: list[tuple[int, int]] = []
        for i, (block_hash, th) in enumerate(zip(event.block_hashes, local, strict=True)):
            value = th ^ salt
            if i < len(extra) and extra[i] is not None:
                value ^= _extra_salt(extra[i])
            pairs.append((block_hash, value & MASK64))
        return BlocksStored(self.worker_id, self.take_id(), batch.dp_rank, event.parent_hash,
                            pairs, batch.ts, medium=_medium(event.medium))

    def clear(self, dp_ranks: Iterable[int], ts: float) -> list[Event]:
        """``AllBlocksCleared`` for every given dp rank (engine restart, unreplayable gap)."""
        return [AllBlocksCleared(self.worker_id, self.take_id(), rank, ts)
                for rank in sorted(set(dp_ranks))]


@dataclass(slots=True)
class CacheMirror:
    """What this worker's device-tier blocks look like in the router's index, from the events the
    bridge appended (same rules as replicas/core/index.py: a store under an unknown parent is
    skipped, a re-store is a no-op, a removal of an unknown block does nothing). Used to answer
    re-announce requests with ``AllBlocksCleared`` + the blocks, without asking the engine."""

    # per dp rank: engine block hash -> (parent block hash or None, tokens_hash), in store order
    ranks: dict[int, dict[int, tuple[int | None, int]]] = field(default_factory=dict)

    def apply(self, events: Iterable[Event]) -> None:
        for event in events:
            if isinstance(event, BlocksStored):
                if event.medium is not None:
                    continue
                blocks = self.ranks.setdefault(event.dp_rank, {})
                parent = event.parent_hash
                if parent is not None and parent not in blocks:
                    continue
                for block_hash, th in event.blocks:
                    held = blocks.get(block_hash)
                    if held != (parent, th):
                        blocks.pop(block_hash, None)
                        blocks[block_hash] = (parent, th)
                    parent = block_hash
            elif isinstance(event, BlocksRemoved):
                if event.medium is not None:
                    continue
                blocks = self.ranks.get(event.dp_rank, {})
                for block_hash in event.block_hashes:
                    blocks.pop(block_hash, None)
            elif isinstance(event, AllBlocksCleared):
                self.ranks.pop(event.dp_rank, None)

    def reset(self) -> None:
        self.ranks.clear()

    def announce(self, translator: Translator, ts: float,
                 extra_ranks: Iterable[int] = ()) -> list[Event]:
        """``AllBlocksCleared`` + ``BlocksStored`` chains re-creating the mirror, per dp rank."""
        out: list[Event] = []
        wid = translator.worker_id
        for rank in sorted(set(self.ranks) | set(extra_ranks)):
            out.extend(translator.clear((rank,), ts))
            # Consecutive blocks of one chain go in one event (store order keeps parents first).
            chains: list[tuple[int | None, list[tuple[int, int]]]] = []
            for block_hash, (parent, th) in self.ranks.get(rank, {}).items():
                if chains and parent == chains[-1][1][-1][0]:
                    chains[-1][1].append((block_hash, th))
                else:
                    chains.append((parent, [(block_hash, th)]))
            out.extend(BlocksStored(wid, translator.take_id(), rank, parent, blocks, ts)
                       for parent, blocks in chains)
        return out
