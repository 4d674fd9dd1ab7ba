"""Which worker slots hold each node (sequence hash) of the compact prefix index (``index.py``).

One :class:`U64Table` from sequence hash to an ``int32``: the one slot holding the node (``>= 0``),
or ``-2 - row`` where ``row`` is a row of ``rows``, a bitmap of slots (one ``u64`` word per 64
slots), once several slots hold it. Most blocks are held by one worker, so most nodes cost one
13-byte cell; a shared system prompt held by all 256 workers costs a 32-byte bitmap per block. A
bitmap left with one holder goes back to a plain slot, so the layout depends only on membership
(as after a restore), and its row is reused.

Every change comes in two forms: over an array of nodes (a KV event of many blocks, in a fixed
handful of numpy calls) and for one node (events of a few blocks, in plain Python over the
table's memoryviews, where a numpy call would cost more than the whole change).
"""

from __future__ import annotations

import numpy as np

from replicas.core.index_common import U64, popcount
from replicas.core.index_table import U64Table

_ONE = np.uint64(1)
_SIXTY_THREE = np.uint64(63)


def bits_of(slots: np.ndarray) -> np.ndarray:
    """``1 << (slot % 64)`` as ``u64``, per slot."""
    return np.left_shift(_ONE, slots.astype(U64) & _SIXTY_THREE)


def _repeats(seqs: np.ndarray) -> bool:
    ordered = np.sort(seqs)
    return bool((ordered[1:] == ordered[:-1]).any())


def _by_slot(slots: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """(slot, positions of its pairs) per distinct slot."""
    order = np.argsort(slots, kind="stable")
    cuts = np.flatnonzero(np.diff(slots[order])) + 1
    return [(int(slots[part[0]]), part) for part in np.split(order, cuts)]


class NodeHolders:
    def __init__(self) -> None:
        self.nodes = U64Table(np.int32)  # seq -> slot, or -2 - row of ``rows``
        self.rows = np.zeros((0, 1), dtype=U64)  # holder bitmaps of nodes several slots hold
        self.rows_free: list[int] = []
        self.rows_used = 0

    def widen(self, slot: int) -> None:
        """Make the bitmaps wide enough for ``slot``."""
        words = slot // 64 + 1
        if words > self.rows.shape[1]:
            wider = np.zeros((len(self.rows), words), dtype=U64)
            wider[:, :self.rows.shape[1]] = self.rows
            self.rows = wider

    def nbytes(self) -> int:
        return self.nodes.nbytes() + self.rows.nbytes

    def _alloc_rows(self, k: int) -> np.ndarray:
        reuse = min(k, len(self.rows_free))
        out = [self.rows_free.pop() for _ in range(reuse)]
        fresh = k - reuse
        if self.rows_used + fresh > len(self.rows):
            grown = np.zeros((max(2 * len(self.rows), self.rows_used + fresh, 64),
                              self.rows.shape[1]), dtype=U64)
            grown[:len(self.rows)] = self.rows
            self.rows = grown
        out.extend(range(self.rows_used, self.rows_used + fresh))
        self.rows_used += fresh
        rows = np.array(out, dtype=np.int64)
        self.rows[rows] = 0
        return rows

    # --- arrays of nodes ---------------------------------------------------------------------

    def hold(self, slot: int, seqs: np.ndarray) -> np.ndarray:
        """Make ``slot`` a holder of each (distinct) node; True where it held it already."""
        nodes = self.nodes
        cells, (home1, home2) = nodes.find_homes(seqs)
        new = cells < 0
        dup = np.zeros(len(seqs), dtype=bool)
        old = np.flatnonzero(~new)
        if len(old):
            at = cells[old]
            flat = nodes.vals.reshape(-1)
            v = flat[at].astype(np.int64)
            single = v >= 0
            mine = single & (v == slot)
            dup[old[mine]] = True
            grow = single & ~mine  # one other holder so far: the node gets a bitmap row
            if grow.any():
                others = v[grow]
                rows = self._alloc_rows(len(others))
                self.rows[rows, others >> 6] |= bits_of(others)
                self.rows[rows, slot >> 6] |= _ONE << np.uint64(slot & 63)
                flat[at[grow]] = -2 - rows
            multi = ~single
            if multi.any():
                rows = -2 - v[multi]
                word, bit = slot >> 6, _ONE << np.uint64(slot & 63)
                held = (self.rows[rows, word] & bit) != 0
                dup[old[multi][held]] = True
                self.rows[rows[~held], word] |= bit
        if not len(old):
            nodes.insert(seqs, np.full(len(seqs), slot, dtype=np.int32), (home1, home2))
        elif len(old) < len(seqs):
            nodes.insert(seqs[new], np.full(len(seqs) - len(old), slot, dtype=np.int32),
                         (home1[new], home2[new]))
        return dup

    def unhold(self, slot: int, seqs: np.ndarray) -> None:
        """Stop ``slot`` holding each (distinct, held) node; a node nobody holds is deleted."""
        if not len(seqs):
            return
        nodes = self.nodes
        cells = nodes.find(seqs)
        cells = cells[cells >= 0]  # always all of them, short of a 64-bit hash collision
        flat = nodes.vals.reshape(-1)
        v = flat[cells].astype(np.int64)
        single = v >= 0
        multi = ~single
        if multi.any():
            at, rows = cells[multi], -2 - v[multi]
            self.rows[rows, slot >> 6] &= ~(_ONE << np.uint64(slot & 63))
            self._lone_back_to_slots(at, rows)
        nodes.delete(cells[single & (v == slot)])

    # --- (slot, node) pairs of many slots (a run of events: index_run.py) --------------------

    def hold_pairs(self, slots: np.ndarray, seqs: np.ndarray) -> np.ndarray:
        """``hold`` for distinct (slot, node) pairs, a node possibly taken by several slots;
        True where the slot held the node already. Each node's holders become one bitmap (its
        old holders and the pairs' slots), then a plain slot again if there is one holder."""
        n = len(seqs)
        order = np.argsort(seqs, kind="stable")
        ordered, taking = seqs[order], slots[order]
        first = np.empty(n, dtype=bool)
        first[:1] = True
        np.not_equal(ordered[1:], ordered[:-1], out=first[1:])
        group = np.cumsum(first) - 1
        nodes = self.nodes
        distinct = ordered[first]
        cells, (home1, home2) = nodes.find_homes(distinct)
        present = cells >= 0
        flat = nodes.vals.reshape(-1)
        v = np.full(len(distinct), -1, dtype=np.int64)
        v[present] = flat[cells[present]]
        bitmaps = np.zeros((len(distinct), self.rows.shape[1]), dtype=U64)
        single = np.flatnonzero(v >= 0)
        bitmaps[single, v[single] >> 6] = bits_of(v[single])
        was_row = np.flatnonzero(present & (v < 0))
        bitmaps[was_row] = self.rows[-2 - v[was_row]]
        words, bits = taking >> 6, bits_of(taking)
        held = (bitmaps[group, words] & bits) != 0
        np.bitwise_or.at(bitmaps, (group, words), bits)
        value = np.where(present, v, taking[first])  # the one holder, where there is one
        shared = popcount(bitmaps).sum(axis=1) > 1
        row = np.where(v < -1, -2 - v, -1)
        fresh = shared & (row < 0)
        row[fresh] = self._alloc_rows(int(fresh.sum()))
        self.rows[row[shared]] = bitmaps[shared]
        value[shared] = -2 - row[shared]
        flat[cells[present]] = value[present]
        absent = ~present
        if absent.any():
            nodes.insert(distinct[absent], value[absent].astype(np.int32),
                         (home1[absent], home2[absent]))
        dup = np.empty(n, dtype=bool)
        dup[order] = held
        return dup

    def unhold_pairs(self, slots: np.ndarray, seqs: np.ndarray) -> None:
        """``unhold`` for distinct (slot, node) pairs, each held."""
        if _repeats(seqs):  # a node several slots leave in this run: slot by slot
            for slot, at in _by_slot(slots):
                self.unhold(slot, seqs[at])
            return
        nodes = self.nodes
        cells = nodes.find(seqs)
        known = cells >= 0  # always all of them, short of a 64-bit hash collision
        cells, slots = cells[known], slots[known]
        flat = nodes.vals.reshape(-1)
        v = flat[cells].astype(np.int64)
        single = v >= 0
        multi = ~single
        if multi.any():
            at, rows, leaving = cells[multi], -2 - v[multi], slots[multi]
            self.rows[rows, leaving >> 6] &= ~bits_of(leaving)
            self._lone_back_to_slots(at, rows)
        nodes.delete(cells[single & (v == slots)])

    def _lone_back_to_slots(self, cells: np.ndarray, rows: np.ndarray) -> None:
        """Nodes at ``cells`` whose bitmap ``rows`` kept one holder go back to a plain slot."""
        bitmaps = self.rows[rows]
        lone = popcount(bitmaps).sum(axis=1) == 1
        if lone.any():
            words = bitmaps[lone]
            word = (words != 0).argmax(axis=1)
            top = words[np.arange(len(word)), word].astype(np.float64)  # a power of two
            self.nodes.vals.reshape(-1)[cells[lone]] = word * 64 + np.frexp(top)[1] - 1
            self.rows_free.extend(rows[lone].tolist())

    # --- one node ----------------------------------------------------------------------------

    def hold1(self, slot: int, seq: int) -> bool:
        """``hold`` for one node: True if ``slot`` held it already."""
        nodes = self.nodes
        cell = nodes.find1(seq)
        if cell < 0:
            nodes.insert1(seq, slot)
            return False
        v = nodes.mv[cell]
        word, bit = slot >> 6, 1 << (slot & 63)
        if v >= 0:
            if v == slot:
                return True
            row = int(self._alloc_rows(1)[0])
            self.rows[row, v >> 6] = 1 << (v & 63)
            self.rows[row, word] |= np.uint64(bit)
            nodes.mv[cell] = -2 - row
            return False
        row = -2 - v
        mask = int(self.rows[row, word])
        if mask & bit:
            return True
        self.rows[row, word] = mask | bit
        return False

    def unhold1(self, slot: int, seq: int) -> None:
        """``unhold`` for one node."""
        nodes = self.nodes
        cell = nodes.find1(seq)
        if cell < 0:
            return  # only a 64-bit hash collision gets here
        v = nodes.mv[cell]
        if v >= 0:
            if v == slot:
                nodes.delete1(cell)
            return
        row = -2 - v
        word = slot >> 6
        self.rows[row, word] = int(self.rows[row, word]) & ~(1 << (slot & 63))
        left = [(w, int(x)) for w, x in enumerate(self.rows[row].tolist()) if x]
        if len(left) == 1 and left[0][1].bit_count() == 1:
            w, x = left[0]
            nodes.mv[cell] = w * 64 + x.bit_length() - 1
            self.rows_free.append(row)

    # --- queries and restore -----------------------------------------------------------------

    def prefix_holders(self, seq_hashes: np.ndarray) -> np.ndarray:
        """The holder values of the query's leading nodes up to the first one nobody holds."""
        cells = self.nodes.find(seq_hashes)
        missing = np.flatnonzero(cells < 0)
        end = int(missing[0]) if len(missing) else len(cells)
        return self.nodes.vals.reshape(-1).take(cells[:end]).astype(np.int64)

    def match(self, holders: np.ndarray) -> tuple[list[int], list[int]]:
        """(slots, match lengths) from the holders of the prompt's leading nodes (all held):
        AND the holder bitmaps along the prompt; a slot's match length is the number of
        positions whose running AND still has its bit, so each point where the running set
        shrinks gives the slots that left there their length."""
        end = len(holders)
        rows = np.zeros((end, self.rows.shape[1]), dtype=U64)
        single = np.flatnonzero(holders >= 0)
        slots = holders[single]
        rows[single, slots >> 6] = bits_of(slots)
        multi = np.flatnonzero(holders < 0)
        rows[multi] = self.rows[-2 - holders[multi]]
        running = np.bitwise_and.accumulate(rows, axis=0)
        shrink = np.flatnonzero((running[1:] != running[:-1]).any(axis=1)) + 1
        lengths = np.append(shrink, end)
        before = running[lengths - 1]
        after = np.zeros_like(before)
        after[:-1] = running[shrink]
        left = np.unpackbits((before & ~after).view(np.uint8), axis=1, bitorder="little")
        at, slot_ids = np.nonzero(left)
        return slot_ids.tolist(), lengths[at].tolist()

    def restore(self, seqs: np.ndarray, slots: np.ndarray) -> None:
        """The table and bitmaps from every (node, holder) pair, in bulk."""
        order = np.argsort(seqs, kind="stable")
        seqs, slots = seqs[order], slots[order]
        n = len(seqs)
        first = np.empty(n, dtype=bool)
        first[0] = True
        np.not_equal(seqs[1:], seqs[:-1], out=first[1:])
        starts = np.flatnonzero(first)
        counts = np.diff(np.append(starts, n))
        vals = slots[starts].astype(np.int32)
        shared = np.flatnonzero(counts > 1)
        if len(shared):
            rows = self._alloc_rows(len(shared))
            row_of = np.full(len(starts), -1, dtype=np.int64)
            row_of[shared] = rows
            group = np.cumsum(first) - 1
            member = row_of[group] >= 0
            np.bitwise_or.at(self.rows, (row_of[group[member]], slots[member] >> 6),
                             bits_of(slots[member]))
            vals[shared] = -2 - rows
        self.nodes = U64Table(np.int32, capacity=len(starts))
        self.nodes.insert(seqs[starts], vals)
