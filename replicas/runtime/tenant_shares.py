"""What the router queue reads of tenants' shares on this replica: the fair queue's counters
and lifts (``replicas/core/fair_queue.py``) and the headroom held for tenants under their share
(``replicas/core/tenant_headroom.py``), from the replicated tenant book, this replica's pending
admissions and its wall clock. The rules are the core's; this only gathers their inputs.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet

from replicas.core.fair_queue import newcomer_lifts
from replicas.core.overlay import Overlay
from replicas.core.selection import Candidate
from replicas.core.tenant_admission import TenantPending
from replicas.core.tenant_headroom import (
    ACTIVE_FOR,
    NO_HEADROOM,
    Headroom,
    Standing,
    active_tenants,
    engines_in_prefill,
    headroom,
)
from replicas.runtime.port import ReplicaPort


class TenantShares:
    """Counters, lifts and headroom for one replica's router queue."""

    def __init__(self, port: ReplicaPort, pending: TenantPending, overlay: Overlay,
                 queued_tokens: Callable[[str], int], fraction: float) -> None:
        self.port = port
        self.pending = pending
        self.overlay = overlay
        self._queued_tokens = queued_tokens  # tenant -> tokens still waiting in the queue
        self.fraction = fraction  # --tenant-headroom (0: nothing held)

    def weight(self, tenant: str) -> float:
        limits = self.port.state.tenants.limits.get(tenant)
        return limits.weight if limits is not None else 1.0

    def service(self, tenant: str) -> float:
        """Service ``tenant`` has received, per unit of weight, for the fair queue: its tokens
        in the last minute fleet-wide (the replicated book) plus what this replica admitted
        and the stream has not brought back, less what of that still waits in the queue."""
        book = self.port.state.tenants
        tokens = book.usage(tenant, time.time()).tokens + self.pending.usage(tenant).tokens
        return (tokens - self._queued_tokens(tenant)) / self.weight(tenant)

    def lifts(self) -> dict[str, float]:
        """The fair queue's lifts of newcomers (``newcomer_lifts``). A tenant arrives with its
        first admission in the window, fleet-wide or pending here (a newcomer may be known
        only here yet); what the others were served before is the replicated book's alone
        (requests still waiting here are not service, and every replica reads the same)."""
        book, pending, now = self.port.state.tenants, self.pending, time.time()
        firsts: dict[str, float] = {}
        for tenant in {*book.active(), *pending.tenants()}:
            seen = [ts for ts in (book.first_admission(tenant, now),
                                  pending.first_admission(tenant)) if ts is not None]
            if seen:
                firsts[tenant] = min(seen)
        return newcomer_lifts(firsts, lambda tenant, ts: book.tokens_before(tenant, ts, now)
                              / self.weight(tenant))

    def headroom(self, cands: Sequence[Candidate], threshold: float) -> Headroom:
        """Which open engines over-share tenants leave to the under-share ones now."""
        if self.fraction <= 0:
            return NO_HEADROOM
        state, now = self.port.state, time.time()
        book, pending = state.tenants, self.pending
        active = active_tenants(book, pending.tenants(), now)
        if len(active) < 2:
            return NO_HEADROOM  # alone: nothing is held for nobody
        lifts = self.lifts()
        standings = {t: Standing(self.weight(t), self.service(t) + lifts.get(t, 0.0))
                     for t in active}
        workers = [c.worker for c in cands]
        open_engines = [c.worker for c in cands
                        if c.active_prefill_tokens <= threshold * c.max_num_batched_tokens]

        def tenant_of(request_id: str) -> str | None:
            return book.tenant_of(request_id) or pending.tenant_of(request_id)

        def prefilling(worker: tuple[str, int]) -> itertools.chain[str]:
            return itertools.chain(state.load.prefilling(worker),
                                   self.overlay.prefilling(worker))

        def busy_with(tenants: AbstractSet[str]) -> int:
            return engines_in_prefill(tenants, workers, prefilling, tenant_of)

        def ends(tenant: str) -> float | None:
            if book.usage(tenant, now).concurrent or pending.usage(tenant).requests:
                return None  # its end comes as an event
            last = book.last_admission(tenant)
            return None if last is None else last + ACTIVE_FOR

        return headroom(standings, open_engines, len(cands), busy_with, self.fraction, ends)
