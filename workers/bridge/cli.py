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
import sys

from eventlog.connect import (
    NatsConnectFatal,
    add_nats_arguments,
    check_connect_sync,
    check_files,
    options_from_args,
)
from eventlog.names import check_token
from workers.bridge.bridge import Bridge, BridgeSettings, ConfigError


def _positive_int(raw: str) -> int:
    value = int(raw)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{raw} is not a positive integer")
    return value


def _positive_float(raw: str) -> float:
    value = float(raw)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{raw} is not a positive number")
    return value


def _zmq_endpoint(raw: str) -> str:
    if raw and "://" not in raw:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a ZMQ endpoint like tcp://host:5557")
    return raw


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine-url", required=True,
                   help="the engine's OpenAI server, e.g. http://10.0.0.5:8000 (serves "
                        "/v1/models, /metrics, /health)")
    p.add_argument("--kv-events", required=True, type=_zmq_endpoint,
                   help="the engine's ZMQ PUB endpoint, e.g. tcp://10.0.0.5:5557")
    p.add_argument("--kv-replay", default="", type=_zmq_endpoint,
                   help="the engine's ZMQ replay endpoint, e.g. tcp://10.0.0.5:5558 (without "
                        "it a missed batch clears the worker's blocks instead of being replayed)")
    p.add_argument("--kv-topic", default="",
                   help="ZMQ topic to subscribe to (vLLM's kv-events-config 'topic'; default: all)")
    p.add_argument("--worker-id", required=True,
                   help="id on the KV stream and in routing decisions (stable across bridge "
                        "restarts: it is how a restarted bridge finds where it left off)")
    p.add_argument("--nats-url", default="nats://127.0.0.1:4222",
                   help="NATS server(s), comma-separated (default nats://127.0.0.1:4222)")
    p.add_argument("--namespace", default="jr", help="stream/subject namespace (default jr)")
    p.add_argument("--block-size", type=_positive_int, default=None,
                   help="tokens per KV block (default: from vllm:cache_config_info in /metrics, "
                        "else the first BlockStored); must equal the router's "
                        "--kv-cache-block-size")
    p.add_argument("--kv-total-blocks", type=_positive_int, default=None,
                   help="KV capacity in blocks (default: num_gpu_blocks from /metrics)")
    p.add_argument("--max-num-batched-tokens", type=_positive_int, default=8192,
                   help="the engine's token budget per step, for the router's cost model "
                        "(default 8192)")
    p.add_argument("--advertise-url", default=None,
                   help="URL routers send requests to (default: --engine-url)")
    p.add_argument("--model", default=None,
                   help="served model name (default: the base model in /v1/models)")
    p.add_argument("--role", choices=["both", "prefill", "decode"], default="both",
                   help="disaggregated serving role registered for the engine (default both); "
                        "a prefill engine must serve POST /v1/prefill (see README), else "
                        "routers fall back to aggregated serving on decode engines")
    p.add_argument("--health-interval", type=_positive_float, default=2.0,
                   help="seconds between /health checks (default 2)")
    p.add_argument("--unhealthy-after", type=_positive_float, default=10.0,
                   help="retire the worker when /health fails this long (default 10 s)")
    p.add_argument("--load-interval", type=_positive_float, default=1.0,
                   help="seconds between load gauges read from /metrics (default 1)")
    p.add_argument("--replay-timeout", type=_positive_float, default=5.0,
                   help="seconds of silence before a replay request counts as failed (default 5)")
    p.add_argument("--log-level", default="info",
                   choices=["debug", "info", "warning", "error"], help="(default info)")
    add_nats_arguments(p)


def settings_from_args(args: argparse.Namespace) -> BridgeSettings:
    check_token(args.worker_id, "worker id")
    check_token(args.namespace, "namespace")
    if not args.engine_url.startswith(("http://", "https://")):
        raise ValueError(f"--engine-url {args.engine_url!r} must start with http:// or https://")
    return BridgeSettings(
        engine_url=args.engine_url, kv_events=args.kv_events, kv_replay=args.kv_replay,
        kv_topic=args.kv_topic, worker_id=args.worker_id, nats_url=args.nats_url,
        namespace=args.namespace, block_size=args.block_size,
        kv_total_blocks=args.kv_total_blocks, max_num_batched_tokens=args.max_num_batched_tokens,
        advertise_url=args.advertise_url, model=args.model, role=args.role,
        health_interval=args.health_interval, unhealthy_after=args.unhealthy_after,
        load_interval=args.load_interval, replay_timeout=args.replay_timeout,
        nats=options_from_args(args, check=False))  # files are checked by run()


async def _main(settings: BridgeSettings) -> int:
    bridge = Bridge(settings)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, bridge.stop)
    try:
        await bridge.run()
    except ConfigError as exc:
        print(f"jetrouter bridge: error: {exc}", file=sys.stderr)
        with contextlib.suppress(Exception):
            await bridge.close()
        return 2
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
        print(f"jetrouter bridge: error: {exc}", file=sys.stderr)
        return 2
    return asyncio.run(_main(settings))
