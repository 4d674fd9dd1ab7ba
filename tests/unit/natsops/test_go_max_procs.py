"""The GOMAXPROCS a nats-server we start gets: the caller's, else a quarter of the cores."""

from __future__ import annotations

import pytest

from natsops.server import go_max_procs


@pytest.mark.parametrize(("cpus", "procs"), [(1, "1"), (2, "1"), (7, "1"), (8, "2"), (64, "16")])
def test_a_quarter_of_the_cores_and_at_least_one(cpus: int, procs: str) -> None:
    assert go_max_procs({}, cpus=cpus) == procs


def test_the_callers_setting_wins() -> None:
    assert go_max_procs({"GOMAXPROCS": "6"}, cpus=2) == "6"
    assert go_max_procs({"GOMAXPROCS": " "}, cpus=16) == "4"  # blank: not set
