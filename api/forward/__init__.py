"""Forwarding a routed request to its engine, and migrating it when the engine fails.

A request is served by one or more *hops*. The first is the decision :mod:`api.app` made; when an
engine breaks (refused or reset connection, crash mid-stream, 5xx, no byte for the idle timeout)
the request is routed again under ``<request_id>~<n>`` (:func:`eventlog.names.hop_request_id`),
excluding every engine that failed it, and continues there. Client cancellations and 4xx answers
are never migrated. Read in this order:

* :mod:`api.forward.forwarder` — the entry point: :class:`Forwarder` (one per app) starts a run
  per request and hands back a JSON or SSE response.
* :mod:`api.forward.run` — one request through all its hops: each hop's lifecycle on the router
  stream (routed, ``PrefillCompleted`` at its first token, exactly one ``RequestFinished``) and
  the migration policy, in :meth:`~api.forward.run.Run._next_hop`.
* :mod:`api.forward.continuation` — no I/O: what the client has seen, the body of the next hop,
  and how an engine's event becomes the client's.
* :mod:`api.forward.engine` — one hop's connection to one engine: the SSE events, and every way
  it breaks as a :class:`~api.forward.engine.HopFailed`.

Error bodies sent to the client come from :mod:`api.errors`.
"""

from api.forward.forwarder import Forwarder
from api.forward.run import PREDICTED_HEADER, replica_headers

__all__ = ["PREDICTED_HEADER", "Forwarder", "replica_headers"]
