"""U64Table (the compact index's hash table) against a dict: batched and one-key operations, keys
at the ends of the u64 range, tables filled to the doubling point (cuckoo steps included)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from replicas.core import index_common
from replicas.core.index_table import U64Table


def check(table: U64Table, model: dict[int, int], rng: random.Random) -> None:
    assert table.size == len(model)
    keys, vals = table.items()
    assert dict(zip(keys.tolist(), vals.tolist(), strict=True)) == model
    probe = [*list(model)[:64], 0, 1, 2**64 - 1, *(rng.getrandbits(64) for _ in range(16))]
    cells = table.find(np.array(probe, dtype=np.uint64))
    for key, cell in zip(probe, cells.tolist(), strict=True):
        assert (cell >= 0) == (key in model) == (table.find1(key) >= 0)
        if cell >= 0:
            assert table.find1(key) == cell and int(table.vals.reshape(-1)[cell]) == model[key]


def test_batched_and_single_operations_agree_with_a_dict() -> None:
    rng = random.Random(7)
    table, model = U64Table(np.uint64), {}
    for step in range(2500):
        roll = rng.random()
        if roll < 0.45:
            fresh = {rng.choice([rng.getrandbits(64), rng.randrange(64), 2**64 - 1 - step % 7])
                     for _ in range(rng.randrange(1, 50))} - model.keys()
            vals = [rng.getrandbits(64) for _ in fresh]
            table.insert(np.array(list(fresh), dtype=np.uint64), np.array(vals, dtype=np.uint64))
            model.update(zip(fresh, vals, strict=True))
        elif roll < 0.7:
            key = rng.getrandbits(64)
            if key not in model:
                model[key] = rng.getrandbits(64)
                assert table.insert1(key, model[key]) == table.find1(key)
        elif model:
            gone = rng.sample(list(model), min(len(model), rng.randrange(1, 20)))
            if rng.random() < 0.5:
                table.delete(table.find(np.array(gone, dtype=np.uint64)))
            else:
                for key in gone:
                    table.delete1(table.find1(key))
            for key in gone:
                del model[key]
        if step % 50 == 0:
            check(table, model, rng)
    check(table, model, rng)


def test_filled_to_the_doubling_point_without_doubling_early() -> None:
    rng = np.random.default_rng(3)
    batched, single = U64Table(np.int32), U64Table(np.int32)
    for _ in range(200):  # 12,800 keys: 2048 buckets of 8 hold them at 78 %
        keys = np.unique(rng.integers(0, 2**63, size=64, dtype=np.uint64))
        batched.insert(keys, np.arange(len(keys), dtype=np.int32))
        for key in keys.tolist():
            single.insert1(key, 5)
    for table in (batched, single):
        assert table.keys.shape[0] == 2048
        keys, _ = table.items()
        assert (table.find(keys) >= 0).all()


def test_popcount_without_numpy_2(monkeypatch: pytest.MonkeyPatch) -> None:
    words = np.array([[0, 1, 2**64 - 1], [3, 2**63, 0xF0F0]], dtype=np.uint64)
    expected = [[0, 1, 64], [2, 1, 8]]
    assert index_common.popcount(words).tolist() == expected
    monkeypatch.setattr(index_common, "_BITWISE_COUNT", None)  # numpy 1.26 has no bitwise_count
    assert index_common.popcount(words).tolist() == expected
