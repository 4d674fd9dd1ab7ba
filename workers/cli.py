"""`jetrouter worker`: run one simulated inference engine, or ``--engines N`` of them in this
process (workers/engine_host.py); its options: workers/config.py."""

from __future__ import annotations

import argparse
import logging
import uuid

from eventlog.connect import (
    NatsConnectFatal,
    check_connect_sync,
    check_files,
    options_from_args,
)
from eventlog.names import check_token
from settings.flags import CliError, add_options
from tokenization.model_tokenizer import load_codec
from workers.config import LINEAR_CONSTANTS, WORKER
from workers.engine_host import hosted_settings, serve_engines
from workers.perf_model import LINEAR
from workers.scheduler import EngineConfig
from workers.server import WorkerSettings, serve


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_options(p, WORKER)


def settings_from_args(args: argparse.Namespace) -> WorkerSettings:
    linear = {name: getattr(args, name) for name in LINEAR_CONSTANTS
              if getattr(args, name) is not None}
    if linear and args.perf_model != LINEAR:
        flag = "--" + next(iter(linear)).replace("_", "-")
        raise ValueError(f"{flag} sets the linear step-time model: add --perf-model linear")
    engine = EngineConfig(
        num_gpu_blocks=args.num_gpu_blocks,
        block_size=args.kv_cache_block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        perf_model=args.perf_model,
        **linear,
        speedup_ratio=args.speedup_ratio,
        transfer_ms_per_block=args.transfer_ms_per_block,
    )
    return WorkerSettings(
        # several engines: the id is their prefix, so the random one ends in "-" (w-1a2b3c4d-0)
        worker_id=args.worker_id or f"w-{uuid.uuid4().hex[:8]}{'-' if args.engines > 1 else ''}",
        model=args.model,
        host=args.host,
        port=args.port,
        nats_url=args.nats_url or "",
        namespace=args.namespace,
        engine=engine,
        dp_size=args.dp_size,
        advertise_url=args.advertise_url,
        default_max_tokens=args.default_max_tokens,
        shutdown_timeout=args.shutdown_timeout,
        model_path=args.model_path or None,
        role=args.role,
        nats=options_from_args(args, check=False),  # files are checked by run()
    )


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = settings_from_args(args)
        check_token(settings.worker_id, "worker id")
        if settings.model_path:
            load_codec(settings.model_path)  # a bad folder: one clear line, before binding
        if settings.dp_size < 1:
            raise ValueError("--dp-size must be at least 1")
        if settings.nats_url:
            check_files(settings.nats)
            # A wrong password or untrusted certificate: one line and exit 2 now, not an
            # engine serving requests whose cache events never reach the routers.
            check_connect_sync(settings.nats.with_servers(settings.nats_url),
                               name=f"jetrouter-worker-{settings.worker_id}")
        hosted = (hosted_settings(settings, args.engines, args.engine_offset)
                  if args.engines > 1 else None)
    except (ValueError, NatsConnectFatal) as exc:
        raise CliError(str(exc)) from None
    if hosted is not None:
        return serve_engines(hosted)
    return serve(settings)
