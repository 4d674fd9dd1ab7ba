"""One inference request from its parsed body to its response: every hop it takes.

A request is served by one or more *hops*, each a routing decision on the router stream and an
engine request. The first hop is decided when the request is admitted; when an engine breaks
(refused or reset connection, crash mid-stream, 5xx, no byte for the idle timeout) the request is
routed again under ``<request_id>~<n>`` (:func:`eventlog.names.hop_request_id`), excluding every
engine that failed it, and continues there. Client cancellations and 4xx answers are never
migrated. Read top-down (an import-linter contract keeps this order):

* :mod:`api.forward.conductor` — :class:`~api.forward.conductor.Conductor`, one per app: the
  request from admission to its answer (readiness, shedding, tenant admission, session, first
  hop, forwarding, ``nvext`` fields).
* :mod:`api.forward.forwarder` — :class:`~api.forward.forwarder.Forwarder`, one per app: the
  engine connections, and a hop runner per request.
* :mod:`api.forward.run` — one request relayed token by token through all its hops: each hop's
  lifecycle on the router stream and the migration policy
  (:meth:`~api.forward.run.Run._next_hop`); :mod:`api.forward.passthrough` — the same for
  answers relayed verbatim.
* :mod:`api.forward.context` — what the runners share, and the response headers.
* :mod:`api.forward.hops` — :class:`~api.forward.hops.HopRouter`, the one place a hop is
  routed (``Replica.route``): the first hop (aggregated, or prefill then decode) and the next
  one after a failure.
* :mod:`api.forward.prefill` — the prefill hop of a disaggregated request;
  :mod:`api.forward.handoff` — the KV hand-off per engine kind (vLLM, the simulated engine),
  where another kind plugs in.
* :mod:`api.forward.continuation` — no I/O: what the client has seen, the body of the next hop,
  and how an engine's event becomes the client's; :mod:`api.forward.nvext`,
  :mod:`api.forward.sessions` and :mod:`api.forward.unrouted` — the ``nvext`` response fields,
  engine session calls, and the tokenize calls an engine answers without a decision.
* :mod:`api.forward.engine` — one hop's connection to one engine: the SSE events, and every way
  it breaks as a :class:`~api.forward.engine.HopFailed`.

Error bodies sent to the client come from :mod:`api.errors`.
"""

from api.forward.context import PREDICTED_HEADER, replica_headers
from api.forward.forwarder import Forwarder

__all__ = ["PREDICTED_HEADER", "Forwarder", "replica_headers"]
