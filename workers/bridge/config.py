"""The bridge's options (`jetrouter bridge`), each declared once (see settings/flags.py).

The option names are :class:`BridgeSettings`' field names, so the settings
are built from the parsed flags by name (:func:`settings.flags.build`).
To add an option or an alias: one line in the group it belongs to (settings/flags.py says how).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from errors.root import JetrouterError
from eventlog.connect import NAMESPACE, NATS_SECURITY, NatsOptions
from eventlog.events import EngineKind, Role
from settings.flags import Group, Option, find


class BridgeConfigInvalid(JetrouterError, ValueError):
    """Settings the bridge cannot run with (reported as one line, exit 2)."""


@dataclass(slots=True)
class BridgeSettings:
    engine_url: str
    kv_events: str
    worker_id: str
    nats_url: str
    kv_replay: str = ""
    namespace: str = "jr"
    kv_topic: str = ""
    block_size: int | None = None
    kv_total_blocks: int | None = None
    max_num_batched_tokens: int = 8192
    advertise_url: str | None = None
    # Disaggregated serving: routers hand a prefill engine's KV over in the protocol of its
    # engine kind ("auto": found in /metrics; api/forward/prefill.py); a failed hand-off falls
    # back to aggregated serving.
    role: str = "both"
    engine_kind: str = "auto"
    bootstrap_port: int = 0  # an SGLang prefill engine's bootstrap server (0: not given)
    model: str | None = None
    health_interval: float = 2.0
    unhealthy_after: float = 10.0
    load_interval: float = 1.0
    replay_timeout: float = 5.0
    engine_http_timeout: float = 5.0
    nats: NatsOptions = field(default_factory=NatsOptions)  # credentials and TLS

def zmq_endpoint(raw: str) -> str:
    if raw and "://" not in raw:
        raise ValueError(f"{raw!r} is not a ZMQ endpoint like tcp://host:5557")
    return raw


ENGINE = Group(
    "engine",
    Option("engine-url", required=True,
           help="the engine's OpenAI server, e.g. http://10.0.0.5:8000 (serves /v1/models, "
                "/metrics, /health)"),
    Option("kv-events", zmq_endpoint, required=True,
           help="the engine's ZMQ PUB endpoint, e.g. tcp://10.0.0.5:5557"),
    Option("kv-replay", zmq_endpoint, "",
           "the engine's ZMQ replay endpoint, e.g. tcp://10.0.0.5:5558 (without it a missed "
           "batch clears the worker's blocks instead of being replayed)"),
    Option("kv-topic", default="",
           help="ZMQ topic to subscribe to (vLLM's kv-events-config 'topic'; default: all)"),
    Option("worker-id", required=True,
           help="id on the KV stream and in routing decisions (stable across bridge restarts: "
                "it is how a restarted bridge finds where it left off)"),
    Option("block-size", int,
           help="tokens per KV block (default: from vllm:cache_config_info in /metrics, else "
                "the first BlockStored); must equal the router's --kv-cache-block-size",
           above=0),
    Option("kv-total-blocks", int,
           help="KV capacity in blocks (default: num_gpu_blocks from /metrics)", above=0),
    Option("max-num-batched-tokens", int, 8192,
           "the engine's token budget per step, for the router's cost model", above=0),
    Option("advertise-url", help="URL routers send requests to (default: --engine-url)"),
    Option("model", help="served model name (default: the base model in /v1/models)"),
    Option("role", default=Role.BOTH, choices=tuple(Role),
           help="disaggregated serving role registered for the engine; routers hand a prefill "
                "vLLM engine's KV over with vLLM's kv_transfer_params (a NIXL KV connector on "
                "both engines), a jetrouter engine's with POST /v1/prefill (see README); a "
                "failed hand-off falls back to aggregated serving on decode engines"),
    Option("engine-kind", default="auto", choices=("auto", *EngineKind),
           help="the engine software, which decides the KV hand-off protocol (default: from "
                "the metric names in /metrics: vllm: or sglang:, else jetrouter)"),
    Option("bootstrap-port", int, 0,
           "an SGLang prefill engine's bootstrap server port (its "
           "--disaggregation-bootstrap-port, SGLang's default 8998): routers name it to both "
           "engines of a hand-off; 0: not given (routers send null, as SGLang's router does)",
           at_least=0, at_most=65535),
)

BRIDGE_PROCESS = Group(
    "bridge",
    Option("nats-url", default="nats://127.0.0.1:4222", help="NATS server(s), comma-separated"),
    NAMESPACE,
    Option("health-interval", float, 2.0, "seconds between /health checks", above=0),
    Option("unhealthy-after", float, 10.0, "retire the worker when /health fails this long",
           above=0),
    Option("load-interval", float, 1.0, "seconds between load gauges read from /metrics",
           above=0),
    Option("engine-http-timeout", float, 5.0,
           "seconds the engine's /health and /metrics may take to answer; one that times out "
           "while the engine's KV events flow is busy, not unhealthy", above=0),
    Option("replay-timeout", float, 5.0,
           "seconds of silence before a replay request counts as failed", above=0),
    Option("log-level", default="info", choices=("debug", "info", "warning", "error")),
)

BRIDGE = (ENGINE, BRIDGE_PROCESS, NATS_SECURITY)
"""Every option of `jetrouter bridge`, in the order `--help` shows them."""


def option(name: str) -> Option:
    """The `bridge` option named ``name`` (without dashes)."""
    return find(BRIDGE, name)
