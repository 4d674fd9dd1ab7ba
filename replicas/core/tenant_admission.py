"""Admitting a tenant's request against its limits: the replicated usage plus this replica's own
admissions the stream has not brought back yet (design.md §5, "Tenants").

``TenantPending`` is to tenants what ``overlay.Overlay`` is to load: between admitting a request
and applying its ``RequestRouted`` from the stream, the replicated book does not contain it, so
the next admission on this replica would be judged without it. Peers' admissions in that same
interval are the only ones a replica cannot see: the fleet-wide overshoot is bounded by what
the other replicas admit within one replication lag
(docs/decisions/0062-tenant-limits-overshoot-one-replication-lag.md).

Pure: the time of the decision is an argument.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from replicas.core.tenants import WINDOW, TenantBook, TenantLimits, Usage


@dataclass(frozen=True, slots=True)
class _Pending:
    tenant: str
    ts: float
    tokens: int


class TenantPending:
    """Admissions made here, not yet applied from the router stream (not replicated)."""

    def __init__(self) -> None:
        self._pending: dict[str, _Pending] = {}
        self._sums: dict[str, Usage] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, request_id: str, tenant: str, ts: float, tokens: int) -> None:
        self.settle(request_id)
        self._pending[request_id] = _Pending(tenant, ts, tokens)
        self._sums[tenant] = self._sums.get(tenant, Usage()) + Usage(1, tokens, 1)

    def settle(self, request_id: str) -> None:
        """Applied from the stream, refused, or never routed: stop counting it here."""
        p = self._pending.pop(request_id, None)
        if p is None:
            return
        left = self._sums[p.tenant] + Usage(-1, -p.tokens, -1)
        if left.requests:
            self._sums[p.tenant] = left
        else:
            del self._sums[p.tenant]

    def clear(self) -> None:
        self._pending.clear()
        self._sums.clear()

    def usage(self, tenant: str) -> Usage:
        return self._sums.get(tenant, Usage())

    def tenant_of(self, request_id: str) -> str | None:
        p = self._pending.get(request_id)
        return p.tenant if p is not None else None

    def tenants(self) -> list[str]:
        """Tenants with admissions pending here."""
        return list(self._sums)

    def admissions(self, tenant: str) -> list[tuple[float, int]]:
        return [(p.ts, p.tokens) for p in self._pending.values() if p.tenant == tenant]

    def first_admission(self, tenant: str) -> float | None:
        """The ts of the tenant's oldest admission pending here; None: none."""
        return min((ts for ts, _ in self.admissions(tenant)), default=None)


@dataclass(frozen=True, slots=True)
class Verdict:
    """The answer to one admission, with what the rate-limit headers say."""

    admitted: bool
    reason: str  # "" when admitted; else which limit: "requests", "tokens", "concurrent"
    retry_after: float  # seconds; 0 when admitted
    limits: TenantLimits
    usage: Usage  # including this request when admitted
    reset_requests: float  # seconds until the request window is empty again
    reset_tokens: float

    def headers(self) -> dict[str, str]:
        """OpenAI's x-ratelimit-* headers for the limits the tenant has."""
        lim, out = self.limits, {}
        if lim.requests_per_minute is not None:
            out["x-ratelimit-limit-requests"] = str(lim.requests_per_minute)
            out["x-ratelimit-remaining-requests"] = str(
                max(lim.requests_per_minute - self.usage.requests, 0))
            out["x-ratelimit-reset-requests"] = duration(self.reset_requests)
        if lim.tokens_per_minute is not None:
            out["x-ratelimit-limit-tokens"] = str(lim.tokens_per_minute)
            out["x-ratelimit-remaining-tokens"] = str(
                max(lim.tokens_per_minute - self.usage.tokens, 0))
            out["x-ratelimit-reset-tokens"] = duration(self.reset_tokens)
        if not self.admitted:
            out["retry-after"] = str(max(1, math.ceil(self.retry_after)))
            out["retry-after-ms"] = str(max(1, math.ceil(self.retry_after * 1000)))
        return out


def duration(seconds: float) -> str:
    """OpenAI's reset format: ``"20ms"``, ``"1.5s"``, ``"6m0s"``."""
    if seconds < 1:
        return f"{max(0, round(seconds * 1000))}ms"
    if seconds < 60:
        return f"{seconds:.3g}s"
    m, s = divmod(round(seconds), 60)
    return f"{m}m{s}s"


# A concurrency limit frees up when some request ends, which no window predicts: the client is
# asked to come back after this long.
CONCURRENT_RETRY = 1.0


def _freed_after(admissions: list[tuple[float, int]], at: float, excess: float,
                 by_tokens: bool) -> float:
    """Seconds from ``at`` until admissions worth ``excess`` (requests, or tokens) leave the
    window; the whole window when even all of them would not do."""
    freed = 0
    for ts, tokens in sorted(admissions):
        freed += tokens if by_tokens else 1
        if freed >= excess:
            return max(ts + WINDOW - at, 0.0)
    return WINDOW


def admit(book: TenantBook, pending: TenantPending, tenant: str, at: float,
          tokens: int) -> Verdict:
    """Whether ``tenant`` may start a request reserving ``tokens`` at time ``at``. Does not
    record it (the caller adds it to ``pending`` when it routes it)."""
    limits = book.limits.get(tenant, TenantLimits())
    used = book.usage(tenant, at) + pending.usage(tenant)
    admissions = book.admissions(tenant, at) + pending.admissions(tenant)
    newest = max((ts for ts, _ in admissions), default=at)
    reset = max(newest + WINDOW - at, 0.0) if admissions else 0.0
    reason, retry = "", 0.0
    rpm, tpm, conc = limits.requests_per_minute, limits.tokens_per_minute, limits.max_concurrent
    if rpm is not None and used.requests + 1 > rpm:
        reason = "requests"
        retry = _freed_after(admissions, at, used.requests + 1 - rpm, by_tokens=False)
    elif tpm is not None and used.tokens + tokens > tpm:
        reason = "tokens"
        retry = _freed_after(admissions, at, used.tokens + tokens - tpm, by_tokens=True)
    elif conc is not None and used.concurrent + 1 > conc:
        reason, retry = "concurrent", CONCURRENT_RETRY
    if not reason:
        used = used + Usage(1, tokens, 1)
        reset = WINDOW
    return Verdict(not reason, reason, retry, limits, used, reset, reset)
