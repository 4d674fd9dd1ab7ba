"""`--soak` / `--fault-interval` durations: what they accept and how they refuse."""

from __future__ import annotations

import pytest

from cluster.chaos_soak import parse_duration


@pytest.mark.parametrize(("text", "seconds"), [("30m", 1800.0), ("90s", 90.0), ("1h", 3600.0),
                                               ("45", 45.0), ("0.5m", 30.0)])
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "m", "-5s", "0s", "3d", "1h30m"])
def test_bad_durations_are_refused_with_the_text(text: str) -> None:
    with pytest.raises(ValueError, match="duration"):
        parse_duration(text)
