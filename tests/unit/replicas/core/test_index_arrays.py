"""The compact index's v6 snapshot (index_arrays.py): what is restored is the live index's arrays
themselves — the same slots, block tables and repeated nodes — and the same node table as a map
(loaded in bulk, so its cells may differ); a column that does not match its checksum, or cells
that cannot be right, are refused. Every test runs with the index's Python code and with its
compiled kernel (conftest.py)."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replicas.core.index import PrefixIndex
from replicas.core.index_arrays import PLAIN_VERSION_V6
from tests.unit.replicas.core.test_index_compact import (
    MANY,
    QUERIES,
    ArraysAlways,
    answers,
    apply,
    op_strategy,
    workers,
)

pytestmark = pytest.mark.usefixtures("each_index_kernel")

KEYS = workers(6)


def through_msgpack(index: PrefixIndex) -> dict[str, object]:
    return msgspec.msgpack.decode(msgspec.msgpack.encode(index.to_plain()))  # type: ignore[no-any-return]


def node_map(index: PrefixIndex) -> list[tuple[int, object]]:
    """The node table as a map: each node's one holder slot, or its holders' bitmap."""
    holders = index._holders
    keys, vals = holders.nodes.items()
    return sorted((seq, v if v >= 0 else tuple(holders.rows[-2 - v].tolist()))
                  for seq, v in zip(keys.tolist(), vals.tolist(), strict=True))


def internals(index: PrefixIndex) -> tuple[object, ...]:
    """Every array and map the index keeps, as comparable values (the node table as a map)."""
    live = [s for s, k in enumerate(index._keys) if k is not None]
    return (index._keys, sorted(index._free), index._total, index.digest,
            [(index._blocks[s].bits(), index._blocks[s].keys.tobytes(),
              index._blocks[s].vals[index._blocks[s].occ].tobytes(),  # freed cells keep junk
              index._blocks[s].occ.tobytes(), index._sums[s],
              index._dups[s], index._weights[s]) for s in live],
            index._holders.nodes.size, node_map(index), sorted(index.counters.items()))


def check_same_arrays(index: PrefixIndex) -> PrefixIndex:
    plain = through_msgpack(index)
    assert plain["version"] == PLAIN_VERSION_V6
    restored = type(index).from_plain(plain)
    assert internals(restored) == internals(index)
    assert restored._holders.rows_used == len(plain["columns"]["shared_rows"]) // 8  # type: ignore[index]
    return restored


@settings(max_examples=150, deadline=None)
@given(st.lists(op_strategy(KEYS), max_size=50), st.booleans())
def test_restore_gives_the_same_arrays(ops: list[tuple[object, ...]], arrays: bool) -> None:
    index = ArraysAlways() if arrays else PrefixIndex()
    for op in ops:
        apply(index, op)
    restored = check_same_arrays(index)
    for op in ops[-5:]:  # and it goes on applying events exactly as the live one does
        assert apply(restored, op) == apply(index, op)
    assert internals(restored) == internals(index)


@settings(max_examples=12, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(MANY), st.integers(1, 5), st.booleans()),
                min_size=80, max_size=160))
def test_bitmaps_of_shared_nodes_and_freed_slots(events: list[tuple[object, int, bool]]) -> None:
    index = PrefixIndex()
    chain = [(1, 1), (2, 2), (3, 3), (4, 4), (5, 5)]
    for i, (worker, depth, drop) in enumerate(events):
        if drop:
            index.remove(worker, [depth])  # type: ignore[arg-type]
        else:
            index.store(worker, None, chain[:depth])  # type: ignore[arg-type]
        if i % 37 == 0:
            index.remove_worker(worker[0])  # type: ignore[index]
    check_same_arrays(index)


CHAIN_QUERIES = [*QUERIES, [1, 2, 3, 4, 5], [1, 2, 9]]


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(MANY), st.integers(1, 5),
                          st.sampled_from(["store", "again", "drop", "retire"])),
                min_size=60, max_size=200))
def test_restored_answers_as_the_live_index_with_many_workers(
        events: list[tuple[tuple[str, int], int, str]]) -> None:
    """Over 140 workers (three bitmap words): one chain shared by many (bitmaps), stored again
    by a worker under other ids (repeated nodes), blocks dropped and workers retired (freed
    slots, reused). The restored index gives the live one's digests and answers, and goes on
    giving them as both apply the same events."""
    from eventlog.hashing import sequence_hashes

    index = PrefixIndex()
    chain = [(1, 1), (2, 2), (3, 3), (4, 4), (5, 5)]
    ops: list[tuple[object, ...]] = []
    for n, (worker, depth, kind) in enumerate(events):
        if kind == "store":
            ops.append(("store", worker, None, chain[:depth]))
        elif kind == "again":  # the same content under other ids: repeated nodes
            ops.append(("store", worker, None, [(1000 * (n + 1) + i, t)
                                                for i, t in chain[:depth]]))
        elif kind == "drop":
            ops.append(("remove", worker, [depth], None))
        else:
            ops.append(("retire", worker, None, None))
    queries = [sequence_hashes(q) for q in CHAIN_QUERIES]
    for op in ops[:-10]:
        apply(index, op)
    restored = PrefixIndex.from_plain(through_msgpack(index))
    assert answers(restored, MANY, queries) == answers(index, MANY, queries)
    for op in ops[-10:]:
        assert apply(restored, op) == apply(index, op)
    assert answers(restored, MANY, queries) == answers(index, MANY, queries)
    assert internals(restored)[:4] == internals(index)[:4]


def test_big_tables_restore_in_place() -> None:
    index = PrefixIndex()
    rng = np.random.default_rng(7)
    shared = [(int(i), int(t)) for i, t in zip(rng.integers(1, 2**63, 8), range(1, 9),
                                                strict=True)]
    for w in range(70):
        for c in range(20):
            ids = rng.integers(1, 2**63, 40).tolist()
            tokens = rng.integers(1, 2**63, 40).tolist()
            index.store((f"w{w}", 0), None, [*((i + w + 1000 * c, t) for i, t in shared), *zip(
                ids, tokens, strict=True)] if c % 2 else list(zip(ids, tokens, strict=True)))
    index.remove(("w3", 0), [i + 3 + 1000 for i, _ in shared[:4]])  # repeats left behind
    index.remove_worker("w5")
    assert any(index._dups) and index._holders.rows_used and index._free == [5]
    check_same_arrays(index)


def _shared_and_repeated() -> PrefixIndex:
    """Every v6 column non-empty: owners and others, shared nodes, repeated ones."""
    index = PrefixIndex()
    for w in range(3):
        index.store((f"w{w}", 0), None, [(w * 1000 + i, i + 1) for i in range(100)])
    index.store(("w0", 0), None, [(5000 + i, i + 1) for i in range(10)])  # repeats
    return index


@pytest.mark.parametrize("column", ["ids", "own", "seqs", "refs", "occ", "shared_rows",
                                    "shared_masks", "dup_slots", "dup_seqs", "dup_counts"])
def test_a_damaged_column_is_refused(column: str) -> None:
    plain = through_msgpack(_shared_and_repeated())
    damaged = bytearray(plain["columns"][column])  # type: ignore[index]
    damaged[len(damaged) // 2] ^= 1
    plain["columns"][column] = bytes(damaged)  # type: ignore[index]
    with pytest.raises(ValueError, match=f"column '{column}' fails its checksum"):
        PrefixIndex.from_plain(plain)


def test_a_damaged_state_snapshot_is_refused_with_the_column_named() -> None:
    """Through ``RouterState.decode``, on the blob itself: a byte of the ids changed (as a
    disk or a copy might) is refused, naming the column, before anything is placed."""
    from replicas.core.state import RouterState, StateConfig

    state = RouterState(StateConfig(index_form="compact"))
    state.index = _shared_and_repeated()
    blob = bytearray(state.encode())
    ids = bytes(through_msgpack(state.index)["columns"]["ids"])  # type: ignore[index]
    at = bytes(blob).index(ids) + 8 * 50
    blob[at] ^= 0x40
    with pytest.raises(ValueError, match="column 'ids' fails its checksum"):
        RouterState.decode(bytes(blob), state.config)
    assert RouterState.decode(state.encode(), state.config).digests() == state.digests()


def test_cells_that_cannot_be_right_are_refused() -> None:
    """Columns that pass their checksums (rewritten with them) but put keys in the wrong
    buckets, or two in one cell, are refused rather than restored into a broken table."""
    import xxhash

    from replicas.core.index_arrays import _COLUMNS

    index = PrefixIndex()
    index.store(("w", 0), None, [(i * 7919, i + 1) for i in range(200)])
    plain = through_msgpack(index)
    columns = plain["columns"]
    ids = np.frombuffer(columns["ids"], dtype="<u8")[::-1].copy()  # type: ignore[index]
    columns["ids"] = ids.tobytes()  # type: ignore[index]
    plain["checksums"] = [xxhash.xxh3_64_intdigest(columns[n])  # type: ignore[index]
                          for n in _COLUMNS]
    with pytest.raises(ValueError, match=r"malformed|outside|two keys"):
        PrefixIndex.from_plain(plain)


def test_a_row_naming_no_owner_is_refused() -> None:
    """v6 rows name their node's owner by ordinal: one past the owners, in columns that pass
    their checksums (rewritten with them), is refused before anything is placed."""
    import xxhash

    from replicas.core.index_arrays import _COLUMNS

    plain = through_msgpack(_shared_and_repeated())
    columns = plain["columns"]
    owners = len(columns["seqs"]) // 8  # type: ignore[index]
    refs = np.frombuffer(columns["refs"], dtype="<u4").copy()  # type: ignore[index]
    refs[len(refs) // 2] = owners
    columns["refs"] = refs.tobytes()  # type: ignore[index]
    plain["checksums"] = [xxhash.xxh3_64_intdigest(columns[n])  # type: ignore[index]
                          for n in _COLUMNS]
    with pytest.raises(ValueError, match="malformed v6 PrefixIndex"):
        PrefixIndex.from_plain(plain)
