"""vLLM-like continuous-batching scheduler for the simulated engine; pure, no clock.

Each :meth:`EngineCore.step` plans one forward pass and applies it at once, returning how long that
pass takes in simulated seconds; the async driver (:mod:`workers.engine`) sleeps that long. Tests
drive the core directly and add the durations up: a virtual clock, no sleeping.

One step, like vLLM v1's unified scheduler with chunked prefill:
1. running requests first, in admission order, each asking for all its uncomputed tokens (a
   decode asks for 1), within ``max_num_batched_tokens``; a request that needs a new KV block when
   none is free preempts the most recently admitted running request (recompute: its blocks are
   released, it goes back to the head of the queue and later re-prefills, mostly from cache);
2. then waiting requests, first come first served, while the budget, ``max_num_seqs`` and free
   blocks allow (a request that cannot get its blocks waits, and so does everything behind it).
Step time is :mod:`workers.perf_model`'s, divided by ``speedup_ratio``: by default Dynamo's
mocker polynomial (prefill ``4.209989e-7·T² + 1.518344e-2·T + 16.50142`` ms for the ``T`` uncached
prompt tokens of the step, plus ``max(1, -25.74·u² + 54.01·u + 5.74)`` ms when a token is emitted,
``u`` the share of the KV cache pinned by running requests; the step's tokens are out before
that decode part, ``StepOutcome.tokens_at``, as in Dynamo's mocker), or ``perf_model="linear"``:
``decode_ms_base + decode_ms_per_seq * decoding_seqs + prefill_ms_per_token * prefill_tokens``.
Cached prefix tokens cost nothing: they are never scheduled. When a request's computed tokens
reach its context length it emits one token. The driver honours sub-millisecond steps
(:mod:`workers.engine`).

Disaggregated serving: a request admitted with ``transferred_tokens`` (its prompt's KV blocks
handed over by a prefill engine) counts those tokens as computed without prefill; the step pays
``transfer_ms_per_block`` for each transferred block the engine did not already hold in its own
prefix cache. The last prompt token is always computed here (it yields the first output token).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from errors.root import JetrouterError
from eventlog.hashing import cache_salt_salt, tokens_hashes
from workers.generation import ContextState, next_token, wrong_token
from workers.kvcache import Block, KVCache, KvChange
from workers.perf_model import (
    LINEAR,
    PERF_MODELS,
    POLYNOMIAL,
    linear_step_ms,
    polynomial_decode_ms,
    polynomial_prefill_ms,
)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    num_gpu_blocks: int = 4096
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    perf_model: str = POLYNOMIAL  # workers.perf_model: the step-time model
    # The linear model's constants (unused by the polynomial model).
    prefill_ms_per_token: float = 0.05
    decode_ms_base: float = 8.0
    decode_ms_per_seq: float = 0.05
    speedup_ratio: float = 1.0
    # Admission keeps this share of blocks free so running requests can grow without thrashing.
    watermark: float = 0.01
    # Receiving one KV block from a prefill engine (disaggregated serving).
    transfer_ms_per_block: float = 0.1

    def __post_init__(self) -> None:
        for name in ("num_gpu_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.speedup_ratio <= 0:
            raise ValueError("speedup_ratio must be positive")
        if not self.transfer_ms_per_block >= 0:
            raise ValueError("transfer_ms_per_block must be >= 0")
        if self.perf_model not in PERF_MODELS:
            raise ValueError(f"perf_model must be one of {', '.join(PERF_MODELS)}")

    def step_seconds(self, prefill_tokens: int, decode_seqs: int, *, emits: bool = True,
                     active_blocks: int = 0) -> tuple[float, float]:
        """Simulated seconds of a step computing ``prefill_tokens`` uncached prompt tokens and
        ``decode_seqs`` decoding requests, as (until its tokens are out, after that);
        ``emits``: some request emits a token in it; ``active_blocks``: KV blocks pinned by
        running requests (the polynomial's decode cost).

        The polynomial's decode term comes after the tokens: Dynamo's mocker (1.6.1, measured:
        a lone uncached prompt's first token comes 2.9-3.9 ms after the polynomial's prefill
        time, not after prefill + decode) sends a step's tokens when its prefill part is done
        and then waits out the decode part. The linear model charges one undivided step."""
        if self.perf_model == LINEAR:
            ms = linear_step_ms(prefill_tokens, decode_seqs,
                                prefill_ms_per_token=self.prefill_ms_per_token,
                                decode_ms_base=self.decode_ms_base,
                                decode_ms_per_seq=self.decode_ms_per_seq)
            return ms / 1000.0 / self.speedup_ratio, 0.0
        after = polynomial_decode_ms(active_blocks * self.block_size,
                                     self.num_gpu_blocks * self.block_size) if emits else 0.0
        scale = 1000.0 * self.speedup_ratio
        return polynomial_prefill_ms(prefill_tokens) / scale, after / scale


@dataclass(eq=False)
class SimRequest:
    request_id: str
    prompt_len: int
    max_tokens: int
    tokens: list[int]  # prompt + output so far
    context: ContextState
    tag: Any = None  # the driver's handle; opaque here
    output: list[int] = field(default_factory=list)
    num_computed: int = 0
    blocks: list[Block] = field(default_factory=list)
    num_committed: int = 0  # leading blocks already committed to the cache
    block_hashes: list[int] = field(default_factory=list)  # tokens_hash of full token blocks
    cached_tokens: int | None = None  # prefix-cache hit at first admission
    preemptions: int = 0
    done: bool = False
    transferred_tokens: int = 0  # prompt tokens whose KV a prefill engine hands over
    received_blocks: int = 0  # transferred blocks this engine did not hold (it paid for these)
    # vLLM's cache_salt: xored into the first block's tokens_hash, as vLLM keys it and the
    # router hashes it (eventlog.hashing.cache_salt_salt); 0 for none.
    first_block_salt: int = 0

    def decoding(self) -> bool:
        """Computing only the last emitted token (a decode step, not prefill)."""
        return bool(self.output) and self.num_computed == len(self.tokens) - 1

    def uncomputed(self) -> int:
        return len(self.tokens) - self.num_computed


@dataclass(slots=True)
class StepOutcome:
    duration: float
    prefill_tokens: int
    decode_seqs: int
    emitted: list[tuple[SimRequest, int]]
    finished: list[SimRequest]
    changes: list[KvChange]
    tokens_at: float = 0.0  # seconds into the step when its tokens are out (<= duration)


class RequestTooLarge(JetrouterError, ValueError):
    """Prompt + max_tokens can never fit in this engine's KV cache."""


class EngineCore:
    def __init__(self, config: EngineConfig, *, salt: int = 0) -> None:
        self.config = config
        self.cache = KVCache(config.num_gpu_blocks, config.block_size, salt)
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.wrong_output = False  # the wrong_output fault
        self._watermark_blocks = int(config.watermark * config.num_gpu_blocks)
        self._receiving = 0  # blocks transferred in by this step's admissions

    # --- requests ---------------------------------------------------------------------------

    def add(self, request_id: str, prompt: list[int], max_tokens: int, tag: Any = None,
            transferred_tokens: int = 0, cache_salt: str = "") -> SimRequest:
        if not prompt:
            raise ValueError("prompt must contain at least one token")
        if max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        bs = self.config.block_size
        if -(-(len(prompt) + max_tokens) // bs) > self.config.num_gpu_blocks:
            raise RequestTooLarge(
                f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds the KV cache "
                f"({self.config.num_gpu_blocks} blocks of {bs} tokens)")
        req = SimRequest(request_id, len(prompt), max_tokens, list(prompt), ContextState(prompt),
                         tag, transferred_tokens=max(0, min(transferred_tokens, len(prompt))),
                         first_block_salt=cache_salt_salt(cache_salt))
        self.waiting.append(req)
        return req

    def abort(self, req: SimRequest) -> None:
        """Drop a request wherever it is and free its blocks (client went away)."""
        if req.done:
            return
        req.done = True
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.cache.release(req.blocks)
        req.blocks = []

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    # --- one forward pass -------------------------------------------------------------------

    def step(self) -> StepOutcome:
        plan = self._schedule()
        prefill = sum(n for req, n in plan if not req.decoding())
        decode = sum(1 for req, _ in plan if req.decoding())
        emits = any(req.num_computed + n >= len(req.tokens) for req, n in plan)
        until_tokens, after_tokens = self.config.step_seconds(
            prefill, decode, emits=emits, active_blocks=self.cache.stats().pinned) if plan \
            else (0.0, 0.0)
        duration = until_tokens + after_tokens
        if self._receiving:
            duration += (self.config.transfer_ms_per_block * self._receiving / 1000.0
                         / self.config.speedup_ratio)
            self._receiving = 0
        emitted: list[tuple[SimRequest, int]] = []
        finished: list[SimRequest] = []
        for req, n in plan:
            req.num_computed += n
            self._commit_full_blocks(req)
            if req.num_computed < len(req.tokens):
                continue  # a prefill chunk, more to come
            token = wrong_token(req.context) if self.wrong_output else next_token(req.context)
            req.output.append(token)
            req.tokens.append(token)
            req.context.append(token)
            emitted.append((req, token))
            if len(req.output) >= req.max_tokens:
                req.done = True
                self.running.remove(req)
                self.cache.release(req.blocks)
                req.blocks = []
                finished.append(req)
        return StepOutcome(duration, prefill, decode, emitted, finished, self.cache.drain_changes(),
                           tokens_at=duration - after_tokens)

    def _schedule(self) -> list[tuple[SimRequest, int]]:
        budget = self.config.max_num_batched_tokens
        plan: list[tuple[SimRequest, int]] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.uncomputed(), budget)
            while not self._grow(req, req.num_computed + n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            if self.running[i:i + 1] != [req]:
                break  # req preempted itself: nothing after it is running any more
            plan.append((req, n))
            budget -= n
            i += 1
        if preempted:
            return plan  # memory is tight: admit nothing new this step
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            n = self._admit(self.waiting[0], budget)
            if n is None:
                break
            req = self.waiting.popleft()
            self.running.append(req)
            plan.append((req, n))
            budget -= n
        return plan

    def _preempt(self, req: SimRequest) -> None:
        self.cache.release(req.blocks)
        req.blocks = []
        req.num_computed = 0
        req.num_committed = 0
        req.preemptions += 1
        self.waiting.appendleft(req)

    def _grow(self, req: SimRequest, upto_tokens: int) -> bool:
        need = -(-upto_tokens // self.config.block_size) - len(req.blocks)
        if need <= 0:
            return True
        blocks = self.cache.allocate(need)
        if blocks is None:
            return False
        req.blocks.extend(blocks)
        return True

    def _admit(self, req: SimRequest, budget: int) -> int | None:
        """Pin the request's cached prefix and its first chunk's blocks; tokens to schedule."""
        bs = self.config.block_size
        hits = self.cache.match_prefix(self._hashes(req, len(req.tokens) // bs))
        self.cache.pin(hits)
        computed = min(len(hits) * bs, len(req.tokens) - 1)
        received = 0
        if req.transferred_tokens > computed and not req.preemptions:
            # A recompute after preemption has lost the transferred KV: it prefills like any
            # request. Transfers come in whole blocks, like the prefix cache.
            upto = min(req.transferred_tokens // bs * bs, len(req.tokens) - 1)
            if upto > computed:
                received = -(-(upto - computed) // bs)
                computed = upto
        n = min(len(req.tokens) - computed, budget)
        need = -(-(computed + n) // bs) - len(hits)
        reserve = self._watermark_blocks if self.running else 0
        blocks = self.cache.allocate(need) if need + reserve <= self.cache.available() else None
        if blocks is None:
            self.cache.release(hits)
            return None
        req.blocks = hits + blocks
        req.num_committed = len(hits)
        req.num_computed = computed
        if req.cached_tokens is None:
            req.cached_tokens = min(len(hits) * bs, req.prompt_len)
        if received:
            req.received_blocks += received
            self._receiving += received
        return n

    def _hashes(self, req: SimRequest, full_blocks: int) -> list[int]:
        have = len(req.block_hashes)
        if have < full_blocks:
            bs = self.config.block_size
            req.block_hashes.extend(tokens_hashes(req.tokens[have * bs:full_blocks * bs], bs))
            if have == 0 and req.first_block_salt:
                req.block_hashes[0] ^= req.first_block_salt
        return req.block_hashes[:full_blocks]

    def _commit_full_blocks(self, req: SimRequest) -> None:
        full = req.num_computed // self.config.block_size
        if full <= req.num_committed:
            return
        hashes = self._hashes(req, full)
        for j in range(req.num_committed, full):
            parent = req.blocks[j - 1] if j > 0 else None
            req.blocks[j] = self.cache.commit(req.blocks[j], parent, hashes[j])
        req.num_committed = full

    # --- gauges -----------------------------------------------------------------------------

    def load(self) -> dict[str, int]:
        stats = self.cache.stats()
        prefill = sum(r.uncomputed() for r in (*self.running, *self.waiting) if not r.decoding())
        return {
            "active_decode_blocks": stats.pinned,
            "kv_total_blocks": stats.total,
            "kv_cached_blocks": stats.cached,
            "active_prefill_tokens": prefill,
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
        }
