"""What every hop runner of one app shares (:class:`RunContext`, built once by
:class:`api.forward.forwarder.Forwarder`), and the response headers every answer carries."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from api.forward.connect_retry import ConnectRetries
from api.forward.first_byte import FirstByteWaits
from api.forward.hops import HopRouter
from api.metrics import RouterMetrics
from api.tokenizer import Tokenizer
from api.upstream import UpstreamPool
from replicas.runtime.replica import Replica

PREDICTED_HEADER = "x-jetrouter-predicted-cached-tokens"


def replica_headers(replica_id: str, worker_id: str | None = None,
                    request_id: str | None = None) -> dict[str, str]:
    h = {"x-jetrouter-replica": replica_id}
    if worker_id:
        h["x-jetrouter-worker"] = worker_id
    if request_id:  # the id to look the decision up with: GET /admin/requests/{id}
        h["x-jetrouter-request-id"] = request_id
    return h


@dataclass(frozen=True, slots=True)
class RunContext:
    """The replica, the metrics, the engine connections, the one place hops are routed, and
    what to do when a connect to an engine times out or a live engine is slow to answer."""

    replica: Replica
    metrics: RouterMetrics
    pool: UpstreamPool
    tokenizer: Tokenizer
    hops: HopRouter
    migration_limit: int
    chat_default_max_tokens: int
    report_failure: Callable[[str, str], None]
    connects: ConnectRetries
    first_byte: FirstByteWaits
