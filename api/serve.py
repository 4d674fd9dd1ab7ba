"""`jetrouter serve`: one router replica (its options are declared in api/config.py)."""

from __future__ import annotations

import argparse
import logging
import secrets
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn

from api.config import SERVE, busy_thresholds, routing_config, state_config
from api.http_limits import guarded_http_protocol
from eventlog.connect import (
    NatsConnectFatal,
    NatsOptionsInvalid,
    check_connect_sync,
    check_files,
    options_from_args,
)
from eventlog.flags import CliError, add_options, build
from replicas.runtime.replica import Replica, ReplicaConfig

if TYPE_CHECKING:  # api.app is imported when serving starts, not at CLI start-up
    from api.app import RouterFactory


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_options(p, SERVE)


def _default_db(data_dir: str) -> str:
    # Pure (no mkdir): `jetrouter check-config` builds configs as a dry run; `run` makes the dir.
    from snapshots.db import DB_FILE

    return f"sqlite+aiosqlite:///{Path(data_dir).expanduser().resolve() / DB_FILE}"


def build_config(args: argparse.Namespace) -> ReplicaConfig:
    replica_id = args.replica_id or f"r-{secrets.token_hex(3)}"
    return ReplicaConfig(
        replica_id=replica_id,
        nats_url=args.nats_url,
        namespace=args.namespace,
        state=state_config(args),
        routing=routing_config(args),
        default_thresholds=busy_thresholds(args),
        queue_threshold=args.router_queue_threshold,
        queue_policy=args.router_queue_policy,
        track_output_blocks=args.router_track_output_blocks,
        prefill_load_model=args.router_prefill_load_model,
        seed=args.seed,
        durable=args.durable,
        snapshot_threshold=args.router_snapshot_threshold,
        snapshot_keep=args.snapshot_keep,
        lease_ttl=args.lease_ttl,
        database_url=args.database_url or _default_db(args.data_dir),
        ledger_retention=args.ledger_retention,
        heartbeat_interval=args.heartbeat_interval,
        replica_timeout=args.replica_timeout,
        worker_timeout=args.worker_timeout,
        canary_interval=args.canary_interval,
        canary_timeout=args.canary_timeout,
        canary_recovery_timeout=args.canary_recovery_timeout,
        decision_append_timeout=args.decision_append_timeout,
        decision_record_grace=args.decision_record_grace,
        stream_max_bytes=args.stream_max_bytes,
        assume_kv_reuse=args.router_assume_kv_reuse,
        nats=options_from_args(args, check=False),  # files are checked by run()
    )


def run(args: argparse.Namespace, *, extra_routers: Sequence[RouterFactory] = ()) -> int:
    """Serve until SIGTERM. ``extra_routers`` add routes to the app (tests add debug ones)."""
    from api.app import AppConfig, create_app

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = build_config(args)
        check_files(config.nats_options)
        # One connection before anything starts: a wrong password or an untrusted certificate
        # is one line and exit 2 here, not a replica that retries forever.
        check_connect_sync(config.nats_options, name=config.replica_id)
    except (NatsOptionsInvalid, NatsConnectFatal) as exc:
        raise CliError(str(exc)) from None
    if args.model_path:
        from eventlog.model_tokenizer import ModelFolderUnusable, load_codec

        try:
            load_codec(args.model_path)  # a bad folder is one clear line, not a traceback
        except ModelFolderUnusable as exc:
            raise CliError(str(exc)) from None
    Path(args.data_dir).mkdir(parents=True, exist_ok=True)
    replica = Replica(config)
    app = create_app(replica, build(AppConfig, args, reset_on_start=args.router_reset_states),
                     extra_routers=extra_routers)
    config_ = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                             access_log=False,
                             http=guarded_http_protocol(args.request_read_timeout),  # type: ignore[arg-type]
                             timeout_keep_alive=int(max(1, args.http_keep_alive_timeout)),
                             timeout_graceful_shutdown=int(args.graceful_shutdown_timeout))
    server = DrainingServer(config_, replica)
    server.run()
    return 0


class DrainingServer(uvicorn.Server):
    """On SIGTERM/SIGINT: /ready turns 503 at once (load balancers stop sending), new requests
    are refused, in-flight ones finish; the lease is released on the way out."""

    def __init__(self, config: uvicorn.Config, replica: Replica) -> None:
        super().__init__(config)
        self.replica = replica

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.replica.draining = True
        self.replica.ready = False
        super().handle_exit(sig, frame)
