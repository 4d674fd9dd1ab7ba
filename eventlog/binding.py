"""Events are bound to the subject they were published on (design.md §12).

NATS permissions are per subject: an engine's identity may publish only on ``<ns>.kv.<its id>``.
That protects the router only if an event *published there* cannot speak for someone else, so a
message whose events name another party than its subject is refused as a whole by every reader
(deterministically: subject and payload are the same for every replica):

* ``<ns>.kv.<W>``: every event's ``worker_id`` must be ``W``;
* ``<ns>.router.<R>``: ``RequestRouted.replica_id`` and ``ReplicaLost.replica_id`` must be ``R``.

Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Sequence

from eventlog.events import Event, ReplicaLost, RequestRouted

_SUBJECT_TOKENS = 3  # <namespace>.<kind>.<id>; namespaces and ids hold no dots (names.py)


def foreign_party(subject: str, events: Sequence[Event]) -> str | None:
    """The first party id in ``events`` that differs from the one ``subject`` names (None when
    all agree, or when the subject binds no party, e.g. control subjects)."""
    tokens = subject.split(".")
    if len(tokens) != _SUBJECT_TOKENS:
        return None
    kind, owner = tokens[1], tokens[2]
    if kind == "kv":
        for e in events:
            worker = getattr(e, "worker_id", owner)
            if worker != owner:
                return str(worker)
    elif kind == "router":
        for e in events:
            if isinstance(e, RequestRouted | ReplicaLost) and e.replica_id != owner:
                return e.replica_id
    return None
