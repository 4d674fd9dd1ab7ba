"""A run of KV events applied to the compact prefix index at once (a replica catching up).

Catching up after a restart, a replica applies a tail of tens of thousands of KV events. One at a
time, a 4-block event costs the compact index ~25-37 us: a lookup, a placement and a holder change
per block, each in plain Python over the tables. A run of events (``apply_run``) instead costs:

1. one batched lookup, per worker slot, of every block id the run names (stored, removed, or
   named as a parent);
2. the run simulated in plain Python over dicts of just those ids, in event order: parents
   resolved, sequence hashes chained, removals taken — which also gives each event its status;
3. each slot's net change — ids gone or moved, ids new or moved — applied as arrays: a delete and
   an insert per block table (or the one-key methods, for a slot with a few changes), then one
   holder change and one digest sum for all slots together.

Everything the index keeps about a slot — which nodes it holds, its repeated nodes, its digest sum,
its size — is a function of the slot's block map (engine block id -> sequence hash); so applying
the net change of each map gives the index that applying the events one by one gives. Tables may
place keys in other cells (no answer or digest depends on cells). Clears and worker removals free
slots, so they end a run: the caller applies them between runs. Approximate mode keeps expiry
bookkeeping per block: there a run applies event by event. Counters and statuses are the ones the
events one by one give (``tests/unit/replicas/core/test_index_run.py`` checks all of it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, Protocol

import numpy as np

from eventlog.hashing import CHAIN_MULTIPLIER, MASK64
from replicas.core.index_common import U64, WorkerKey
from replicas.core.index_holders import NodeHolders
from replicas.core.index_table import U64Table

STORE, REMOVE = 0, 1
# (STORE, worker, parent block hash | None, [(block_hash, tokens_hash), ...]) or
# (REMOVE, worker, [block_hash, ...], None)
KvOp = tuple[int, WorkerKey, Any, Any]
# What each op gives: a store's status ("ok" | "parent_block_not_found"), a removal's count of
# unknown block hashes (as ``PrefixIndex.store`` / ``remove``)
RunResult = str | int



class PrefixIndex(Protocol):
    """What a run reads and changes of the compact index (``replicas.core.index.PrefixIndex``,
    whose ``apply_run`` calls this module): its tables, as a port, so the two modules do not
    import each other."""

    approximate: bool
    counters: dict[tuple[str, str], int]
    _holders: NodeHolders
    _slots: dict[WorkerKey, int]
    _blocks: list[U64Table]
    _dups: list[dict[int, int]]
    _sums: list[int]
    _total: int

    def _sizes_changed(self) -> None: ...

    def _slot_for(self, worker: WorkerKey) -> int: ...

    def store(self, worker: WorkerKey, parent_block_hash: int | None,
              blocks: Sequence[tuple[int, int]]) -> str: ...

    def remove(self, worker: WorkerKey, block_hashes: Sequence[int]) -> int: ...


# A slot with at most this many lookups / changes uses the tables' one-key methods (~1-2 us a
# key) rather than their array methods (a fixed ~10-40 us of numpy calls).
_FEW_KEYS = 12
_SALT = np.uint64(0x5BD1E9955BD1E995)  # index_common.DIGEST_SALT
_TWO, _ONE = np.uint64(2), np.uint64(1)


def apply_compiled(kernel: ModuleType, index: PrefixIndex, ops: Sequence[KvOp],
                   python_op: Callable[[KvOp], RunResult]) -> list[RunResult]:
    """The ops one by one through the compiled kernel (``_fastindex.c``, ``index_kernel.py``),
    the rare op it does not take on (a number outside ``u64``, another event shape) through
    ``python_op``; each op's result, counted as ``store``/``remove`` count it."""
    index._sizes_changed()
    results: list[RunResult] = []
    n = len(ops)
    stored = lost = removed = unknown = 0
    while True:
        done = kernel.apply_ops(index, ops, len(results))
        for result in done:
            if result.__class__ is int:
                removed += 1
                unknown += result
            elif result == "ok":
                stored += 1
            else:
                lost += 1
        results.extend(done)
        if len(results) >= n:
            break
        results.append(python_op(ops[len(results)]))  # counted by the Python code
    counters = index.counters
    for key, count in ((("stored", "ok"), stored), (("stored", "parent_block_not_found"), lost),
                       (("removed", "ok"), removed), (("removed", "block_not_found"), unknown)):
        if count:
            counters[key] = counters.get(key, 0) + count
    return results


def apply_one(index: PrefixIndex, op: KvOp) -> RunResult:
    kind, worker, a, b = op
    return index.store(worker, a, b) if kind == STORE else index.remove(worker, a)


def apply_run(index: PrefixIndex, ops: Sequence[KvOp]) -> list[RunResult]:
    """Apply stores and removals in order; returns each op's result."""
    if index.approximate or len(ops) < 2:
        return [apply_one(index, op) for op in ops]
    op_slots, refs = _slots_and_ids(index, ops)
    before = {slot: _lookup(index, slot, ids) for slot, ids in refs.items()}
    after = {slot: dict(held[0]) for slot, held in before.items()}
    results = _simulate(index, ops, op_slots, after)
    if refs:
        index._sizes_changed()
        _apply_changes(index, before, after)
    return results


def _slots_and_ids(index: PrefixIndex, ops: Sequence[KvOp]
                   ) -> tuple[list[int], dict[int, list[int]]]:
    """Each op's slot (-1: its worker holds nothing yet, and it cannot create it), and per slot
    every block id the run names. A root store creates its worker's slot here, in op order, as
    applying it would."""
    slots = index._slots
    op_slots: list[int] = []
    refs: dict[int, list[int]] = {}
    for kind, worker, a, b in ops:
        if kind == STORE and a is None:
            slot = index._slot_for(worker)
        else:
            slot = slots.get(worker, -1)
            if slot < 0:
                op_slots.append(-1)
                continue
        op_slots.append(slot)
        ids = refs.get(slot)
        if ids is None:
            refs[slot] = ids = []
        if kind == STORE:
            if a is not None:
                ids.append(a)
            ids.extend([block_hash for block_hash, _ in b])
        else:
            ids.extend(a)
    return op_slots, refs


def _lookup(index: PrefixIndex, slot: int, ids: list[int]
            ) -> tuple[dict[int, int], dict[int, int]]:
    """Of ``ids``, those the slot holds: id -> sequence hash, and id -> cell of its block map."""
    table = index._blocks[slot]
    if not table.size:
        return {}, {}
    if len(ids) <= _FEW_KEYS:
        seqs: dict[int, int] = {}
        cells: dict[int, int] = {}
        find1, mv = table.find1, table.mv
        for block_hash in ids:
            cell = find1(block_hash)
            if cell >= 0:
                seqs[block_hash] = mv[cell]
                cells[block_hash] = cell
        return seqs, cells
    col = np.array(ids, dtype=U64)
    found = table.find(col)
    hit = found >= 0
    at = found[hit]
    held = col[hit].tolist()
    return (dict(zip(held, table.vals.reshape(-1).take(at).tolist(), strict=True)),
            dict(zip(held, at.tolist(), strict=True)))


def _simulate(index: PrefixIndex, ops: Sequence[KvOp], op_slots: list[int],
              after: dict[int, dict[int, int]]) -> list[RunResult]:
    """Run the ops over the slots' id -> sequence hash dicts (``after``: what the run names that
    each slot holds before it, changed in place); count them as the index would."""
    results: list[RunResult] = []
    mult, mask64 = CHAIN_MULTIPLIER, MASK64
    stored = lost = removed = unknown_total = 0
    for (kind, _, a, b), slot in zip(ops, op_slots, strict=True):
        if kind == STORE:
            if slot < 0:
                results.append("parent_block_not_found")
                lost += 1
                continue
            held = after[slot]
            if a is None:
                parent = 0  # a root block's sequence hash is its tokens_hash
            else:
                parent = held.get(a)  # type: ignore[assignment]
                if parent is None:
                    results.append("parent_block_not_found")
                    lost += 1
                    continue
            for block_hash, tokens_hash in b:
                parent = (parent * mult + tokens_hash) & mask64
                held[block_hash] = parent
            results.append("ok")
            stored += 1
        else:
            removed += 1
            if slot < 0:
                unknown = len(a)
            else:
                pop = after[slot].pop
                unknown = 0
                for block_hash in a:
                    if pop(block_hash, None) is None:
                        unknown += 1
            unknown_total += unknown
            results.append(unknown)
    for key, n in ((("stored", "ok"), stored), (("stored", "parent_block_not_found"), lost),
                   (("removed", "ok"), removed),
                   (("removed", "block_not_found"), unknown_total)):
        if n:
            index.counters[key] = index.counters.get(key, 0) + n
    return results


def _apply_changes(index: PrefixIndex, before: dict[int, tuple[dict[int, int], dict[int, int]]],
                   after: dict[int, dict[int, int]]) -> None:
    """Each slot's net change, as arrays: block tables per slot, holders and sums all at once."""
    gone_slots: list[int] = []  # (slot, seq) pairs the slots stop holding
    gone_seqs: list[int] = []
    new_slots: list[int] = []  # (slot, seq) pairs to hold; distinct seqs within a slot
    new_seqs: list[int] = []
    extra: dict[tuple[int, int], int] = {}  # new ids beyond the first of such a pair (rare)
    mix_ids: list[int] = []  # (id, seq) pairs leaving, then pairs arriving, grouped by slot
    mix_seqs: list[int] = []
    mix_groups: list[tuple[int, int, int]] = []  # (slot, pairs leaving, pairs arriving)
    delta = 0
    for slot, (was, cells) in before.items():
        now = after[slot]
        gone = [(h, s) for h, s in was.items() if now.get(h) != s]
        new = [(h, s) for h, s in now.items() if was.get(h) != s]
        if not gone and not new:
            continue
        table = index._blocks[slot]
        if gone:
            ids, seqs = zip(*gone, strict=True)
            at = [cells[h] for h in ids]
            if len(at) <= _FEW_KEYS:
                for cell in at:
                    table.delete1(cell)
            else:
                table.delete(np.array(at, dtype=np.int64))
            mix_ids.extend(ids)
            mix_seqs.extend(seqs)
            dups = index._dups[slot]
            if dups:
                for s in seqs:
                    more = dups.get(s)
                    if more:  # another id of this slot still maps to the node
                        if more == 1:
                            del dups[s]
                        else:
                            dups[s] = more - 1
                    else:
                        gone_slots.append(slot)
                        gone_seqs.append(s)
            else:  # (distinct: a node held under one id only)
                gone_slots.extend([slot] * len(seqs))
                gone_seqs.extend(seqs)
        if new:
            ids, seqs = zip(*new, strict=True)
            if len(ids) <= _FEW_KEYS:
                for h, s in new:
                    table.insert1(h, s)
            else:
                table.insert(np.array(ids, dtype=U64), np.array(seqs, dtype=U64))
            mix_ids.extend(ids)
            mix_seqs.extend(seqs)
            distinct = set(seqs)
            if len(distinct) < len(seqs):  # one content under several new ids
                for s in seqs:
                    extra[slot, s] = extra.get((slot, s), -1) + 1
                seqs = tuple(distinct)
            new_slots.extend([slot] * len(seqs))
            new_seqs.extend(seqs)
        mix_groups.append((slot, len(gone), len(new)))
        delta += len(new) - len(gone)
    index._total += delta
    _update_sums(index, mix_ids, mix_seqs, mix_groups)
    holders = index._holders
    if gone_slots:
        holders.unhold_pairs(np.array(gone_slots, dtype=np.int64),
                             np.array(gone_seqs, dtype=U64))
    if new_slots:
        held = holders.hold_pairs(np.array(new_slots, dtype=np.int64),
                                  np.array(new_seqs, dtype=U64))
        for i in np.flatnonzero(held).tolist():  # held under another id already: one more
            key = (new_slots[i], new_seqs[i])
            extra[key] = extra.get(key, 0) + 1
    for (slot, s), more in extra.items():
        if more:
            dups = index._dups[slot]
            dups[s] = dups.get(s, 0) + more


def _update_sums(index: PrefixIndex, ids: list[int], seqs: list[int],
                 groups: list[tuple[int, int, int]]) -> None:
    """Subtract the leaving pairs' mixes from their slot's sum and add the arriving ones'."""
    if not ids:
        return
    mixes = (np.array(seqs, dtype=U64) ^ _SALT) * (np.array(ids, dtype=U64) * _TWO + _ONE)
    bounds: list[int] = []
    at = 0
    for _, gone, new in groups:  # a group per non-empty part, in order
        if gone:
            bounds.append(at)
            at += gone
        if new:
            bounds.append(at)
            at += new
    part = iter(np.add.reduceat(mixes, bounds, dtype=np.uint64).tolist())
    sums = index._sums
    for slot, gone, new in groups:
        total = sums[slot]
        if gone:
            total -= next(part)
        if new:
            total += next(part)
        sums[slot] = total & MASK64
