"""`jetrouter serve`: one router replica (its options are declared in api/config.py)."""

from __future__ import annotations

import argparse
import gc
import logging
import math
import secrets
import time
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
from replicas.runtime.replica import Replica, ReplicaConfig
from settings.flags import CliError, add_options, build

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
        tenant_fair_queue=bool(args.api_keys_file or args.tenant_header)
        and args.tenant_fair_queue,
        tenant_headroom=args.tenant_headroom,
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
        decision_candidates=args.decision_candidates,
        stream_max_bytes=args.stream_max_bytes,
        assume_kv_reuse=args.router_assume_kv_reuse,
        nats=options_from_args(args, check=False),  # files are checked by run()
    )


def run(args: argparse.Namespace, *, extra_routers: Sequence[RouterFactory] = ()) -> int:
    """Serve until SIGTERM. ``extra_routers`` add routes to the app (tests add debug ones)."""
    from api.app import AppConfig, create_app
    from leanhttp.hotpath import FrontDoor

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.otlp_traces_endpoint:
        from api.tracing import TracingUnavailable, check_available

        try:
            check_available(args.otlp_traces_endpoint)  # a missing extra is one clear line
        except TracingUnavailable as exc:
            raise CliError(str(exc)) from None
    try:
        config = build_config(args)
        check_files(config.nats_options)
        # One connection before anything starts: a wrong password or an untrusted certificate
        # is one line and exit 2 here, not a replica that retries forever.
        check_connect_sync(config.nats_options, name=config.replica_id)
    except (NatsOptionsInvalid, NatsConnectFatal) as exc:
        raise CliError(str(exc)) from None
    if args.api_keys_file:
        from api.tenancy import KeysFileInvalid, load_keys

        try:
            load_keys(args.api_keys_file)  # one clear line at start, not a failing app
        except KeysFileInvalid as exc:
            raise CliError(str(exc)) from None
    if args.model_path:
        from tokenization.model_tokenizer import ModelFolderUnusable, load_codec

        try:
            load_codec(args.model_path)  # a bad folder is one clear line, not a traceback
        except ModelFolderUnusable as exc:
            raise CliError(str(exc)) from None
    Path(args.data_dir).mkdir(parents=True, exist_ok=True)
    replica = Replica(config)
    app = create_app(replica, build(AppConfig, args, reset_on_start=args.router_reset_states),
                     extra_routers=extra_routers)
    config_ = uvicorn.Config(FrontDoor(app), host=args.host, port=args.port,
                             log_level=args.log_level, access_log=False,
                             http=guarded_http_protocol(args.request_read_timeout),  # type: ignore[arg-type]
                             timeout_keep_alive=int(max(1, args.http_keep_alive_timeout)),
                             timeout_graceful_shutdown=int(args.graceful_shutdown_timeout))
    tune_gc()
    server = DrainingServer(config_, replica)
    server.run()
    return 0


# Young-generation threshold of the cyclic GC while serving (CPython's default is 700).
GC_YOUNG_THRESHOLD = 10_000


def tune_gc() -> None:
    """Fewer cyclic-GC passes while serving. A routed request keeps a few dozen containers alive
    (coroutines, futures, dicts), so with 64 requests in flight the default threshold of 700
    net container allocations was crossed every few requests: in a ~40 s `bench overhead` run at
    concurrency 64, ~570 young, ~50 middle and 4 full collections took 0.69 of the replica's
    7.8 CPU seconds (measured with ``gc.callbacks``); at 10,000, 4 young and no full one,
    0.03 s. Cyclic garbage waits a little longer (at most that many net allocations). The
    modules and the app built at start-up are frozen (``gc.freeze``): full collections no
    longer walk them."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, older, oldest)


class DrainingServer(uvicorn.Server):
    """On SIGTERM/SIGINT: drain while still listening, then shut down.

    /ready turns 503 and /ready/balancer 404 at once, new requests get 503 + Retry-After, and
    in-flight ones finish. The listening socket stays open meanwhile, so a load balancer's
    health check keeps getting an answer: it sees "alive, not ready" and drains the replica
    instead of "no answer", which `on-marked-down shutdown-sessions` would answer by cutting
    the very streams the drain protects. When no request is left in flight, or after
    --graceful-shutdown-timeout, uvicorn's own shutdown closes the socket; what is still
    running then is cancelled at once. A second signal skips the rest of the drain."""

    def __init__(self, config: uvicorn.Config, replica: Replica) -> None:
        super().__init__(config)
        self.replica = replica
        self.drain_timeout = float(config.timeout_graceful_shutdown or 0)
        self.drain_deadline: float | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.replica.draining = True
        self.replica.ready = False
        if self.drain_deadline is None and not self.should_exit and self.started:
            self._captured_signals.append(sig)  # re-raised on the way out, as uvicorn does
            self.drain_deadline = time.monotonic() + self.drain_timeout
            return
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self.drain_deadline is not None and not self.should_exit:
            left = self.drain_deadline - time.monotonic()
            if not self.server_state.tasks or left <= 0:
                # Whatever is still running gets only the drain time that is left.
                self.config.timeout_graceful_shutdown = max(0, math.ceil(left))
                self.should_exit = True
        return await super().on_tick(counter)
