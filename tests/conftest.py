"""Shared fixtures: real ``nats-server`` processes (never mocks).

* ``nats_server`` — a started single JetStream server on a free loopback port, store under the
  test's ``tmp_path``; killed after the test. Start-up takes a few tens of milliseconds.
* ``nats_url`` — its ``nats://`` URL.
* ``nats_cluster`` — three clustered JetStream servers (~0.5 s to elect a meta leader; use only
  where replication or node loss is the point).
* ``nats_connect`` — ``await nats_connect(url)`` opens a client tuned for tests (fast reconnect,
  retries forever) and closes it after the test.
* ``js`` — ``(nc, js)`` connected to ``nats_server`` with the three ``jr`` streams ensured.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from eventlog.names import Names
from eventlog.streams import ensure_streams
from natsops.server import NatsCluster, NatsServer

Connect = Callable[[str], Awaitable[NATS]]


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    server = NatsServer(store_dir=tmp_path / "nats").start(timeout=60)
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture
def nats_url(nats_server: NatsServer) -> str:
    return nats_server.url


@pytest.fixture
def nats_cluster(tmp_path: Path) -> Iterator[NatsCluster]:
    cluster = NatsCluster(3, base_dir=tmp_path / "nats-cluster").start(timeout=90)
    try:
        yield cluster
    finally:
        cluster.cleanup()


@pytest.fixture
async def nats_connect() -> AsyncIterator[Connect]:
    opened: list[NATS] = []

    async def connect(url: str) -> NATS:
        # A short reconnect wait: tests restart servers and should not idle 2 s (the default).
        nc = await nats.connect(
            servers=url.split(","),
            reconnect_time_wait=0.05,
            max_reconnect_attempts=-1,
            connect_timeout=2,
            allow_reconnect=True,
        )
        opened.append(nc)
        return nc

    yield connect
    for nc in opened:
        if not nc.is_closed:
            await nc.close()


@pytest.fixture
async def js(
    nats_server: NatsServer, nats_connect: Connect
) -> AsyncIterator[tuple[NATS, JetStreamContext]]:
    nc = await nats_connect(nats_server.url)
    context = nc.jetstream()
    await ensure_streams(context, Names("jr"))
    yield nc, context


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model folder with a byte-level BPE tokenizer (vocab 2048) trained offline here and a
    Llama-3-style chat template (workers/tinymodel.py); no hub download."""
    from workers.tinymodel import write_tokenizer_folder

    folder = tmp_path_factory.mktemp("tiny-model")
    write_tokenizer_folder(folder)
    return folder
