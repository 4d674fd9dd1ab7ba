"""The simulated engine's options (`jetrouter worker`), each declared once (see eventlog/flags.py).

Names follow vLLM and Dynamo. The engine model's defaults are :class:`EngineConfig`'s own; the
router's `jetrouter up` forwards some of these to the workers it starts.
To add an option or an alias: one line in the group it belongs to (eventlog/flags.py says how).
"""

from __future__ import annotations

from eventlog.connect import NAMESPACE, NATS_SECURITY
from eventlog.events import Role
from eventlog.flags import Group, Option, find
from workers.scheduler import EngineConfig

_ENGINE = EngineConfig()
ROLES = tuple(Role)

PROCESS = Group(
    "worker",
    Option("worker-id",
           help="id on the KV stream and in routing decisions (default: w-<random>)"),
    Option("host", default="127.0.0.1", help="listen address"),
    Option("port", int, 8000, "listen port; 0 picks a free one"),
    Option("advertise-url", help="URL routers should use (default http://HOST:PORT)"),
    Option("model", default="jetrouter-sim", help="served model name"),
    Option("role", default=Role.BOTH, choices=ROLES,
           help="disaggregated serving: a prefill engine computes prompts and hands their KV "
                "blocks over (POST /v1/prefill), a decode engine receives them and generates; "
                "both does everything"),
    Option("model-path", help="HuggingFace model folder (tokenizer.json, tokenizer_config.json): "
                              "tokenize prompts and chat like the router given the same folder "
                              "(default: one token per UTF-8 byte)"),
    Option("nats-url", default="",
           help="NATS server for KV events and load gauges; empty = no events"),
    NAMESPACE,
    Option("shutdown-timeout", float, 30.0,
           "seconds in-flight requests get to finish after SIGTERM"),
    Option("log-level", default="warning", choices=("debug", "info", "warning", "error")),
)

ENGINE_MODEL = Group(
    "engine model",
    Option("num-gpu-blocks", int, _ENGINE.num_gpu_blocks, "KV cache blocks"),
    Option("kv-cache-block-size", int, _ENGINE.block_size,
           "tokens per KV block; must match the router"),
    Option("max-num-seqs", int, _ENGINE.max_num_seqs, "max running requests"),
    Option("max-num-batched-tokens", int, _ENGINE.max_num_batched_tokens,
           "token budget per step, chunked prefill"),
    Option("prefill-ms-per-token", float, _ENGINE.prefill_ms_per_token,
           "prefill cost per uncached prompt token"),
    Option("decode-ms-base", float, _ENGINE.decode_ms_base, "fixed cost of every step"),
    Option("decode-ms-per-seq", float, _ENGINE.decode_ms_per_seq,
           "extra step cost per decoding request"),
    Option("speedup-ratio", float, _ENGINE.speedup_ratio, "divide every simulated time by this"),
    Option("transfer-ms-per-block", float, _ENGINE.transfer_ms_per_block,
           "cost of receiving one KV block from a prefill engine (disaggregated serving)",
           at_least=0),
    Option("dp-size", int, 1, "data-parallel ranks, each an independent engine"),
    Option("default-max-tokens", int, 256,
           "max_tokens of chat requests that give none (completions default to 16 like OpenAI)"),
)

WORKER = (PROCESS, ENGINE_MODEL, NATS_SECURITY)
"""Every option of `jetrouter worker`, in the order `--help` shows them."""


def option(name: str) -> Option:
    """The `worker` option named ``name`` (without dashes)."""
    return find(WORKER, name)
