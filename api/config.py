"""The router replica's options (`jetrouter serve`), each declared once (see settings/flags.py).

Names follow the seeds (design.md §10). `jetrouter serve`'s argparse, its environment variables
and the typed configs below come from :data:`SERVE`; `jetrouter up` forwards some of them to the
replicas it starts, and `jetrouter bench core` times the routing defaults declared here.
To add an option or an alias: one line in the group it belongs to (settings/flags.py says how).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping

from api.http_limits import (
    DEFAULT_KEEP_ALIVE_TIMEOUT,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_REQUEST_READ_TIMEOUT,
)
from eventlog.connect import NAMESPACE, NATS_SECURITY
from replicas.core.prefill_model import PREFILL_LOAD_MODELS
from replicas.core.queue import POLICIES
from replicas.core.selection import MODES, BusyThresholds, RoutingConfig
from replicas.core.state import StateConfig
from replicas.core.tenant_headroom import DEFAULT_HEADROOM
from settings.flags import Group, Option, defaults, find

LOG_LEVELS = ("debug", "info", "warning", "error")


def candidate_count(text: str) -> int:
    """``--decision-candidates``: a count of rows, 0 or ``all`` for every candidate's."""
    if text.strip().lower() == "all":
        return 0
    count = int(text)
    if count < 0:
        raise ValueError(f"expected a count >= 0 or 'all', got {text!r}")
    return count


SERVER = Group(
    "server",
    # --http-host / --http-port: Dynamo's frontend names (python -m dynamo.frontend ...).
    Option("host", default="127.0.0.1", help="listen address", aliases=("--http-host",)),
    Option("port", int, 8000, "listen port", aliases=("--http-port",)),
    Option("replica-id", help="stable id (default: random r-xxxxxx)"),
    Option("nats-url", default="nats://127.0.0.1:4222",
           help="NATS server URL, or a comma-separated list for a cluster"),
    NAMESPACE,
    Option("data-dir", default=".jetrouter/replica", help="the replica's catalog and ledger"),
    Option("admin-token", help="bearer token enabling /admin/*"),
    Option("tokenizer", help="path to a HuggingFace tokenizer.json"),
    Option("model-path", help="HuggingFace model folder (tokenizer.json + tokenizer_config.json "
                              "with the chat template): hash prompts and chats as the engines "
                              "tokenize them; give simulated workers the same folder"),
    Option("max-prompt-tokens", int, 131072, "longest prompt accepted, in tokens", above=0),
    Option("graceful-shutdown-timeout", float, 30.0,
           "on SIGTERM: stop taking requests, let in-flight ones finish this long", at_least=0),
    Option("max-body-bytes", int, DEFAULT_MAX_BODY_BYTES,
           "largest request body accepted, in bytes; larger ones get 413 before they are read",
           above=0),
    Option("request-read-timeout", float, DEFAULT_REQUEST_READ_TIMEOUT,
           "seconds a client has to send a whole request (headers and body) before its "
           "connection is closed (slow clients, slowloris)", above=0),
    Option("http-keep-alive-timeout", float, DEFAULT_KEEP_ALIVE_TIMEOUT,
           "seconds an idle kept-alive client connection stays open", above=0),
    Option("busy-threshold-requires-admin", bool,
           help="require the admin bearer token for POST /busy_threshold (Dynamo leaves it open)"),
    Option("ready-wait", float, 5.0,
           "seconds a request reaching a replica that is still catching up waits for it to be "
           "ready before a 503 (0: answer 503 at once)", at_least=0),
    Option("log-level", default="warning", choices=LOG_LEVELS),
    Option("otlp-traces-endpoint", metavar="URL",
           help="export OpenTelemetry traces of every request (decisions, hops, migrations) to "
                "this OTLP collector; OTEL_EXPORTER_OTLP_TRACES_PROTOCOL picks http/protobuf "
                "(default) or grpc; needs the `tracing` extra (off by default)"),
)

TENANTS = Group(
    "tenants",
    Option("api-keys-file", help="YAML or JSON mapping API key -> tenant id: requests must send "
                                 "`Authorization: Bearer KEY` (401 otherwise) and count against "
                                 "their tenant's limits (PUT /admin/tenants/ID)"),
    Option("tenant-header", help="without keys: take the tenant id from this request header, "
                                 "set by a trusted gateway (e.g. x-tenant-id); off by default"),
    Option("no-tenant-fair-queue", bool, True, dest="tenant_fair_queue",
           help="with tenants, keep the router queue in --router-queue-policy order alone "
                "instead of serving tenants by weighted fair share of tokens"),
    Option("tenant-headroom", float, DEFAULT_HEADROOM,
           "with the fair queue: the most of the engines (a fraction; at least one engine when "
           "above 0) a tenant over its weighted share leaves free while another active tenant "
           "is under its share, so that tenant's next request starts at once; 0: nothing held",
           at_least=0, at_most=1),
)

ROUTING = Group(
    "routing",
    Option("router-mode", default="kv", choices=MODES),
    Option("router-temperature", float, 0.0, at_least=0),
    Option("router-kv-overlap-score-weight", float, 8.0,
           "weight of the request's own uncached prefill blocks (Dynamo: 1.0)", at_least=0),
    Option("router-prefill-queue-weight", float, 1.0,
           "weight of a worker's already-queued prefill blocks (Dynamo's formula uses the "
           "overlap weight here too; docs/decisions/0012-cost-model-split-prefill-weight.md)",
           at_least=0),
    Option("kv-cache-block-size", int, 16, "tokens per KV block (must match the engines)",
           above=0, aliases=("--router-block-size",)),
    Option("router-index-form", str, "reference",
           "the prefix index's form: reference (pure Python, snapshots any release reads) or "
           "compact (~4x less memory per cached block, 3-4x faster KV apply and replay, "
           "decisions as fast; snapshots in format 6); the same on every replica",
           choices=("reference", "compact")),
    Option("no-router-kv-events", bool, True, dest="router_kv_events",
           help="approximate mode: predict caches from routing decisions (TTL + pruning)"),
    Option("no-router-track-active-blocks", bool, True, dest="router_track_active_blocks",
           help="charge engines no decode blocks for in-flight requests (engines that only "
                "prefill)"),
    Option("no-router-track-prefill-tokens", bool, True, dest="router_track_prefill_tokens",
           help="leave queued prompt tokens out of the cost and the prefill busy thresholds "
                "(decode-only paths)"),
    Option("no-router-assume-kv-reuse", bool, True, dest="router_assume_kv_reuse",
           help="engines do not reuse blocks they already hold: every block of a request is "
                "its own (not shared with other in-flight requests), and in disaggregated "
                "serving a decode decision counts no overlap (pure load balancing)"),
    Option("session-ttl-secs", float, 300.0,
           "sliding TTL (event time) of sticky sessions named only by the X-Dynamo-Session-ID "
           "header, and the default of nvext.session_control.timeout", above=0),
    Option("response-ttl-secs", float, 3600.0,
           "how long (event time) the router remembers which engine stored a Responses API "
           "response, for follow-ups naming it as previous_response_id", above=0),
    Option("router-ttl-secs", float, 120.0, at_least=0),
    Option("router-max-tree-size", int, 2**20, above=0),
    Option("router-prune-target-ratio", float, 0.8, at_least=0, at_most=1),
    Option("active-decode-blocks-threshold", float, at_least=0, at_most=1),
    Option("active-prefill-tokens-threshold", int),
    Option("active-prefill-tokens-threshold-frac", float, at_least=0),
    Option("router-queue-threshold", float,
           help="hold requests while every worker is over this fraction of "
                "max_num_batched_tokens", above=0),
    Option("router-queue-policy", default="fcfs", choices=POLICIES),
    Option("router-track-output-blocks", bool,
           help="also count placeholder decode blocks as generation crosses block boundaries, "
                "each weighted by what is left of the request's nvext.agent_hints.osl (full "
                "weight without one); progress is an event on the router stream"),
    Option("router-prefill-load-model", default="none", choices=PREFILL_LOAD_MODELS,
           help="linear: the oldest active prefill on each engine decays over its predicted "
                "duration (uncached tokens / the engine's throughput learned from observed "
                "prefills, event time); none: it counts whole until its first token"),
    Option("request-max-age", float, 600.0,
           "in-flight requests older than this (event time) stop counting as load", at_least=0),
    Option("seed", int, help="seed of the routing random source"),
)

# Dynamo flags that name what is always so here, accepted so a Dynamo command line starts
# unchanged (README, "Coming from Dynamo", says why each is always on or ignored).
DYNAMO_ALWAYS = Group(
    "accepted for Dynamo command lines (always so here)",
    Option("router-kv-events", bool, dest="dynamo_router_kv_events",
           help="the default: use the engines' KV events"),
    Option("router-track-active-blocks", bool, dest="dynamo_router_track_active_blocks",
           help="the default"),
    Option("router-track-prefill-tokens", bool, dest="dynamo_router_track_prefill_tokens",
           help="the default"),
    Option("router-assume-kv-reuse", bool, dest="dynamo_router_assume_kv_reuse",
           help="the default"),
    Option("router-replica-sync", bool,
           help="always on: replicas share every decision through the router stream"),
    Option("router-durable-kv-events", bool,
           help="always on: KV events and decisions are on JetStream"),
    Option("router-event-threads", int,
           help="ignored: one event loop applies events in stream order", above=0),
)

DURABILITY = Group(
    "durability",
    Option("router-snapshot-threshold", int, 1_000_000,
           "the leader snapshots once this many messages were appended since the last snapshot "
           "(changeable at runtime: PUT /admin/snapshot-threshold)", above=0),
    Option("snapshot-keep", int, 3, "snapshot blobs kept in the object store", above=0),
    Option("lease-ttl", float, 5.0, "leader lease time-to-live, seconds"),
    Option("router-reset-states", bool,
           help="on start, reset every replica's state (new epoch, streams purged, engines "
                "re-announce) — coordinated through the leader"),
    Option("database-url", help="SQLAlchemy async URL of the catalog and ledger "
                                "(default: sqlite+aiosqlite:///<data-dir>/jetrouter.db)"),
    Option("ledger-retention", float, 7 * 86400.0,
           "seconds of routing decisions kept in the ledger (event time; 0 keeps everything)",
           at_least=0),
    Option("decision-candidates", candidate_count, 8,
           "cost rows each routing decision records for the ledger, traces and `jetrouter "
           "admin request`: the chosen engine's and the cheapest others' (0 or all: every "
           "candidate's, which makes each decision cost more with every engine)", metavar="K"),
    Option("decision-append-timeout", float, 15.0,
           "seconds a request waits for JetStream to acknowledge its routing decision (retries "
           "included) before it is refused with 503 (with a grace: the longest spell of "
           "serving requests whose decisions are not acknowledged yet)", above=0),
    Option("decision-record-grace", float, 1.0,
           "seconds after which a request whose routing decision is neither acknowledged nor "
           "refused is served anyway while the append is retried (a stream leader election); "
           "0 waits for the acknowledgement (strict)", at_least=0),
    Option("stream-max-bytes", int,
           help="size limit of each stream in bytes (default: unlimited, or what the stream "
                "already has); a full stream refuses appends (discard new)", above=0),
    Option("no-snapshots", bool, True, dest="durable", hidden=True),
)

LIVENESS = Group(
    "liveness",
    Option("heartbeat-interval", float, 1.0, above=0),
    Option("replica-timeout", float, 10.0,
           "a replica silent this long is declared lost: its requests are freed", above=0),
    Option("worker-timeout", float, 10.0,
           "an engine with no load reports and failing /health this long is retired", above=0),
)

WORKER_FAULTS = Group(
    "worker faults",
    Option("stream-idle-timeout", float, 30.0,
           "seconds without a token before a request migrates to another engine", above=0),
    Option("engine-connect-timeout", float, 5.0,
           "seconds one TCP connect to an engine may take; one that times out to an engine "
           "still publishing its load is tried again within --stream-idle-timeout when no "
           "other engine can take the request", above=0),
    Option("first-byte-timeout", float, 120.0,
           "seconds a request waits for the first byte of an engine's answer while the engine "
           "still publishes its load (a busy engine, a first KV transfer), before "
           "--stream-idle-timeout ends it; 0: --stream-idle-timeout alone", at_least=0),
    Option("migration-limit", int, 3,
           "times one request may move to another engine after a failure", at_least=0),
    Option("canary-interval", float, 30.0,
           "seconds between the leader's canary checks of each engine (0: off)", at_least=0),
    Option("canary-timeout", float, 5.0, at_least=0),
    Option("canary-recovery-timeout", float, 60.0,
           "seconds an open circuit breaker waits before its half-open trial", at_least=0),
)

SERVE = (SERVER, TENANTS, ROUTING, DURABILITY, LIVENESS, WORKER_FAULTS, NATS_SECURITY,
         DYNAMO_ALWAYS)
"""Every option of `jetrouter serve`, in the order `--help` shows them."""


def option(name: str) -> Option:
    """The `serve` option named ``name`` (without dashes)."""
    return find(SERVE, name)


def serve_defaults(environ: Mapping[str, str] | None = None) -> argparse.Namespace:
    """`jetrouter serve`'s values with no command line (environment, else defaults)."""
    return defaults(SERVE, environ)


def routing_config(values: argparse.Namespace) -> RoutingConfig:
    """The selector's configuration from `serve` values (the benchmark uses the same)."""
    return RoutingConfig(mode=values.router_mode,
                         kv_overlap_score_weight=values.router_kv_overlap_score_weight,
                         temperature=values.router_temperature,
                         block_size=values.kv_cache_block_size,
                         prefill_queue_weight=values.router_prefill_queue_weight,
                         track_active_blocks=values.router_track_active_blocks,
                         track_prefill_tokens=values.router_track_prefill_tokens)


def busy_thresholds(values: argparse.Namespace) -> BusyThresholds:
    return BusyThresholds(values.active_decode_blocks_threshold,
                          values.active_prefill_tokens_threshold,
                          values.active_prefill_tokens_threshold_frac)


def state_config(values: argparse.Namespace) -> StateConfig:
    return StateConfig(block_size=values.kv_cache_block_size,
                       approximate=not values.router_kv_events,
                       ttl_secs=values.router_ttl_secs,
                       max_tree_size=values.router_max_tree_size,
                       prune_target_ratio=values.router_prune_target_ratio,
                       request_max_age=values.request_max_age,
                       index_form=values.router_index_form)
