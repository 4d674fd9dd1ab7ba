"""Prefill load decay (``--router-prefill-load-model linear``): how much of a worker's active
prefill is probably done already, in event time.

Without a model a request's uncached prompt tokens count in full until its first token
(``PrefillCompleted``). With ``linear`` the router predicts a prefill's duration as
``tokens / throughput`` and lets the *oldest* modeled prefill on each worker rank (the anchor)
decay linearly from the moment the engine can have started it; the others stay whole until they
become the anchor. Only the anchor decays because an engine works its prefill queue roughly in
arrival order: the newer prompts have not started.

Throughput is learned per worker rank from its most recent prefill completions, in event time
only (``RequestRouted.ts`` → ``PrefillCompleted.ts``, both stamped by the replica that routed the
request, so no two clocks are compared): their uncached tokens divided by the time covered by the
union of their ``[routed, first token]`` intervals. The union counts queueing behind other prompts
once, not once per waiting request, and prompts prefilled in one batch add tokens without adding
time. The anchor starts when the last completion routed before it came in (or when it was routed,
if later), so a newer prompt that finishes first does not restart its decay.

Every figure is a function of the *set* of completions applied (the most recent ``KEEP`` by first
token time), never of the order they were applied in, so replicas agree and digests stay
order-independent like the rest of the state (design.md §5). Pure: no clock, no I/O.
"""

from __future__ import annotations

import heapq
import struct
from enum import StrEnum

import xxhash

KEEP = 32  # completions remembered per worker rank: the estimate follows a slowing engine
MIN_BUSY_SECONDS = 1e-3  # below this, no estimate (a burst of instant completions says nothing)
_MASK64 = (1 << 64) - 1

Completion = tuple[float, str, float, int]
"""(first token ts, request id, routed ts, uncached prompt tokens)."""


class PrefillLoadModel(StrEnum):
    """``--router-prefill-load-model``; recorded on each ``RequestRouted``."""

    NONE = "none"      # prompt load charged in full until the first token
    LINEAR = "linear"  # the oldest active prefill decays by its predicted duration


PREFILL_LOAD_MODELS = tuple(m.value for m in PrefillLoadModel)


def _completion_mix(c: Completion) -> int:
    done, rid, routed, tokens = c
    return xxhash.xxh3_64_intdigest(struct.pack("<ddq", done, routed, tokens) + rid.encode(),
                                    seed=3)


class WorkerPrefill:
    """One worker rank: its recent prefill completions and its pending modeled prefills."""

    __slots__ = ("_rate", "_start", "digest", "done", "pending", "pending_ids")

    def __init__(self) -> None:
        self.done: list[Completion] = []  # min-heap: the oldest kept completion first
        self.digest = 0  # sum of the kept completions' mixes
        # Modeled prefills still pending: id -> routed ts, and (routed ts, id) oldest first,
        # where entries of requests that left (or started again later) are dropped lazily.
        self.pending_ids: dict[str, float] = {}
        self.pending: list[tuple[float, str]] = []
        self._rate: tuple[float | None] | None = None  # cached throughput (None: stale)
        self._start: tuple[tuple[float, str], float] | None = None  # cached (anchor, start)

    # --- learning --------------------------------------------------------------------------

    def observe(self, request_id: str, tokens: int, routed_ts: float, done_ts: float) -> None:
        """A prefill of ``tokens`` routed at ``routed_ts`` produced its first token at
        ``done_ts``. A fully cached prompt (0 tokens) says nothing about prefill speed."""
        if tokens <= 0:
            return
        c: Completion = (done_ts, request_id, routed_ts, tokens)
        if len(self.done) >= KEEP:
            if c < self.done[0]:
                return  # older than everything kept: it would be dropped at once
            self.digest = (self.digest - _completion_mix(heapq.heappushpop(self.done, c))) \
                & _MASK64
        else:
            heapq.heappush(self.done, c)
        self.digest = (self.digest + _completion_mix(c)) & _MASK64
        self._rate = None
        self._start = None

    def throughput(self) -> float | None:
        """Learned prompt tokens per second, None before any usable observation."""
        if self._rate is None:
            self._rate = (_rate(self.done),)
        return self._rate[0]

    # --- the anchor ------------------------------------------------------------------------

    def start(self, request_id: str, ts: float) -> None:
        """A modeled prefill was routed to the rank at ``ts``."""
        self.pending_ids[request_id] = ts
        heapq.heappush(self.pending, (ts, request_id))

    def leave(self, request_id: str) -> None:
        """A modeled prefill left (first token, finish, loss)."""
        self.pending_ids.pop(request_id, None)

    def anchor(self) -> tuple[float, str] | None:
        """(routed ts, id) of the oldest pending modeled prefill."""
        pending, live = self.pending, self.pending_ids
        # An entry is stale once its request left, or started again with another routed ts
        # (its newest start is the one that counts).
        while pending and live.get(pending[0][1]) != pending[0][0]:
            heapq.heappop(pending)
        return pending[0] if pending else None

    def anchor_start(self, anchor: tuple[float, str]) -> float:
        """When the engine could start the anchor: the latest first token of the kept
        completions routed before it, or the anchor's routing if that is later."""
        cached = self._start
        if cached is not None and cached[0] == anchor:
            return cached[1]
        start = anchor[0]
        for done, rid, routed, _ in self.done:
            if (routed, rid) < anchor and done > start:
                start = done
        self._start = (anchor, start)
        return start

    def remaining(self, tokens: int, anchor: tuple[float, str], now: float) -> float:
        """What is left at event time ``now`` of the anchor's ``tokens``."""
        rate = self.throughput()
        if rate is None:
            return float(tokens)
        elapsed = max(now - self.anchor_start(anchor), 0.0)
        return max(float(tokens) - elapsed * rate, 0.0)

    # --- snapshots -------------------------------------------------------------------------

    def plain(self) -> list[list[object]]:
        return [list(c) for c in sorted(self.done)]

    @classmethod
    def from_plain(cls, rows: list[list[object]]) -> WorkerPrefill:
        wp = cls()
        for done, rid, routed, tokens in rows:
            wp.observe(str(rid), int(tokens), float(routed), float(done))  # type: ignore[arg-type]
        return wp


def _rate(done: list[Completion]) -> float | None:
    """Tokens over the length of the union of the ``[routed, first token]`` intervals."""
    if not done:
        return None
    busy = 0.0
    end = float("-inf")
    for lo, hi in sorted((routed, max(d, routed)) for d, _, routed, _ in done):
        if lo > end:
            busy += hi - lo
            end = hi
        elif hi > end:
            busy += hi - end
            end = hi
    tokens = sum(c[3] for c in done)
    if busy < MIN_BUSY_SECONDS:
        return None
    return tokens / busy
