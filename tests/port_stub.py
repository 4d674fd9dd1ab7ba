"""The identity half of `replicas.runtime.port.ReplicaPort` for test stand-ins: a replica id, the
namespace's names, always ready, leader when told. Subclasses add what they append and apply."""

from __future__ import annotations

from eventlog.names import Names


class PortIdentity:
    rid: str
    leader: bool
    port_names: Names

    @property
    def replica_id(self) -> str:
        return self.rid

    @property
    def names(self) -> Names:
        return self.port_names

    @property
    def ready(self) -> bool:
        return True

    @property
    def is_leader(self) -> bool:
        return self.leader
