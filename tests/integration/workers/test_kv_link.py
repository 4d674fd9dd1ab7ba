"""workers/engine_link.py: an engine-side publisher that starts before NATS keeps trying, and is
connected, with the KV stream in place, once a real nats-server comes up on its address."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from eventlog.connect import NatsOptions
from eventlog.names import KV, Names
from natsops.server import NatsServer, free_port
from workers.engine_link import connect_kv_stream


@pytest.mark.timeout(60)
async def test_connects_once_nats_comes_up(tmp_path: Path) -> None:
    port = free_port()
    names = Names()
    options = NatsOptions().with_servers(f"nats://127.0.0.1:{port}")
    link = asyncio.create_task(connect_kv_stream(options, names, name="test-kv-link"))
    # Nothing listens yet: the link must still be trying, not have failed.
    done, _ = await asyncio.wait({link}, timeout=0.5)
    assert not done
    server = NatsServer(store_dir=tmp_path / "nats", port=port).start(timeout=60)
    try:
        nc, js = await asyncio.wait_for(link, 45)
        try:
            info = await js.stream_info(names.stream(KV))
            assert info.config.name == names.stream(KV)
        finally:
            await nc.close()
    finally:
        server.cleanup()
