"""`jetrouter worker --engines N`: how one command line becomes N engines' settings."""

from __future__ import annotations

import pytest

from workers.engine_host import hosted_settings
from workers.server import WorkerSettings


def test_the_worker_id_is_a_prefix_and_the_port_the_first_of_a_run() -> None:
    base = WorkerSettings(worker_id="w", port=9000, nats_url="nats://n:4222", namespace="ns")
    hosted = hosted_settings(base, 3, offset=16)
    assert [(s.worker_id, s.port) for s in hosted] == [("w16", 9000), ("w17", 9001),
                                                       ("w18", 9002)]
    assert {(s.nats_url, s.namespace, s.engine) for s in hosted} == {
        (base.nats_url, base.namespace, base.engine)}


def test_port_zero_lets_each_engine_pick_its_own() -> None:
    hosted = hosted_settings(WorkerSettings(worker_id="e", port=0), 2)
    assert [(s.worker_id, s.port) for s in hosted] == [("e0", 0), ("e1", 0)]


def test_one_advertised_url_cannot_name_several_engines() -> None:
    base = WorkerSettings(worker_id="w", advertise_url="http://engine:8000")
    with pytest.raises(ValueError, match="--advertise-url"):
        hosted_settings(base, 2)
    assert hosted_settings(base, 1)[0].advertise_url == base.advertise_url
