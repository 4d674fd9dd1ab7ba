"""`jetrouter worker`: run one simulated inference engine (flags named as in vLLM / Dynamo)."""

from __future__ import annotations

import argparse
import logging
import sys
import uuid

from eventlog.connect import (
    NatsConnectFatal,
    add_nats_arguments,
    check_connect_sync,
    check_files,
    options_from_args,
)
from eventlog.model_tokenizer import load_codec
from eventlog.names import check_token
from workers.scheduler import EngineConfig
from workers.server import WorkerSettings, serve

_DEFAULTS = EngineConfig()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--worker-id", default=None,
                   help="id on the KV stream and in routing decisions (default: w-<random>)")
    p.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="listen port; 0 picks a free one")
    p.add_argument("--advertise-url", default=None,
                   help="URL routers should use (default http://HOST:PORT)")
    p.add_argument("--model", "--served-model-name", dest="model", default="jetrouter-sim",
                   help="served model name")
    p.add_argument("--model-path", default=None,
                   help="HuggingFace model folder (tokenizer.json, tokenizer_config.json): "
                        "tokenize prompts and chat like the router given the same folder "
                        "(default: one token per UTF-8 byte)")
    p.add_argument("--nats-url", default="",
                   help="NATS server for KV events and load gauges; empty = no events")
    p.add_argument("--namespace", default="jr", help="stream/subject namespace (default jr)")
    g = p.add_argument_group("engine model")
    # --num-gpu-blocks-override / --block-size: the names Dynamo's mocker engine uses.
    g.add_argument("--num-gpu-blocks", "--num-gpu-blocks-override", dest="num_gpu_blocks",
                   type=int, default=_DEFAULTS.num_gpu_blocks,
                   help=f"KV cache blocks (default {_DEFAULTS.num_gpu_blocks})")
    g.add_argument("--kv-cache-block-size", "--block-size", dest="kv_cache_block_size",
                   type=int, default=_DEFAULTS.block_size,
                   help=f"tokens per KV block; must match the router (default "
                        f"{_DEFAULTS.block_size})")
    g.add_argument("--max-num-seqs", type=int, default=_DEFAULTS.max_num_seqs,
                   help=f"max running requests (default {_DEFAULTS.max_num_seqs})")
    g.add_argument("--max-num-batched-tokens", type=int,
                   default=_DEFAULTS.max_num_batched_tokens,
                   help=f"token budget per step, chunked prefill "
                        f"(default {_DEFAULTS.max_num_batched_tokens})")
    g.add_argument("--prefill-ms-per-token", type=float, default=_DEFAULTS.prefill_ms_per_token,
                   help=f"prefill cost per uncached prompt token "
                        f"(default {_DEFAULTS.prefill_ms_per_token})")
    g.add_argument("--decode-ms-base", type=float, default=_DEFAULTS.decode_ms_base,
                   help=f"fixed cost of every step (default {_DEFAULTS.decode_ms_base})")
    g.add_argument("--decode-ms-per-seq", type=float, default=_DEFAULTS.decode_ms_per_seq,
                   help=f"extra step cost per decoding request "
                        f"(default {_DEFAULTS.decode_ms_per_seq})")
    g.add_argument("--speedup-ratio", type=float, default=_DEFAULTS.speedup_ratio,
                   help="divide every simulated time by this (default 1.0)")
    g.add_argument("--dp-size", type=int, default=1,
                   help="data-parallel ranks, each an independent engine (default 1)")
    g.add_argument("--default-max-tokens", type=int, default=256,
                   help="max_tokens of chat requests that give none (default 256; "
                        "completions default to 16 like OpenAI)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM (default 30)")
    p.add_argument("--log-level", default="warning",
                   choices=["debug", "info", "warning", "error"], help="(default warning)")
    add_nats_arguments(p)


def settings_from_args(args: argparse.Namespace) -> WorkerSettings:
    engine = EngineConfig(
        num_gpu_blocks=args.num_gpu_blocks,
        block_size=args.kv_cache_block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        prefill_ms_per_token=args.prefill_ms_per_token,
        decode_ms_base=args.decode_ms_base,
        decode_ms_per_seq=args.decode_ms_per_seq,
        speedup_ratio=args.speedup_ratio,
    )
    return WorkerSettings(
        worker_id=args.worker_id or f"w-{uuid.uuid4().hex[:8]}",
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
    except (ValueError, NatsConnectFatal) as exc:
        print(f"jetrouter worker: error: {exc}", file=sys.stderr)
        return 2
    return serve(settings)
