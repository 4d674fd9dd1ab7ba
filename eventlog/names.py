"""Stream, subject and bucket names, all under one namespace prefix (design.md §2)."""

from __future__ import annotations

import re
from dataclasses import dataclass

KV = "kv"
ROUTER = "router"
CONTROL = "control"
STREAM_KINDS: tuple[str, ...] = (KV, ROUTER, CONTROL)

_TOKEN = re.compile(r"^[A-Za-z0-9_-]+$")
ANY = "*"  # the one-token wildcard: subscriptions and permissions cover every id

# A migrated request's later hops are routed under ``<request_id>~<n>``
# (docs/decisions/0008-decisions-carry-candidates-and-hop-ids.md); the
# decision ledger groups them back by the base id.
HOP_SEPARATOR = "~"


# A disaggregated request's prefill decision is routed under ``<request_id>~prefill``
# (api/forward/prefill.py); the ledger files it as hop -1, before the decode hop 0.
PREFILL_SUFFIX = "prefill"
PREFILL_HOP = -1

# The key of a disaggregated request's KV transfer handle in the ``jetrouter`` extension of the
# decode hop's body: the router writes it (api/forward/), the engine reads it (workers/handoff.py).
TRANSFER_KEY = "kv_transfer"


def hop_request_id(base_id: str, hop: int) -> str:
    """The request id of hop ``hop`` (1, 2, ...) of request ``base_id``."""
    return f"{base_id}{HOP_SEPARATOR}{hop}"


def prefill_request_id(base_id: str) -> str:
    """The request id of the prefill hop of disaggregated request ``base_id``."""
    return f"{base_id}{HOP_SEPARATOR}{PREFILL_SUFFIX}"


def split_hop(request_id: str) -> tuple[str, int]:
    """``"abc~2"`` -> ``("abc", 2)``, ``"abc~prefill"`` -> ``("abc", PREFILL_HOP)``; an id
    without such a suffix is hop 0."""
    base, sep, suffix = request_id.rpartition(HOP_SEPARATOR)
    if sep and base and suffix.isdigit():
        return base, int(suffix)
    if sep and base and suffix == PREFILL_SUFFIX:
        return base, PREFILL_HOP
    return request_id, 0


def check_token(value: str, what: str) -> str:
    """Reject ids that would break a NATS subject (dots, wildcards, spaces)."""
    if not _TOKEN.match(value):
        raise ValueError(f"{what} {value!r} must match [A-Za-z0-9_-]+ (it becomes a subject token)")
    return value


def _id_token(value: str, what: str) -> str:
    return value if value == ANY else check_token(value, what)


@dataclass(frozen=True, slots=True)
class Names:
    namespace: str = "jr"

    def __post_init__(self) -> None:
        check_token(self.namespace, "namespace")

    def stream(self, kind: str) -> str:
        """`JR_KV`, `JR_ROUTER`, `JR_CONTROL` for namespace `jr`."""
        return f"{self.namespace.upper().replace('-', '_')}_{kind.upper()}"

    def subjects(self, kind: str) -> str:
        return f"{self.namespace}.{kind}.>"

    def kv_subject(self, worker_id: str) -> str:
        return f"{self.namespace}.{KV}.{_id_token(worker_id, 'worker id')}"

    def router_subject(self, replica_id: str) -> str:
        return f"{self.namespace}.{ROUTER}.{_id_token(replica_id, 'replica id')}"

    def control_subject(self, kind: str) -> str:
        return f"{self.namespace}.{CONTROL}.{_id_token(kind, 'control kind')}"

    def load_subject(self, worker_id: str = ANY) -> str:
        """Core-NATS gauges (not replayed)."""
        return f"{self.namespace}.load.{_id_token(worker_id, 'worker id')}"

    def admin_subject(self, verb: str = ANY) -> str:
        """Core-NATS requests to the leader replica (``snapshot``, ``reset``)."""
        return f"{self.namespace}.admin.{_id_token(verb, 'admin verb')}"

    @property
    def health_report_subject(self) -> str:
        """Core-NATS passive health reports: a replica tells the leader a request failed."""
        return f"{self.namespace}.health.report"

    def reannounce_subject(self, worker_id: str = "*") -> str:
        """Core-NATS request to a worker to re-announce its whole cache."""
        return f"{self.namespace}.reannounce.{worker_id}"

    def heartbeat_subject(self, replica_id: str = "*") -> str:
        """Core-NATS replica heartbeats (never stored: they need no stream leader, so one dead
        NATS server does not delay them)."""
        return f"{self.namespace}.heartbeat.{replica_id}"

    @property
    def snapshot_bucket(self) -> str:
        return f"{self.namespace}-snapshots"

    @property
    def replicas_bucket(self) -> str:
        return f"{self.namespace}-replicas"

    @property
    def leases_bucket(self) -> str:
        return f"{self.namespace}-leases"
