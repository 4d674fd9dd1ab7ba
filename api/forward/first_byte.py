"""A hop whose engine is silent before its first byte: wait for a live engine, bounded.

``--stream-idle-timeout`` (30 s) ends a hop when its engine sends nothing for that long, and the
request moves to another engine or fails. Before the first byte of the engine's answer that is
the wrong judgement for a *busy* engine: a long prompt on a loaded engine, or a disaggregated
decode hop whose KV transfer is the first since the engine started (vLLM's first NIXL handshake
took over 30 s on two busy cores here), is silent for a long time and then answers. Moving such a
request computes its prompt again somewhere else, and with no other engine it fails a request
that was about to be served.

A hung engine is silent too, and its process may still publish load gauges. What tells the two
apart is work: a busy engine's KV events (blocks it stores as it computes prompts, its own and
others') go on, a hung engine's stop. So while no byte of the answer has come, the hop keeps
waiting past an idle timeout when the engine is

* alive — its load gauges, which an engine (or its bridge, also while the engine computes
  without answering ``/metrics``: workers/bridge/monitor.py) publishes every second or so, are
  more recent than ``--worker-timeout``, the judgement the leader retires engines by; and
* working — a KV message of it was applied within the last ``--stream-idle-timeout``, or the
  hop is the decode hop of a KV hand-off, whose engine pulls the prompt's blocks before its
  first token and stores nothing until the pull is done (vLLM's first NIXL transfer after a
  start took over 30 s on two busy cores here);

and the hop has waited less than ``--first-byte-timeout`` since its request went out. Once the
first byte has come, the idle timeout applies as before: a stream that stops mid-answer is a
failure, and a hung engine is still left after ``--stream-idle-timeout``.

Every idle timeout before a first byte is counted in
``jetrouter_engine_first_byte_waits_total{action}``: ``waited`` (the engine alive, the hop kept
waiting) or ``failed`` (the timeout stood).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from api.upstream import Patience

log = logging.getLogger("jetrouter.forward")


class WaitAction(StrEnum):
    """What followed an idle timeout before a hop's first byte: the metric's ``action``."""

    WAITED = "waited"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class FirstBytePolicy:
    """Whether a hop silent for ``waited`` seconds since its request went out keeps waiting.
    Pure."""

    limit: float  # --first-byte-timeout

    def __post_init__(self) -> None:
        if self.limit < 0:
            raise ValueError("the first-byte timeout must be >= 0")

    def keep_waiting(self, waited: float, *, alive: bool, working: bool) -> bool:
        return alive and working and waited < self.limit


class FirstByteWaits:
    """The policy applied, one per app: ``alive(worker_id)`` is the replica's liveness view
    (api/forward/connect_retry.py's), ``working(worker_id)`` whether a KV message of the engine
    was applied lately, ``record(action)`` counts each idle timeout before a first byte by what
    followed."""

    def __init__(self, policy: FirstBytePolicy, alive: Callable[[str], bool],
                 working: Callable[[str], bool], *,
                 record: Callable[[WaitAction], None] | None = None) -> None:
        self.policy = policy
        self.alive = alive
        self.working = working
        self._record = record

    def patience(self, worker_id: str, request_id: str, *,
                 handoff: bool = False) -> Patience | None:
        """What the upstream client asks when ``request_id``'s hop to ``worker_id`` has been
        silent for an idle timeout before its first byte; None when waiting is off.
        ``handoff``: the hop's engine pulls the prompt's KV blocks first."""
        if self.policy.limit <= 0:
            return None
        warned = False

        def keep_waiting(waited: float) -> bool:
            nonlocal warned
            alive = self.alive(worker_id)
            working = handoff or self.working(worker_id)
            wait = self.policy.keep_waiting(waited, alive=alive, working=working)
            if self._record is not None:
                self._record(WaitAction.WAITED if wait else WaitAction.FAILED)
            if wait and not warned:
                warned = True
                log.warning("request %s: no byte from %s for %.1fs, but it is alive and %s; "
                            "waiting for its answer up to %gs", request_id, worker_id, waited,
                            "pulling the prompt's KV blocks" if handoff else "working",
                            self.policy.limit)
            elif not wait and warned:
                log.warning("request %s: %s still silent after %.1fs (%s); giving up",
                            request_id, worker_id, waited,
                            "out of time" if alive and working else
                            "no longer heard from" if not alive else "no longer working")
            return wait

        return keep_waiting
