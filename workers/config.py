"""The simulated engine's options (`jetrouter worker`), each declared once (see settings/flags.py).

Names follow vLLM and Dynamo. The engine model's defaults are :class:`EngineConfig`'s own; the
router's `jetrouter up` forwards some of these to the workers it starts.
To add an option or an alias: one line in the group it belongs to (settings/flags.py says how).
"""

from __future__ import annotations

from eventlog.connect import NAMESPACE, NATS_SECURITY
from eventlog.events import Role
from settings.flags import Group, Option, find
from workers.perf_model import PERF_MODELS
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
    Option("model", default="jetrouter-sim", help="served model name",
           aliases=("--served-model-name",)),
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
    Option("engines", int, 1,
           "simulated engines in this one process, each a worker of its own: ids "
           "<worker-id><i>, ports PORT+0.. (workers/engine_host.py)", at_least=1),
    Option("engine-offset", int, 0,
           "with --engines: number the engines' worker ids from this", at_least=0),
)

ENGINE_MODEL = Group(
    "engine model",
    # --num-gpu-blocks-override / --block-size: the names Dynamo's mocker engine uses.
    Option("num-gpu-blocks", int, _ENGINE.num_gpu_blocks, "KV cache blocks",
           aliases=("--num-gpu-blocks-override",)),
    Option("kv-cache-block-size", int, _ENGINE.block_size,
           "tokens per KV block; must match the router", aliases=("--block-size",)),
    Option("max-num-seqs", int, _ENGINE.max_num_seqs, "max running requests"),
    Option("max-num-batched-tokens", int, _ENGINE.max_num_batched_tokens,
           "token budget per step, chunked prefill"),
    Option("perf-model", default=_ENGINE.perf_model, choices=PERF_MODELS,
           help="step-time model (workers/perf_model.py): polynomial = Dynamo's mocker (prefill "
                "4.21e-7*T^2 + 0.01518*T + 16.5 ms for T uncached tokens, decode "
                "-25.74*u^2 + 54.01*u + 5.74 ms at KV usage u); linear = the three constants "
                "below"),
    # The linear model's constants: None = its default, refused with the polynomial model.
    Option("prefill-ms-per-token", float, None,
           f"--perf-model linear: prefill cost per uncached prompt token "
           f"(default {_ENGINE.prefill_ms_per_token})", at_least=0),
    Option("decode-ms-base", float, None,
           f"--perf-model linear: fixed cost of every step (default {_ENGINE.decode_ms_base})",
           at_least=0),
    Option("decode-ms-per-seq", float, None,
           f"--perf-model linear: extra step cost per decoding request "
           f"(default {_ENGINE.decode_ms_per_seq})", at_least=0),
    Option("speedup-ratio", float, _ENGINE.speedup_ratio, "divide every simulated time by this"),
    Option("transfer-ms-per-block", float, _ENGINE.transfer_ms_per_block,
           "cost of receiving one KV block from a prefill engine (disaggregated serving)",
           at_least=0),
    Option("dp-size", int, 1, "data-parallel ranks, each an independent engine"),
    Option("default-max-tokens", int, 256,
           "max_tokens of chat requests that give none (completions default to 16 like OpenAI)"),
)

LINEAR_CONSTANTS = ("prefill_ms_per_token", "decode_ms_base", "decode_ms_per_seq")
WORKER = (PROCESS, ENGINE_MODEL, NATS_SECURITY)
"""Every option of `jetrouter worker`, in the order `--help` shows them."""


def option(name: str) -> Option:
    """The `worker` option named ``name`` (without dashes)."""
    return find(WORKER, name)
