"""A nats-server we start runs with the GOMAXPROCS natsops.server.go_max_procs gives, as its
own monitoring endpoint reports it, whether started by NatsServer or by a local cluster."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from launch.local_cluster import LocalCluster
from natsops.server import NatsServer, go_max_procs

pytestmark = pytest.mark.timeout(120)


def _gomaxprocs(server: NatsServer) -> int:
    with urllib.request.urlopen(f"{server.monitor_url}/varz", timeout=10) as r:
        return int(json.loads(r.read())["gomaxprocs"])


def test_a_started_server_runs_with_its_procs(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GOMAXPROCS", raising=False)
    server = NatsServer(store_dir=tmp_path / "a").start(timeout=60)
    try:
        assert _gomaxprocs(server) == int(go_max_procs())
    finally:
        server.cleanup()
    monkeypatch.setenv("GOMAXPROCS", "3")
    server = NatsServer(store_dir=tmp_path / "b").start(timeout=60)
    try:
        assert _gomaxprocs(server) == 3
    finally:
        server.cleanup()


def test_a_local_clusters_server_runs_with_its_procs(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # (Go's own default is a P per core: on a machine of 2 to 7 cores this tells them apart)
    monkeypatch.delenv("GOMAXPROCS", raising=False)
    cluster = LocalCluster(replicas=1, workers=0, data_dir=tmp_path)  # (nothing started)
    server = NatsServer(store_dir=tmp_path / "nats")
    try:
        cluster._launch_nats(server)
        server.wait_ready(timeout=60)
        assert _gomaxprocs(server) == int(go_max_procs())
    finally:
        server.cleanup()
