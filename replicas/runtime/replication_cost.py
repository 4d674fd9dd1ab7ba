"""What this replica spends on replication: decoding and applying *other* replicas' router-stream
messages (every replica applies every peer's decisions, so this grows with the cluster's total
request rate, not with this replica's own).

Thread CPU time (``time.thread_time``, ~0.5 µs a read) around the decode (in the reader) and the
apply of each peer message: CPU, not wall time, so a busy machine preempting the replica does not
inflate it; with group commit a message carries many events, so it stays cheap enough to keep
on. ``jetrouter bench scale`` divides ``seconds`` by the process's CPU seconds (from /proc) for
the replication share.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class ReplicationCost:
    seconds: float = 0.0  # CPU seconds: decode + apply of peers' router messages
    messages: int = 0
    events: int = 0

    def note(self, seconds: float, events: int) -> None:
        self.seconds += seconds
        self.messages += 1
        self.events += events

    def view(self) -> dict[str, float | int]:
        return {"seconds": round(self.seconds, 6), "messages": self.messages,
                "events": self.events,
                "us_per_event": round(self.seconds / self.events * 1e6, 2) if self.events else None}
