"""Dynamo's flag names parse to the same settings as ours (the serve replica, the simulated
engine, `jetrouter up`)."""

from __future__ import annotations

import argparse

from api import serve
from cluster import up
from workers import cli as worker_cli


def parse(add: object, argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add(p)  # type: ignore[operator]
    return p.parse_args(argv)


def test_frontend_flags() -> None:
    args = parse(serve.add_arguments, [
        "--router-mode", "kv", "--http-port", "8123", "--http-host", "0.0.0.0",
        "--router-replica-sync", "--router-durable-kv-events", "--router-event-threads", "4",
        "--router-block-size", "32", "--no-router-track-active-blocks",
        "--no-router-track-prefill-tokens", "--no-router-assume-kv-reuse"])
    assert (args.port, args.host) == (8123, "0.0.0.0")
    config = serve.build_config(args)
    assert config.state.block_size == 32 and config.routing.block_size == 32
    r = config.routing
    assert (r.track_active_blocks, r.track_prefill_tokens, config.assume_kv_reuse) == (False,) * 3
    default = serve.build_config(parse(serve.add_arguments, ["--router-track-prefill-tokens"]))
    d = default.routing
    assert (d.track_active_blocks, d.track_prefill_tokens, default.assume_kv_reuse) == (True,) * 3


def test_mocker_flags() -> None:
    args = parse(worker_cli.add_arguments, ["--num-gpu-blocks-override", "777", "--block-size",
                                            "32", "--served-model-name", "llama"])
    settings = worker_cli.settings_from_args(args)
    assert settings.engine.num_gpu_blocks == 777 and settings.engine.block_size == 32
    assert settings.model == "llama"


def test_up_served_model_name_reaches_the_workers_and_the_banner() -> None:
    args = parse(up.add_arguments, ["--served-model-name", "llama"])
    _, worker_args = up.forwarded_args(args)
    assert up.served_model(worker_args) == "llama"
    assert up.served_model(["--model=m2"]) == "m2"
    assert up.served_model([]) == up.DEFAULT_MODEL


def test_switches_from_the_environment(monkeypatch: object) -> None:
    from api.cli import build_parser

    for name in ("JETROUTER_NO_ROUTER_TRACK_PREFILL_TOKENS", "JETROUTER_NO_ROUTER_ASSUME_KV_REUSE",
                 "JETROUTER_NO_ROUTER_TRACK_ACTIVE_BLOCKS", "JETROUTER_PORT"):
        monkeypatch.setenv(name, "1" if "PORT" not in name else "8765")  # type: ignore[attr-defined]
    args = build_parser(["serve"]).parse_args(["serve"])
    config = serve.build_config(args)
    r = config.routing
    assert (r.track_active_blocks, r.track_prefill_tokens, config.assume_kv_reuse) == (False,) * 3
    assert args.port == 8765  # an alias (--http-port) shares its option's variable
