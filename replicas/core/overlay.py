"""The optimistic overlay: a routing decision counts in this replica's load at once.

Between choosing a worker and reading its own `RequestRouted` back from the router stream, a
replica would otherwise judge the next request by a load that does not yet contain the last one
(design.md §7). The overlay holds what each such decision adds — prefill tokens and new decode
blocks on one worker rank — and gives it back when the decision is applied from the stream
(or was never recorded, or finished first). Pure: no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import KeysView, Sequence
from dataclasses import dataclass

from replicas.core import disagg
from replicas.core.index import WorkerKey
from replicas.core.load import ActiveLoad


@dataclass(frozen=True, slots=True)
class PendingDecision:
    """What one decision adds to a worker rank's load until the stream has it."""

    worker: WorkerKey
    prefill_tokens: int
    new_blocks: int


def pending_decision(load: ActiveLoad, worker: WorkerKey, *, isl_tokens: int,
                     overlap_blocks: int, block_size: int,
                     seq_hashes: Sequence[int], phase: disagg.Phase = disagg.AGGREGATED,
                     kv_reuse: bool = True) -> PendingDecision:
    """The load a decision for ``worker`` adds: the prompt tokens its cache does not hold, and
    the prompt blocks no request already running on that rank shares. As the state will count
    it (RouterState applying ``RequestRouted``): a prefill decision adds no decode blocks, a
    decode decision no prefill tokens, and without KV reuse (decode or aggregated) all its
    blocks are its own."""
    prefill = max(isl_tokens - overlap_blocks * block_size, 0)
    new_blocks = len(seq_hashes) - load.active_prefix_len(worker, seq_hashes)
    if phase == disagg.PREFILL:
        new_blocks = 0
    elif phase == disagg.DECODE:
        prefill = 0
    if not kv_reuse and phase != disagg.PREFILL:
        new_blocks = len(seq_hashes)
    return PendingDecision(worker, prefill, new_blocks)


class Overlay:
    """Decisions routed here and not yet applied from the stream, summed per worker rank."""

    def __init__(self) -> None:
        self._pending: dict[str, PendingDecision] = {}
        self._prefill: dict[WorkerKey, int] = {}
        self._decode: dict[WorkerKey, int] = {}
        # Pending decisions per rank: a rank's sums may be 0 while decisions are still pending
        # on it (a prompt fully cached and already running there adds nothing), so only this
        # count says when its entries can go.
        self._count: dict[WorkerKey, int] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._pending

    def add(self, request_id: str, p: PendingDecision) -> None:
        self.reconcile(request_id)  # a request id counts once
        self._pending[request_id] = p
        self._prefill[p.worker] = self._prefill.get(p.worker, 0) + p.prefill_tokens
        self._decode[p.worker] = self._decode.get(p.worker, 0) + p.new_blocks
        self._count[p.worker] = self._count.get(p.worker, 0) + 1

    def reconcile(self, request_id: str) -> None:
        """The decision is in the state now (or never will be): stop counting it here."""
        p = self._pending.pop(request_id, None)
        if p is None:
            return
        left = self._count[p.worker] - 1
        if left:
            self._count[p.worker] = left
            self._prefill[p.worker] -= p.prefill_tokens
            self._decode[p.worker] -= p.new_blocks
        else:
            del self._count[p.worker], self._prefill[p.worker], self._decode[p.worker]

    def clear(self) -> None:
        """A reset re-reads the streams from its cut: nothing pending survives it."""
        self._pending.clear()
        self._prefill.clear()
        self._decode.clear()
        self._count.clear()

    def pending_workers(self) -> KeysView[WorkerKey]:
        """The worker ranks with decisions pending here (a live view; every other rank's
        pending prefill tokens and decode blocks are 0)."""
        return self._count.keys()

    def prefilling(self, worker: WorkerKey) -> list[str]:
        """The decisions pending here that send a prompt to compute to ``worker``."""
        if worker not in self._count:
            return []
        return [r for r, p in self._pending.items() if p.worker == worker and p.prefill_tokens]

    def prefill_tokens(self, worker: WorkerKey) -> int:
        return self._prefill.get(worker, 0)

    def decode_blocks(self, worker: WorkerKey) -> int:
        return self._decode.get(worker, 0)
