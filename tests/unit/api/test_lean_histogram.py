"""LeanHistogram writes what prometheus_client's Histogram writes for the same observations."""

from __future__ import annotations

import math
import random

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from api.lean_histogram import LeanHistogram

BUCKETS = (0.0005, 0.001, 0.0025, 0.01, 0.5, 2.5)
SIGNED = (-4.0, -1.0, 0.0, 1.0, 4.0)


def _without_created(text: bytes) -> list[bytes]:
    return [line for line in text.splitlines() if b"_created" not in line]


def _created_values(text: bytes) -> list[float]:
    return [float(line.rsplit(b" ", 1)[1]) for line in text.splitlines()
            if b"_created" in line and not line.startswith(b"#")]


@pytest.mark.parametrize("buckets", [BUCKETS, SIGNED])
@pytest.mark.parametrize("labelnames", [(), ("stage",)])
def test_same_exposition_as_the_library(buckets: tuple[float, ...],
                                        labelnames: tuple[str, ...]) -> None:
    rng = random.Random(7)
    lib_reg, lean_reg = CollectorRegistry(auto_describe=True), CollectorRegistry(auto_describe=True)
    lib = Histogram("x_seconds", "What x took", labelnames, buckets=buckets, registry=lib_reg)
    lean = LeanHistogram("x_seconds", "What x took", labelnames, buckets=buckets,
                         registry=lean_reg)
    values = [rng.uniform(-6, 6) * rng.choice((1e-4, 1e-2, 1.0)) for _ in range(500)]
    values += [*buckets, 0.0, math.inf, -math.inf, 1e9, math.nan]
    for k, v in enumerate(values):
        if labelnames:
            stage = ("hashing", "total")[k % 2]
            lib.labels(stage=stage).observe(v)
            (lean.labels(stage=stage) if k % 3 else lean.labels(stage)).observe(v)
        else:
            lib.observe(v)
            lean.observe(v)
    lib_text, lean_text = generate_latest(lib_reg), generate_latest(lean_reg)
    assert _without_created(lean_text) == _without_created(lib_text)
    assert len(_created_values(lean_text)) == len(_created_values(lib_text)) > 0
    assert all(abs(a - b) < 60 for a, b in zip(_created_values(lean_text),
                                               _created_values(lib_text), strict=True))


def test_created_series_follow_the_library_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PROMETHEUS_DISABLE_CREATED_SERIES", "true")
    reg = CollectorRegistry()
    LeanHistogram("y", "y", buckets=(1.0,), registry=reg).observe(0.5)
    assert b"_created" not in generate_latest(reg)
    assert reg.get_sample_value("y_bucket", {"le": "1.0"}) == 1.0


def test_labels_are_checked_like_the_library() -> None:
    h = LeanHistogram("z", "z", ("a", "b"), buckets=(1.0,), registry=None)
    with pytest.raises(ValueError):
        h.observe(1.0)
    with pytest.raises(ValueError):
        h.labels("only-one")
    with pytest.raises(ValueError):
        h.labels(a="1", c="2")
    assert h.labels("1", "2") is h.labels(a="1", b="2")
    with pytest.raises(ValueError):
        LeanHistogram("u", "u", buckets=(2.0, 1.0), registry=None)
    with pytest.raises(ValueError):
        LeanHistogram("v", "v", buckets=(), registry=None)
    with pytest.raises(ValueError):
        LeanHistogram("w", "w", buckets=(1.0,), registry=None).labels("x")
