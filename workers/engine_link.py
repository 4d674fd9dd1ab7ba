"""An engine-side process's link to NATS: connect, make sure the KV stream exists, keep trying;
and how large one KV message may grow.

Both engine-side publishers — the simulated engine's (`workers/publisher.py`) and the bridge in
front of a real engine (`workers/bridge/bridge.py`) — must outlive NATS being away at start-up:
the engine keeps serving, so they retry with a growing delay instead of exiting. They see only
the KV stream: an engine identity may see no other (`natsops/natsconf.py`). Both batch events
into messages under the same bounds, so what they share lives here and the bridge imports nothing
of the simulated engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext

from eventlog.connect import NatsConnectFatal, NatsOptions, connect
from eventlog.events import BlocksRemoved, BlocksStored, Event
from eventlog.names import KV, Names
from eventlog.streams import ensure_streams

log = logging.getLogger("jetrouter.worker")

MAX_EVENTS_PER_MESSAGE = 256
MAX_BLOCKS_PER_MESSAGE = 4096  # ~100 KB of msgpack, far below NATS' 1 MB default payload

FIRST_RETRY_DELAY = 0.2
MAX_RETRY_DELAY = 5.0
# Bad credentials or TLS were checked when the process started (its CLI fails fast on them);
# if they turn bad later, retry slowly, saying why, rather than dying with the engine serving.
FATAL_RETRY_DELAY = 5.0


async def connect_kv_stream(options: NatsOptions, names: Names, *,
                            name: str) -> tuple[NatsClient, JetStreamContext]:
    """Connect (reconnecting forever once connected) and ensure the KV stream; retry until both
    succeed."""
    delay = FIRST_RETRY_DELAY
    while True:
        nc: NatsClient | None = None
        try:
            nc = await connect(options, name=name, max_reconnect_attempts=-1,
                               reconnect_time_wait=0.5)
            js = nc.jetstream()
            await ensure_streams(js, names, kinds=(KV,))
            return nc, js
        except NatsConnectFatal as exc:
            log.error("%s; retrying in %.0f s", exc, FATAL_RETRY_DELAY)
            await asyncio.sleep(FATAL_RETRY_DELAY)
        except Exception as exc:
            log.warning("NATS %s not usable yet (%r); retrying in %.1fs",
                        ",".join(options.servers), exc, delay)
            if nc is not None:
                with contextlib.suppress(Exception):
                    await nc.close()
            await asyncio.sleep(delay)
            delay = min(delay * 2, MAX_RETRY_DELAY)


def block_count(event: Event) -> int:
    """How much of a message's block budget one event takes (a lifecycle event counts as one)."""
    if isinstance(event, BlocksStored):
        return len(event.blocks)
    if isinstance(event, BlocksRemoved):
        return len(event.block_hashes)
    return 1
