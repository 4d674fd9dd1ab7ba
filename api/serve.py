"""`jetrouter serve`: one router replica (flags named as in the seeds, design.md §10)."""

from __future__ import annotations

import argparse
import logging
import secrets
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn

from api.http_limits import (
    DEFAULT_KEEP_ALIVE_TIMEOUT,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_REQUEST_READ_TIMEOUT,
    guarded_http_protocol,
)
from eventlog.connect import (
    NatsConnectFatal,
    NatsOptionsError,
    add_nats_arguments,
    check_connect_sync,
    check_files,
    options_from_args,
)
from replicas.core.selection import BusyThresholds, RoutingConfig
from replicas.core.state import StateConfig
from replicas.runtime.replica import Replica, ReplicaConfig

MODES = ("kv", "round-robin", "random", "least-loaded")


def _number(kind: type, *, above: float | None = None, at_least: float | None = None,
            at_most: float | None = None) -> Callable[[str], Any]:
    """An argparse `type` that parses `kind` and checks its range, with a clear message."""
    bounds = " and ".join(b for b in (f"> {above}" if above is not None else "",
                                      f">= {at_least}" if at_least is not None else "",
                                      f"<= {at_most}" if at_most is not None else "") if b)

    def parse(v: str) -> Any:
        try:
            x = kind(v)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a valid {kind.__name__}: {v!r}") from None
        if ((above is not None and not x > above) or (at_least is not None and x < at_least)
                or (at_most is not None and x > at_most)):
            raise argparse.ArgumentTypeError(f"must be {bounds}, got {v}")
        return x

    parse.__name__ = kind.__name__  # argparse names the type in its own messages
    return parse


_positive_int = _number(int, above=0)
_count = _number(int, at_least=0)
_positive_float = _number(float, above=0)
_non_negative = _number(float, at_least=0)
_fraction = _number(float, at_least=0, at_most=1)


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--replica-id", default=None, help="stable id (default: random r-xxxxxx)")
    g.add_argument("--nats-url", default="nats://127.0.0.1:4222",
                   help="NATS server URL, or a comma-separated list for a cluster")
    g.add_argument("--namespace", default="jr", help="prefix of every stream, subject and bucket")
    g.add_argument("--data-dir", default=".jetrouter/replica")
    g.add_argument("--admin-token", default=None, help="bearer token enabling /admin/*")
    g.add_argument("--tokenizer", default=None, help="path to a HuggingFace tokenizer.json")
    g.add_argument("--model-path", default=None,
                   help="HuggingFace model folder (tokenizer.json + tokenizer_config.json with "
                        "the chat template): hash prompts and chats as the engines tokenize "
                        "them; give simulated workers the same folder")
    g.add_argument("--max-prompt-tokens", type=_positive_int, default=131072)
    g.add_argument("--graceful-shutdown-timeout", type=_non_negative, default=30.0,
                   help="on SIGTERM: stop taking requests, let in-flight ones finish this long")
    g.add_argument("--max-body-bytes", type=_positive_int, default=DEFAULT_MAX_BODY_BYTES,
                   help="largest request body accepted, in bytes; larger ones get 413 before "
                        "they are read (default 8 MiB)")
    g.add_argument("--request-read-timeout", type=_positive_float,
                   default=DEFAULT_REQUEST_READ_TIMEOUT,
                   help="seconds a client has to send a whole request (headers and body) "
                        "before its connection is closed (slow clients, slowloris)")
    g.add_argument("--http-keep-alive-timeout", type=_positive_float,
                   default=DEFAULT_KEEP_ALIVE_TIMEOUT,
                   help="seconds an idle kept-alive client connection stays open")
    g.add_argument("--busy-threshold-requires-admin", action="store_true",
                   help="require the admin bearer token for POST /busy_threshold (Dynamo "
                        "leaves it open)")
    g.add_argument("--ready-wait", type=_non_negative, default=5.0,
                   help="seconds a request reaching a replica that is still catching up waits "
                        "for it to be ready before a 503 (0: answer 503 at once)")
    g.add_argument("--log-level", default="warning",
                   choices=("debug", "info", "warning", "error"))
    r = p.add_argument_group("routing")
    r.add_argument("--router-mode", default="kv", choices=MODES)
    r.add_argument("--router-temperature", type=_non_negative, default=0.0)
    r.add_argument("--router-kv-overlap-score-weight", type=_non_negative, default=8.0,
                   help="weight of the request's own uncached prefill blocks (Dynamo: 1.0)")
    r.add_argument("--router-prefill-queue-weight", type=_non_negative, default=1.0,
                   help="weight of a worker's already-queued prefill blocks (Dynamo's formula "
                        "uses the overlap weight here too; docs/design-notes.md)")
    r.add_argument("--kv-cache-block-size", type=_positive_int, default=16)
    r.add_argument("--no-router-kv-events", dest="router_kv_events", action="store_false",
                   help="approximate mode: predict caches from routing decisions (TTL + pruning)")
    r.add_argument("--router-ttl-secs", type=_non_negative, default=120.0)
    r.add_argument("--router-max-tree-size", type=_positive_int, default=2**20)
    r.add_argument("--router-prune-target-ratio", type=_fraction, default=0.8)
    r.add_argument("--active-decode-blocks-threshold", type=_fraction, default=None)
    r.add_argument("--active-prefill-tokens-threshold", type=int, default=None)
    r.add_argument("--active-prefill-tokens-threshold-frac", type=_non_negative, default=None)
    r.add_argument("--router-queue-threshold", type=float, default=None,
                   help="hold requests while every worker is over this fraction of "
                        "max_num_batched_tokens (must be > 0)")
    r.add_argument("--router-queue-policy", default="fcfs", choices=("fcfs", "lcfs", "wspt"))
    r.add_argument("--request-max-age", type=_non_negative, default=600.0,
                   help="in-flight requests older than this (event time) stop counting as load")
    r.add_argument("--seed", type=int, default=None, help="seed of the routing random source")
    s = p.add_argument_group("durability")
    s.add_argument("--router-snapshot-threshold", type=_positive_int, default=1_000_000,
                   help="the leader snapshots once this many messages were appended since the "
                        "last snapshot (changeable at runtime: PUT /admin/snapshot-threshold)")
    s.add_argument("--snapshot-keep", type=_positive_int, default=3,
                   help="snapshot blobs kept in the object store")
    s.add_argument("--lease-ttl", type=float, default=5.0,
                   help="leader lease time-to-live, seconds")
    s.add_argument("--router-reset-states", action="store_true",
                   help="on start, reset every replica's state (new epoch, streams purged, "
                        "engines re-announce) — coordinated through the leader")
    s.add_argument("--database-url", default=None,
                   help="SQLAlchemy async URL of the catalog and ledger "
                        "(default: sqlite+aiosqlite:///<data-dir>/jetrouter.db)")
    s.add_argument("--ledger-retention", type=_non_negative, default=7 * 86400.0,
                   help="seconds of routing decisions kept in the ledger (event time; 0 keeps "
                        "everything)")
    lv = p.add_argument_group("liveness")
    lv.add_argument("--heartbeat-interval", type=_positive_float, default=1.0)
    lv.add_argument("--replica-timeout", type=_positive_float, default=10.0,
                    help="a replica silent this long is declared lost: its requests are freed")
    lv.add_argument("--worker-timeout", type=_positive_float, default=10.0,
                    help="an engine with no load reports and failing /health this long is retired")
    h = p.add_argument_group("worker faults")
    h.add_argument("--stream-idle-timeout", type=_positive_float, default=30.0,
                   help="seconds without a token before a request migrates to another engine")
    h.add_argument("--migration-limit", type=_count, default=3,
                   help="times one request may move to another engine after a failure")
    h.add_argument("--canary-interval", type=_non_negative, default=30.0,
                   help="seconds between the leader's canary checks of each engine (0: off)")
    h.add_argument("--canary-timeout", type=_non_negative, default=5.0)
    h.add_argument("--canary-recovery-timeout", type=_non_negative, default=60.0,
                   help="seconds an open circuit breaker waits before its half-open trial")
    s.add_argument("--decision-append-timeout", type=_positive_float, default=15.0,
                   help="seconds a request waits for JetStream to acknowledge its routing "
                        "decision (retries included) before it is refused with 503")
    s.add_argument("--stream-max-bytes", type=_positive_int, default=None,
                   help="size limit of each stream in bytes (default: unlimited, or what the "
                        "stream already has); a full stream refuses appends (discard new)")
    s.add_argument("--no-snapshots", dest="durable", action="store_false",
                   help=argparse.SUPPRESS)
    add_nats_arguments(p)


def _default_db(data_dir: str) -> str:
    # Pure (no mkdir): `jetrouter check-config` builds configs as a dry run; `run` makes the dir.
    from snapshots.db import DB_FILE

    return f"sqlite+aiosqlite:///{Path(data_dir).expanduser().resolve() / DB_FILE}"


def build_config(args: argparse.Namespace) -> ReplicaConfig:
    if args.router_queue_threshold is not None and args.router_queue_threshold <= 0:
        raise SystemExit("jetrouter serve: error: --router-queue-threshold must be > 0")
    replica_id = args.replica_id or f"r-{secrets.token_hex(3)}"
    return ReplicaConfig(
        replica_id=replica_id,
        nats_url=args.nats_url,
        namespace=args.namespace,
        state=StateConfig(block_size=args.kv_cache_block_size,
                          approximate=not args.router_kv_events,
                          ttl_secs=args.router_ttl_secs,
                          max_tree_size=args.router_max_tree_size,
                          prune_target_ratio=args.router_prune_target_ratio,
                          request_max_age=args.request_max_age),
        routing=RoutingConfig(mode=args.router_mode,
                              kv_overlap_score_weight=args.router_kv_overlap_score_weight,
                              temperature=args.router_temperature,
                              block_size=args.kv_cache_block_size,
                              prefill_queue_weight=args.router_prefill_queue_weight),
        default_thresholds=BusyThresholds(args.active_decode_blocks_threshold,
                                          args.active_prefill_tokens_threshold,
                                          args.active_prefill_tokens_threshold_frac),
        queue_threshold=args.router_queue_threshold,
        queue_policy=args.router_queue_policy,
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
        stream_max_bytes=args.stream_max_bytes,
        nats=options_from_args(args, check=False),  # files are checked by run()
    )


def run(args: argparse.Namespace) -> int:
    from api.app import AppConfig, create_app

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from api.cli import CliError

    try:
        config = build_config(args)
        check_files(config.nats_options)
        # One connection before anything starts: a wrong password or an untrusted certificate
        # is one line and exit 2 here, not a replica that retries forever.
        check_connect_sync(config.nats_options, name=config.replica_id)
    except (NatsOptionsError, NatsConnectFatal) as exc:
        raise CliError(str(exc)) from None
    if args.model_path:
        from eventlog.model_tokenizer import ModelFolderError, load_codec

        try:
            load_codec(args.model_path)  # a bad folder is one clear line, not a traceback
        except ModelFolderError as exc:
            raise CliError(str(exc)) from None
    Path(args.data_dir).mkdir(parents=True, exist_ok=True)
    replica = Replica(config)
    app = create_app(replica, AppConfig(max_prompt_tokens=args.max_prompt_tokens,
                                        admin_token=args.admin_token, tokenizer=args.tokenizer,
                                        model_path=args.model_path,
                                        reset_on_start=args.router_reset_states,
                                        stream_idle_timeout=args.stream_idle_timeout,
                                        migration_limit=args.migration_limit,
                                        max_body_bytes=args.max_body_bytes,
                                        busy_threshold_requires_admin=(
                                            args.busy_threshold_requires_admin),
                                        ready_wait=args.ready_wait))
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
