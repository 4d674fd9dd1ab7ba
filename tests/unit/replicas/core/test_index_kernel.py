"""The compact index's compiled kernel (``_fastindex.c``) against its Python code: the same state.

Events of a few blocks apply block by block in both, step for step, so there the two leave the
same arrays cell for cell (block tables, node table, bitmaps, free rows), besides the same
results, counters, digests and answers. Longer events (the Python code applies them as arrays,
placing keys in other cells), runs, and bulk loads of a table are checked likewise, cell
placement aside where the Python code itself places differently. ``JETROUTER_PURE_PYTHON`` turns
the kernel off.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eventlog.packed_pairs import PackedPairs
from replicas.core import index_kernel
from replicas.core.index import PrefixIndex
from replicas.core.index_common import U64
from replicas.core.index_run import STORE
from replicas.core.index_table import U64Table
from tests.pure_python import printed_with_pure_python
from tests.unit.replicas.core.kernel_switch import kernel
from tests.unit.replicas.core.test_index_compact import (
    BIG,
    IDS,
    KEYS,
    MANY,
    QUERIES,
    TOKENS,
    answers,
    op_strategy,
    through_msgpack,
)
from tests.unit.replicas.core.test_index_run import apply_each, apply_in_runs, inner_state

pytestmark = pytest.mark.skipif(not index_kernel.available(),
                                reason="the compiled index kernel is not built here")


def cells(index: PrefixIndex) -> tuple[object, ...]:
    """Every array of the index, cell for cell, and the bookkeeping beside them."""
    tables = [index._holders.nodes, *index._blocks]
    return (inner_state(index), [(t.keys.tolist(), t.vals.tolist(), t.occ.tolist(), t.size)
                                 for t in tables],
            index._holders.rows[:index._holders.rows_used].tolist(), index._holders.rows_free,
            index._holders.rows_used, index._keys, index._free)


Apply = Callable[[PrefixIndex, list[tuple[object, ...]]], list[object]]


def both_ways(ops: list[tuple[object, ...]], apply: Apply = apply_each
              ) -> tuple[PrefixIndex, PrefixIndex, list[object], list[object]]:
    """The ops applied with the Python code (one by one) and with the kernel (``apply``)."""
    with kernel(False):
        python = PrefixIndex()
        expected = apply_each(python, ops)
    with kernel(True):
        fast = PrefixIndex()
        got = apply(fast, ops)
    return python, fast, expected, got


def check_same(ops: list[tuple[object, ...]], keys: list, extra: list[list[int]],
               apply: Apply = apply_each, *, same_cells: bool = True) -> None:
    python, fast, expected, got = both_ways(ops, apply)
    assert got == expected
    queries = [*QUERIES, *extra]
    assert answers(fast, keys, queries) == answers(python, keys, queries)
    if same_cells:
        assert cells(fast) == cells(python)
    else:
        assert inner_state(fast) == inner_state(python)
    # both keep applying alike after a snapshot round trip
    with kernel(True):
        restored = PrefixIndex.from_plain(through_msgpack(fast))
        tail = apply_each(restored, ops[-5:])
    with kernel(False):
        assert tail == apply_each(python, ops[-5:])
    assert inner_state(restored) == inner_state(python)


@settings(max_examples=300, deadline=None)
@given(st.lists(op_strategy(KEYS), max_size=80))
def test_one_by_one_leaves_the_same_cells(ops: list[tuple[object, ...]]) -> None:
    """Colliding ids and contents, re-announced and reused ids, unknown parents, clears and
    retirements, hashes at the top of the u64 range."""
    check_same(ops, KEYS, [])


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_runs_leave_the_same_state(data: st.DataObject) -> None:
    ops = data.draw(st.lists(op_strategy(KEYS), max_size=80))
    cuts = data.draw(st.lists(st.booleans(), min_size=len(ops), max_size=len(ops)))
    check_same(ops, KEYS, [], lambda index, o: apply_in_runs(index, o, cuts))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(MANY), st.integers(1, 5), st.booleans()),
                min_size=150, max_size=300))
def test_bitmaps_across_words(events: list[tuple[object, int, bool]]) -> None:
    """Many slots sharing one prefix: bitmap rows taken, grown, freed and reused, nodes back to
    one holder, slots past 64 and 128."""
    chain = [(1, 1), (2, 2), (3, 3), (4, 4), (5, 5)]
    ops: list[tuple[object, ...]] = [
        ("remove", worker, [depth], None) if drop else ("store", worker, None, chain[:depth])
        for worker, depth, drop in events]
    check_same(ops, MANY[:8], [[1, 2, 3, 4, 5]])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(KEYS[:2]),
                          st.lists(st.tuples(st.one_of(IDS, BIG, st.integers(0, 10**6)),
                                             TOKENS), min_size=20, max_size=90)),
                min_size=1, max_size=12))
def test_long_events(events: list[tuple[object, list[tuple[int, int]]]]) -> None:
    """Events longer than ``small_event``: the Python code applies them as arrays (other cells),
    the kernel block by block; tables grow in both."""
    ops: list[tuple[object, ...]] = [("store", worker, None, blocks) for worker, blocks in events]
    ops += [("remove", worker, [b for b, _ in blocks[::2]], None) for worker, blocks in events]
    check_same(ops, KEYS, [], same_cells=False)


def test_tables_grow_and_keys_move_alike() -> None:
    """Thousands of blocks of one worker in events of a few: every table doubles several times
    through U64Table.insert1, and cuckoo steps run, in both."""
    rng = np.random.default_rng(7)
    worker = KEYS[0]
    ops: list[tuple[object, ...]] = []
    parent = None
    for _ in range(800):
        blocks = [(int(b), int(t)) for b, t in zip(rng.integers(0, 2**63, 4),
                                                     rng.integers(0, 50, 4), strict=True)]
        ops.append(("store", worker, parent, blocks))
        parent = blocks[-1][0]
        if rng.random() < 0.3:
            ops.append(("remove", worker, [blocks[0][0]], None))
    check_same(ops, KEYS, [])


def test_a_cuckoo_step_moves_the_same_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """A key whose two buckets are full moves a resident to its other bucket (the table is below
    its load limit, so it does not double): the same resident, to the same cell."""
    moved: list[bool] = []
    relocate = U64Table._relocate1

    def counted(table: U64Table, key: int, val: object) -> int:
        cell = relocate(table, key, val)
        moved.append(cell >= 0)
        return cell

    monkeypatch.setattr(U64Table, "_relocate1", counted)
    for seed in range(500):  # 52 random ids in a fresh 64-cell table: some seeds need a step
        rng = np.random.default_rng(seed)
        ids = [int(x) for x in rng.integers(0, 2**63, 52)]
        ops: list[tuple[object, ...]] = [
            ("store", KEYS[0], None, [(b, int(t)) for b, t in zip(
                ids[i:i + 4], rng.integers(0, 2**63, 4), strict=True)])
            for i in range(0, 52, 4)]
        moved.clear()
        with kernel(False):
            apply_each(PrefixIndex(), ops)
        if any(moved):
            break
    assert any(moved)
    check_same(ops, KEYS, [])
    # and the kernel makes the step itself: it never hands the key to U64Table.insert1
    handed: list[int] = []
    insert1 = U64Table.insert1
    monkeypatch.setattr(U64Table, "insert1",
                        lambda table, key, val: handed.append(key) or insert1(table, key, val))
    with kernel(True):
        apply_each(PrefixIndex(), ops)
    assert not handed


def test_a_freed_bitmap_row_is_cleared_when_reused() -> None:
    """A node back to one holder frees its row with that holder's bit still set; the next node
    that needs a row must not inherit it."""
    # 70 slots, so that a's bit lies in another word of the row than c's and d's
    ops: list[tuple[object, ...]] = [("store", k, None, [(100, 100)]) for k in MANY[:70]]
    a, b, c, d = MANY[69], MANY[0], MANY[1], MANY[2]
    ops += [
        ("store", a, None, [(1, 1)]), ("store", b, None, [(1, 1)]),  # node 1: a row {a, b}
        ("remove", b, [1], None),  # back to a alone: the row is free, a's bit still in it
        ("store", c, None, [(2, 2)]), ("store", d, None, [(2, 2)]),  # node 2 takes the row
    ]
    check_same(ops, [a, b, c, d], [[1], [2]])


def test_ops_the_kernel_does_not_take_go_to_python() -> None:
    """Shapes the kernel declines (lists for pairs, ids outside u64) are applied by the Python
    code, in their place in the run."""
    a, b = KEYS[0], KEYS[1]
    ops: list[tuple[object, ...]] = [
        ("store", a, None, [(1, 1), (2, 2), (3, 3)]),
        ("store", a, 3, [[4, 4], [5, 5]]),  # pairs as lists
        ("store", b, None, ((1, 1), (2, 2))),  # a tuple of pairs: taken
        ("remove", a, [2, -4, 4], None),  # a negative id
        ("store", b, 2, [(6, 6)]),
        ("remove", b, [2**64 + 5, 6], None),  # an id no engine sends
        ("store", a, None, [(1, 1)]),
    ]
    check_same(ops, KEYS, [[1, 2, 3, 4, 5]])
    check_same(ops, KEYS, [[1, 2, 3, 4, 5]], lambda i, o: apply_in_runs(i, o, [False] * len(o)))


def test_numbers_at_an_ints_digit_boundaries_read_exactly() -> None:
    """The kernel reads a Python int's 30-bit digits itself: ids and hashes with one, two and
    three digits, at each boundary and at the top of u64, apply as in Python; an id past u64 (a
    fourth digit, or a third one too large) sends its removal to Python."""
    a, b = KEYS[0], KEYS[1]
    edges = [0, 1, 2**30 - 1, 2**30, 2**60 - 1, 2**60, 2**63, 2**64 - 2, 2**64 - 1]
    ops: list[tuple[object, ...]] = [
        ("store", a, None, [(x, edges[-1 - i]) for i, x in enumerate(edges)]),
        ("store", b, None, [(x, x) for x in edges]),
        ("remove", a, [2**30, 2**64, 2**60], None),  # past u64 by one: the third digit is 16
        ("remove", b, [2**90, 2**60 - 1], None),  # four digits
        ("remove", b, [2**64 - 2, 2**63], None),
        ("store", a, None, [(2**60 - 1, 3)]),
    ]
    check_same(ops, KEYS, [edges[:4], [2**64 - 1]])


@pytest.mark.parametrize("count,dtype,bits", [(300, U64, 6), (5000, np.int32, 9),
                                              (4000, U64, 6), (0, U64, 3)])
def test_bulk_load_places_every_key_alike(count: int, dtype: type, bits: int) -> None:
    """U64Table._fill_empty: the kernel's passes leave the cells, and the keys left over (in
    their order), that the Python code's stable sorts leave."""
    rng = np.random.default_rng(count)
    keys = rng.integers(0, 2**64 - 1, count, dtype=np.uint64, endpoint=True)
    vals = rng.integers(0, 2**31 - 1, count).astype(dtype)
    out = []
    for enabled in (False, True):
        with kernel(enabled):
            table = U64Table.with_bits(dtype, bits)
            left, left_vals = table._fill_empty(keys[::-1], vals[::-1])  # a strided view too
            grown = U64Table(dtype)
            grown.insert(keys, vals)
            out.append([table.keys, table.vals, table.occ, left, left_vals, grown.keys,
                        grown.vals, grown.occ])
    for python, fast in zip(*out, strict=True):
        assert np.array_equal(python, fast)


@pytest.mark.parametrize("count,bits", [(3000, 9), (5600, 10), (700, 7)])
def test_a_bulk_load_of_a_snapshots_view_places_every_key_alike(count: int, bits: int) -> None:
    """A v6 restore's node table: keys read from a view of a snapshot's buffer (not aligned),
    loaded ~70 % full, so some are left to _place's rounds and a few to one-by-one steps
    (``place_each`` in the kernel): the same cells either way, every key found."""
    rng = np.random.default_rng(bits)
    raw = b"\x00" * 3 + rng.integers(0, 2**63, count, dtype=np.uint64).tobytes()
    keys = np.frombuffer(raw, dtype="<u8", offset=3)
    assert not keys.flags.aligned
    vals = np.arange(count, dtype=np.int32)
    out = []
    for enabled in (False, True):
        with kernel(enabled):
            table = U64Table.with_bits(np.int32, bits)
            table.insert(keys, vals)
            assert table.bits() == bits and (table.find(keys) >= 0).all()
            out.append([table.keys, table.vals, table.occ])
    for python, fast in zip(*out, strict=True):
        assert np.array_equal(python, fast)


@pytest.mark.parametrize("dtype", [U64, np.int32])
def test_a_table_from_its_cells_is_the_same_either_way(dtype: type) -> None:
    """U64Table.from_cells (a restored block table): the kernel's one pass leaves the arrays the
    numpy code does, from keys in a view that is not aligned; both refuse an occupancy that does
    not match the keys, and a key outside both of its buckets."""
    table = U64Table(dtype)
    rng = np.random.default_rng(11)
    table.insert(rng.integers(0, 2**64 - 1, 3000, dtype=np.uint64, endpoint=True),
                 rng.integers(0, 2**31 - 1, 3000).astype(dtype))
    keys, vals = table.items()
    raw = b"\x00" * 5 + keys.tobytes()
    view = np.frombuffer(raw, dtype="<u8", offset=5)
    occupancy = np.packbits(table.occ.reshape(-1), bitorder="little")
    out = []
    for enabled in (False, True):
        with kernel(enabled):
            again = U64Table.from_cells(dtype, table.bits(), view, vals, occupancy)
            out.append([again.keys, again.vals, again.occ, again.size])
            with pytest.raises(ValueError, match="do not match"):
                U64Table.from_cells(dtype, table.bits(), view[1:], vals[1:], occupancy)
            with pytest.raises(ValueError, match="outside both"):
                U64Table.from_cells(dtype, table.bits(), view[::-1].copy(), vals, occupancy)
    for python, fast in zip(*out, strict=True):
        assert np.array_equal(python, fast)
    assert np.array_equal(out[0][0], table.keys) and out[0][3] == table.size


def test_environment_variable_turns_the_kernel_off() -> None:
    probe = "from replicas.core import index_kernel as k; print(k.available(), k.active())"
    assert printed_with_pure_python(probe) == ["True", "None"]


def test_use_compiled_switches_at_run_time() -> None:
    with kernel(True):
        assert index_kernel.use_compiled(False) is False
        assert index_kernel.active() is None
        assert index_kernel.use_compiled(True) is True
        assert index_kernel.active() is not None


@pytest.mark.parametrize("name", ["fill_empty", "place_each", "place_occupied"])
def test_the_table_calls_refuse_keys_and_values_that_do_not_pair(name: str) -> None:
    """u64 keys with as many u64 or int32 values, else a TypeError naming the call, the table
    untouched and no buffer left held (a memoryview with an export left cannot be released)."""
    fast = index_kernel.active()
    if fast is None:
        pytest.skip("the kernel is not built here")
    table = U64Table(U64)
    before = table.keys.copy()
    occupancy = np.zeros(table.keys.size // 8, dtype=np.uint8)
    for fmt, count in (("h", 4), ("Q", 3)):  # int16 values; too few u64 values
        keys = memoryview(bytearray(8 * 4)).cast("Q")
        vals = memoryview(bytearray(count * (2 if fmt == "h" else 8))).cast(fmt)
        args = (table, keys, vals, occupancy)[:4 if name == "place_occupied" else 3]
        with pytest.raises(TypeError, match=f"{name}: u64 keys and as many u64/int32 values"):
            getattr(fast, name)(*args)
        keys.release()
        vals.release()
    assert np.array_equal(table.keys, before)


def packed(ops: list[tuple[object, ...]]) -> list[tuple[object, ...]]:
    """The same ops with each store's blocks as a KV reader leaves them (kv_decode.py)."""
    return [(kind, worker, a, PackedPairs.of(b) if kind == "store" else b)  # type: ignore[arg-type]
            for kind, worker, a, b in ops]


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_packed_blocks_leave_the_same_cells(data: st.DataObject) -> None:
    """Blocks as u64 words (copied by the kernel as they are) or as tuples of ints: the same
    results and the same cells, one by one and in runs; the Python code iterates them."""
    ops = data.draw(st.lists(op_strategy(KEYS), max_size=60)) + data.draw(
        st.lists(st.tuples(st.just("store"), st.sampled_from(KEYS), st.none(),
                           st.lists(st.tuples(st.one_of(IDS, BIG), TOKENS), min_size=20,
                                    max_size=70)), max_size=3))
    cuts = data.draw(st.lists(st.booleans(), min_size=len(ops), max_size=len(ops)))
    for apply in (apply_each, lambda index, o: apply_in_runs(index, o, cuts)):
        with kernel(True):
            as_tuples, as_words = PrefixIndex(), PrefixIndex()
            assert apply(as_words, packed(ops)) == apply(as_tuples, ops)
        assert cells(as_words) == cells(as_tuples)
        assert answers(as_words, KEYS, QUERIES) == answers(as_tuples, KEYS, QUERIES)
    with kernel(False):
        python = PrefixIndex()
        assert apply_each(python, packed(ops)) == apply_each(PrefixIndex(), ops)
    assert inner_state(python) == inner_state(as_tuples)


def test_the_kernel_applies_packed_blocks_itself() -> None:
    """Packed blocks are copied by the kernel, not handed back to the Python code (which would
    give the same state, only slower)."""
    with kernel(True):
        index = PrefixIndex()
        ops = [(STORE, KEYS[0], None, PackedPairs.of([(1, 2), (3, 4)])),
               (STORE, KEYS[0], 3, PackedPairs.of([(5, 6)]))]
        assert index_kernel.active().apply_ops(index, ops, 0) == ["ok", "ok"]  # type: ignore[union-attr]
        assert index.total_blocks == 3
