"""Tenants: limits as replicated config, usage as replicated state (design.md §5, "Tenants").

A tenant's limits arrive as control-stream events (``TenantLimitsSet``, ``TenantDeleted``); its
usage is computed from router-stream events alone — the ``RequestRouted`` that admitted a
request (``tenant``, ``tenant_tokens``) and the ``RequestFinished`` of each of its hops — so
every replica at equal positions holds the same usage, and a replica that dies takes none of it
with it. Windows are one minute of EVENT time: an admission counts from its ``ts`` for
``WINDOW`` seconds, whatever clock reads the book.

A request is counted once, under its base id (its first decision; a migrated request's later
hops and a disaggregated request's prefill hop carry the tenant but reserve nothing). It is
*concurrent* while any of its hops is in flight. Its tokens are reserved at admission (prompt +
max_tokens) and corrected to prompt + the output its hops reported when it ends other than by
migrating; a request lost with its replica or expired keeps its reservation (the safe side).

Pure: no clock, no I/O. Queries that need "now" take it as an argument.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import xxhash

from eventlog import events as ev
from eventlog.names import PREFILL_HOP, split_hop

WINDOW = 60.0  # seconds of event time a per-minute limit looks back over
_MASK = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class TenantLimits:
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None
    weight: float = 1.0
    isolated: bool = False
    cache_salt: str = ""  # what an isolated tenant's prompts are cached under (not shown)

    @property
    def limited(self) -> bool:
        return (self.requests_per_minute is not None or self.tokens_per_minute is not None
                or self.max_concurrent is not None)

    def to_doc(self) -> dict[str, object]:
        return {"requests_per_minute": self.requests_per_minute,
                "tokens_per_minute": self.tokens_per_minute,
                "max_concurrent": self.max_concurrent, "weight": self.weight,
                "isolated": self.isolated}


@dataclass(frozen=True, slots=True)
class Usage:
    """What a tenant has used: admissions and tokens in the window, requests in flight."""

    requests: int = 0
    tokens: int = 0
    concurrent: int = 0

    def __add__(self, other: Usage) -> Usage:
        return Usage(self.requests + other.requests, self.tokens + other.tokens,
                     self.concurrent + other.concurrent)


@dataclass(slots=True)
class _Charge:
    """One admitted request while it is in the window."""

    tenant: str
    ts: float
    prompt: int
    tokens: int  # reserved at admission; prompt + output once the request ended
    output: int = 0  # output tokens its finished hops reported so far


def _mix(*parts: object) -> int:
    return xxhash.xxh3_64_intdigest(repr(parts).encode(), seed=11)


class TenantBook:
    """Limits and usage of every tenant; replicated state of ``RouterState``."""

    def __init__(self) -> None:
        self.limits: dict[str, TenantLimits] = {}
        # API keys set through the admin API: SHA-256 (hex) -> tenant. The keys themselves are
        # nowhere in the fleet; the file keys of --api-keys-file are not replicated state.
        self.keys: dict[str, str] = {}
        self._charges: dict[str, _Charge] = {}  # base request id -> charge in the window
        # Per tenant: (ts, base id) of its charges in the window, sorted.
        self._window: dict[str, list[tuple[float, str]]] = {}
        self._tokens: dict[str, int] = {}  # per tenant: tokens of its charges in the window
        self._hops: dict[str, str] = {}  # hop request id in flight -> base id
        self._open: dict[str, tuple[str, int]] = {}  # base id -> (tenant, hops in flight)
        self._concurrent: dict[str, int] = {}
        self._usage_digest = 0

    def __bool__(self) -> bool:
        return bool(self.limits) or bool(self._charges) or bool(self._open)

    # --- control stream ------------------------------------------------------------------------

    def set_limits(self, e: ev.TenantLimitsSet) -> str:
        self.limits[e.tenant] = TenantLimits(e.requests_per_minute, e.tokens_per_minute,
                                             e.max_concurrent, e.weight, e.isolated,
                                             e.cache_salt if e.isolated else "")
        return "ok"

    def delete(self, e: ev.TenantDeleted) -> str:
        return "ok" if self.limits.pop(e.tenant, None) is not None else "unknown_tenant"

    def set_key(self, e: ev.ApiKeySet) -> str:
        self.keys[e.key_sha256] = e.tenant
        return "ok"

    def revoke_key(self, e: ev.ApiKeyRevoked) -> str:
        return "ok" if self.keys.pop(e.key_sha256, None) is not None else "unknown_key"

    def keys_of(self, tenant: str) -> list[str]:
        """The digests of ``tenant``'s API keys, sorted."""
        return sorted(d for d, t in self.keys.items() if t == tenant)

    # --- router stream -------------------------------------------------------------------------

    def routed(self, e: ev.RequestRouted) -> None:
        """A decision was applied (not a duplicate): count it for its tenant."""
        if not e.tenant:
            return
        base, hop = split_hop(e.request_id)
        if hop == 0 and base not in self._charges:
            tokens = e.tenant_tokens
            self._charges[base] = _Charge(e.tenant, e.ts, e.isl_tokens, tokens)
            bisect.insort(self._window.setdefault(e.tenant, []), (e.ts, base))
            self._tokens[e.tenant] = self._tokens.get(e.tenant, 0) + tokens
            self._usage_digest += _mix(base, e.tenant, e.ts, tokens)
        self._hops[e.request_id] = base
        tenant, hops = self._open.get(base, (e.tenant, 0))
        if not hops:
            self._concurrent[tenant] = self._concurrent.get(tenant, 0) + 1
        self._open[base] = (tenant, hops + 1)

    def finished(self, request_id: str, outcome: str, output_tokens: int) -> None:
        """A hop's RequestFinished: its output counts; a final end corrects the reservation."""
        base = self._hops.get(request_id)
        if base is None:
            return
        charge = self._charges.get(base)
        if charge is None:
            return
        charge.output += output_tokens
        if outcome == ev.Outcome.MIGRATED or split_hop(request_id)[1] == PREFILL_HOP:
            return  # the request goes on on another hop
        actual = charge.prompt + charge.output
        if actual != charge.tokens:
            self._usage_digest -= _mix(base, charge.tenant, charge.ts, charge.tokens)
            self._tokens[charge.tenant] += actual - charge.tokens
            charge.tokens = actual
            self._usage_digest += _mix(base, charge.tenant, charge.ts, charge.tokens)

    def ended_one(self, request_id: str) -> None:
        """A hop left the in-flight set (finished, lost with its replica, expired)."""
        base = self._hops.pop(request_id, None)
        if base is None:
            return
        tenant, hops = self._open[base]
        if hops > 1:
            self._open[base] = (tenant, hops - 1)
            return
        del self._open[base]
        left = self._concurrent[tenant] - 1
        if left:
            self._concurrent[tenant] = left
        else:
            del self._concurrent[tenant]

    def expire(self, now: float) -> None:
        """Drop admissions older than the window (event time ``now``: the same on every replica
        at equal positions, so the kept set is a function of the applied set)."""
        bound = now - WINDOW
        for tenant in [t for t, w in self._window.items() if w[0][0] < bound]:
            window = self._window[tenant]
            cut = bisect.bisect_left(window, (bound, ""))
            for ts, base in window[:cut]:
                charge = self._charges.pop(base)
                self._tokens[tenant] -= charge.tokens
                self._usage_digest -= _mix(base, tenant, ts, charge.tokens)
            del window[:cut]
            if not window:
                del self._window[tenant], self._tokens[tenant]

    def clear_usage(self) -> None:
        """A state reset: usage is router-stream state and goes; limits are config and stay."""
        self._charges.clear()
        self._window.clear()
        self._tokens.clear()
        self._hops.clear()
        self._open.clear()
        self._concurrent.clear()
        self._usage_digest = 0

    # --- queries -------------------------------------------------------------------------------

    def usage(self, tenant: str, at: float) -> Usage:
        """Usage as of time ``at`` (admissions after ``at - WINDOW``)."""
        window = self._window.get(tenant)
        if not window:
            return Usage(0, 0, self._concurrent.get(tenant, 0))
        cut = bisect.bisect_right(window, (at - WINDOW, "\uffff"))
        tokens = self._tokens[tenant] - sum(self._charges[b].tokens for _, b in window[:cut])
        return Usage(len(window) - cut, tokens, self._concurrent.get(tenant, 0))

    def admissions(self, tenant: str, at: float) -> list[tuple[float, int]]:
        """(ts, tokens) of the tenant's admissions in the window at ``at``, oldest first."""
        window = self._window.get(tenant, [])
        cut = bisect.bisect_right(window, (at - WINDOW, "\uffff"))
        return [(ts, self._charges[b].tokens) for ts, b in window[cut:]]

    def first_admission(self, tenant: str, at: float) -> float | None:
        """The ts of the tenant's oldest admission in the window at ``at``; None: none."""
        window = self._window.get(tenant, [])
        cut = bisect.bisect_right(window, (at - WINDOW, "\uffff"))
        return window[cut][0] if cut < len(window) else None

    def tokens_before(self, tenant: str, ts: float, at: float) -> int:
        """Tokens of the tenant's admissions in the window at ``at`` older than ``ts``."""
        window = self._window.get(tenant, [])
        lo = bisect.bisect_right(window, (at - WINDOW, "\uffff"))
        hi = bisect.bisect_left(window, (ts, ""))
        return sum(self._charges[b].tokens for _, b in window[lo:hi])

    def recent(self, since: float) -> set[str]:
        """Tenants with an admission at ``since`` or later (event time) or a request in flight
        (as applied): the ones that take part in sharing now (``tenant_headroom.py``)."""
        return {*(t for t, w in self._window.items() if w[-1][0] >= since), *self._concurrent}

    def last_admission(self, tenant: str) -> float | None:
        """The ts of the tenant's newest admission in the window; None: none."""
        window = self._window.get(tenant)
        return window[-1][0] if window else None

    def tenant_of(self, request_id: str) -> str | None:
        """The tenant of a hop in flight (as applied); None: unknown or ended."""
        base = self._hops.get(request_id)
        opened = self._open.get(base) if base is not None else None
        return opened[0] if opened is not None else None

    def active(self) -> list[str]:
        """Tenants with admissions in the window or requests in flight (as applied)."""
        return list({*self._window, *self._concurrent})

    def tenants(self) -> list[str]:
        """Every tenant with limits, API keys or usage, sorted."""
        return sorted({*self.limits, *self.keys.values(), *self._window, *self._concurrent})

    @property
    def digest(self) -> int:
        """Order-independent; 0 while nothing is configured or used, so a replica that never
        saw a tenant has the digest replicas had before tenants existed."""
        limits = sum(_mix(t, lim.requests_per_minute, lim.tokens_per_minute, lim.max_concurrent,
                          lim.weight, lim.isolated, lim.cache_salt)
                     for t, lim in self.limits.items())
        opened = sum(_mix(b, t, n) for b, (t, n) in self._open.items())
        keys = sum(_mix(d, t) for d, t in self.keys.items())
        return (limits + opened + keys + self._usage_digest) & _MASK

    # --- snapshots -----------------------------------------------------------------------------

    def to_plain(self) -> dict[str, object]:
        return {
            "limits": {t: [lim.requests_per_minute, lim.tokens_per_minute, lim.max_concurrent,
                           lim.weight, lim.isolated, lim.cache_salt]
                       for t, lim in self.limits.items()},
            "charges": [[b, c.tenant, c.ts, c.prompt, c.tokens, c.output]
                        for b, c in self._charges.items()],
            "hops": dict(self._hops),
            "open": {b: [t, n] for b, (t, n) in self._open.items()},
            # Absent while there is none: a snapshot without keys is what format 2 wrote.
            **({"keys": dict(self.keys)} if self.keys else {}),
        }

    @classmethod
    def from_plain(cls, doc: dict[str, object] | None) -> TenantBook:
        book = cls()
        if not doc:
            return book  # a snapshot written before tenants existed
        for t, limits in doc["limits"].items():  # type: ignore[attr-defined]
            book.limits[t] = TenantLimits(*limits)
        for b, tenant, ts, prompt, tokens, output in doc["charges"]:  # type: ignore[attr-defined]
            book._charges[b] = _Charge(tenant, ts, prompt, tokens, output)
            bisect.insort(book._window.setdefault(tenant, []), (ts, b))
            book._tokens[tenant] = book._tokens.get(tenant, 0) + tokens
            book._usage_digest += _mix(b, tenant, ts, tokens)
        book._hops = dict(doc["hops"])  # type: ignore[call-overload]
        book.keys = dict(doc.get("keys") or {})  # type: ignore[call-overload]
        for b, (t, n) in doc["open"].items():  # type: ignore[attr-defined]
            book._open[b] = (t, n)
            book._concurrent[t] = book._concurrent.get(t, 0) + 1
        return book
