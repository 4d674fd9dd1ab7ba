"""``WorkerRegistered`` as earlier releases declared it, for the tests that events written by
one still decode and apply, and that one decodes today's events."""

from __future__ import annotations

import msgspec

from eventlog.events import WorkerRegistered

# The required fields alone, without any of the optional ones (dp ranks, LoRAs, roles, engine
# kinds, bootstrap ports): a message of an engine registered before those existed, which today's
# code must read with the defaults. Taken from today's declaration, whose required fields are
# the ones every release wrote.
BareWorkerRegistered = msgspec.defstruct(
    "BareWorkerRegistered",
    [(f.name, f.type) for f in msgspec.structs.fields(WorkerRegistered) if f.required],
    tag="WorkerRegistered", frozen=True)


class PreviousWorkerRegistered(BareWorkerRegistered, frozen=True):  # type: ignore[misc,valid-type]
    """As the release before ``bootstrap_port`` declared it: its optional fields written out, as
    that release shipped them, whatever today's code says."""

    dp_size: int = 1
    loras: list[str] = []
    role: str = "both"
    engine_kind: str = "jetrouter"
