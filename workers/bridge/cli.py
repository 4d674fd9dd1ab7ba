"""`jetrouter bridge`: put one real engine (vLLM, SGLang) behind jetrouter.

Subscribes to the engine's ZMQ KV events, appends them to ``JR_KV`` as jetrouter events, registers
and retires the engine as a worker and publishes its load from ``/metrics``. Stateless: restart it
at will (it resumes from the last message it appended).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal

from eventlog.connect import (
    NatsConnectFatal,
    check_connect_sync,
    check_files,
    options_from_args,
)
from eventlog.names import check_token
from settings.flags import CliError, add_options, build
from workers.bridge.bridge import Bridge
from workers.bridge.config import BRIDGE, BridgeConfigInvalid, BridgeSettings


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_options(p, BRIDGE)


def settings_from_args(args: argparse.Namespace) -> BridgeSettings:
    check_token(args.worker_id, "worker id")
    check_token(args.namespace, "namespace")
    if not args.engine_url.startswith(("http://", "https://")):
        raise ValueError(f"--engine-url {args.engine_url!r} must start with http:// or https://")
    # The options are named like the settings' fields (workers/bridge/config.py).
    return build(BridgeSettings, args, nats=options_from_args(args, check=False))  # files: run()


async def _main(settings: BridgeSettings) -> int:
    bridge = Bridge(settings)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, bridge.stop)
    try:
        await bridge.run()
    except BridgeConfigInvalid as exc:
        with contextlib.suppress(Exception):
            await bridge.close()
        raise CliError(str(exc)) from None
    return 0


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per /metrics poll otherwise
    try:
        settings = settings_from_args(args)
        check_files(settings.nats)
        # A wrong password or untrusted certificate: one line and exit 2 now.
        check_connect_sync(settings.nats.with_servers(settings.nats_url),
                           name=f"jetrouter-bridge-{settings.worker_id}")
    except (ValueError, NatsConnectFatal) as exc:
        raise CliError(str(exc)) from None
    return asyncio.run(_main(settings))
