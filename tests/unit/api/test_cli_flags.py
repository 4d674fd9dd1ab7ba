"""The flag registry (settings/flags.py) and the one CLI error path (api/cli.py): every verb
refuses a bad flag or a bad JETROUTER_* value with one line and exit status 2, `--help` lists
every declared option with its variable, and the typed configs take the declared defaults."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import pytest

from api import config as router_config
from api.cli import build_parser, main
from api.forward import Forwarder
from api.metrics import RouterMetrics
from cluster import up
from eventlog.connect import NATS_SECURITY
from settings.flags import (
    CliError,
    Group,
    OneLineParser,
    Option,
    add_options,
    build,
    defaults,
    forward_argv,
    options_of,
)
from workers.bridge.config import BRIDGE
from workers.config import WORKER

VERB_OPTIONS: dict[str, tuple[Group, ...]] = {
    "serve": router_config.SERVE,
    "worker": WORKER,
    "bridge": BRIDGE,
    "up": (up.UP, NATS_SECURITY, up.CHILDREN),
}
BRIDGE_OK = ["--engine-url", "http://e:8000", "--kv-events", "tcp://e:5557", "--worker-id", "w1"]


def run_cli(argv: Sequence[str]) -> int:
    try:
        return main(list(argv))
    except SystemExit as exc:  # argparse's own exit
        return int(exc.code or 0)


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the variables a case sets: the caller's JETROUTER_* must not leak in."""
    import os

    for name in list(os.environ):
        if name.startswith("JETROUTER_"):
            monkeypatch.delenv(name)


BAD = [
    # (argv, environment, what the one line must say)
    (["serve", "--port", "eighty"], {}, "argument --port/--http-port: not a valid int: 'eighty'"),
    (["serve", "--router-mode", "sticky"], {}, "--router-mode"),
    (["serve", "--router-queue-threshold", "0"], {}, "must be positive, got 0"),
    (["serve", "--router-prune-target-ratio", "1.5"], {}, "must be >= 0 and <= 1, got 1.5"),
    (["serve", "--no-such-flag"], {}, "unrecognized arguments: --no-such-flag"),
    (["serve", "--decision-candidates", "-1"], {}, "expected a count >= 0 or 'all'"),
    (["serve"], {"JETROUTER_DECISION_CANDIDATES": "some"},
     "environment variable JETROUTER_DECISION_CANDIDATES='some'"),
    (["serve"], {"JETROUTER_MIGRATION_LIMIT": "many"},
     "environment variable JETROUTER_MIGRATION_LIMIT='many': not a valid int"),
    (["serve"], {"JETROUTER_STREAM_IDLE_TIMEOUT": "-1"},
     "environment variable JETROUTER_STREAM_IDLE_TIMEOUT='-1': must be positive"),
    (["serve"], {"JETROUTER_NO_ROUTER_KV_EVENTS": "perhaps"},
     "environment variable JETROUTER_NO_ROUTER_KV_EVENTS='perhaps': not a boolean"),
    (["worker", "--num-gpu-blocks", "x"], {}, "argument --num-gpu-blocks"),
    (["worker", "--worker-id", "a.b"], {}, "worker id"),
    (["worker", "--dp-size", "0"], {}, "--dp-size must be at least 1"),
    (["worker", "--engines", "0"], {}, "argument --engines: must be >= 1, got 0"),
    (["worker", "--engines", "2", "--advertise-url", "http://e:8000"], {},
     "--advertise-url names one engine"),
    (["worker"], {"JETROUTER_LOG_LEVEL": "loud"},
     "environment variable JETROUTER_LOG_LEVEL='loud': not one of"),
    (["bridge"], {}, "the following arguments are required: --engine-url"),
    (["bridge", *BRIDGE_OK, "--block-size", "0"], {}, "must be positive"),
    (["bridge", *BRIDGE_OK[2:], "--engine-url", "e:8000"], {}, "must start with http://"),
    (["bridge", *BRIDGE_OK], {"JETROUTER_LOAD_INTERVAL": "soon"},
     "environment variable JETROUTER_LOAD_INTERVAL='soon'"),
    (["up", "--replicas", "0"], {}, "argument --replicas: must be >= 1, got 0"),
    (["up", "--kv-cache-block-size", "0"], {}, "argument --kv-cache-block-size"),
    (["up", "--secure", "--nats-url", "nats://x:4222"], {}, "--secure sets up"),
    (["up"], {"JETROUTER_WORKERS": "-1"},
     "environment variable JETROUTER_WORKERS='-1': must be >= 0"),
    (["admin", "state"], {"JETROUTER_TIMEOUT": "later"},
     "environment variable JETROUTER_TIMEOUT='later'"),
    (["bench", "core", "--samples", "x"], {}, "argument --samples"),
]


@pytest.mark.parametrize(("argv", "env", "needle"), BAD,
                         ids=[" ".join(a) + "".join(f" {k}" for k in e) for a, e, _ in BAD])
def test_a_user_error_is_one_line_and_exit_2(argv: list[str], env: dict[str, str], needle: str,
                                             monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert run_cli(argv) == 2
    captured = capsys.readouterr()
    lines = [ln for ln in captured.err.splitlines() if ln.strip()]
    assert len(lines) == 1, captured.err
    # `jetrouter VERB: error: ...` (a sub-verb's parser names it too: `jetrouter bench core`)
    assert lines[0].startswith(f"jetrouter {argv[0]}"), lines[0]
    assert ": error: " in lines[0], lines[0]
    assert needle in lines[0], lines[0]
    assert captured.out == ""


@pytest.mark.parametrize("verb", sorted(VERB_OPTIONS))
def test_help_lists_every_declared_option_with_its_variable(
        verb: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli([verb, "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    options = [o for o in options_of(VERB_OPTIONS[verb]) if not o.hidden]
    assert options
    for option in options:
        assert option.flag in text, option.flag
        assert f"[env {option.env_var}]" in text, option.env_var


def test_every_declared_option_reaches_the_parser_once() -> None:
    for verb, groups in VERB_OPTIONS.items():
        args = vars(build_parser([verb]).parse_args([verb, *(BRIDGE_OK if verb == "bridge"
                                                              else [])]))
        keys = [o.key for o in options_of(groups)]
        assert len(keys) == len(set(keys)), verb
        assert set(keys) <= set(args), verb


def test_variables_set_defaults_and_flags_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JETROUTER_ROUTER_MODE", "random")
    monkeypatch.setenv("JETROUTER_NO_ROUTER_KV_EVENTS", "1")
    monkeypatch.setenv("JETROUTER_BUSY_THRESHOLD_REQUIRES_ADMIN", "yes")
    args = build_parser(["serve"]).parse_args(["serve"])
    assert (args.router_mode, args.router_kv_events, args.busy_threshold_requires_admin) == (
        "random", False, True)
    args = build_parser(["serve"]).parse_args(["serve", "--router-mode", "kv"])
    assert args.router_mode == "kv"


def test_decision_candidates_takes_a_count_or_all(monkeypatch: pytest.MonkeyPatch) -> None:
    from replicas.runtime.config import ReplicaConfig

    parse = build_parser(["serve"]).parse_args
    assert parse(["serve"]).decision_candidates == ReplicaConfig("r", "nats://x") \
        .decision_candidates == 8
    assert parse(["serve", "--decision-candidates", "all"]).decision_candidates == 0
    assert parse(["serve", "--decision-candidates", "16"]).decision_candidates == 16
    monkeypatch.setenv("JETROUTER_DECISION_CANDIDATES", "ALL")
    assert build_parser(["serve"]).parse_args(["serve"]).decision_candidates == 0


def test_the_routing_defaults_are_the_cli_ones_everywhere() -> None:
    values = router_config.serve_defaults(environ={})
    routing = router_config.routing_config(values)
    assert (routing.kv_overlap_score_weight, routing.prefill_queue_weight) == (8.0, 1.0)
    parsed = build_parser(["serve"]).parse_args(["serve"])
    assert router_config.routing_config(parsed) == routing
    from api.app import AppConfig

    assert AppConfig().stream_idle_timeout == router_config.option("stream-idle-timeout").default
    assert AppConfig().migration_limit == parsed.migration_limit


def test_the_forwarder_takes_its_defaults_through_the_registry(
        monkeypatch: pytest.MonkeyPatch) -> None:
    fw = Forwarder(None, RouterMetrics())  # type: ignore[arg-type]
    assert (fw.stream_idle_timeout, fw.migration_limit) == (30.0, 3)
    monkeypatch.setenv("JETROUTER_MIGRATION_LIMIT", "-2")
    with pytest.raises(CliError, match="JETROUTER_MIGRATION_LIMIT='-2': must be >= 0"):
        Forwarder(None, RouterMetrics())  # type: ignore[arg-type]


def test_up_forwards_what_the_registry_says() -> None:
    args = build_parser(["up"]).parse_args(["up", "--router-mode", "random",
                                            "--kv-cache-block-size", "32",
                                            "--num-gpu-blocks", "64", "--router-arg=--seed=1"])
    router, worker = up.forwarded_args(args)
    assert router == ["--router-mode=random", "--kv-cache-block-size=32", "--seed=1"]
    assert worker == ["--kv-cache-block-size=32", "--num-gpu-blocks=64"]
    assert up.forwarded_args(build_parser(["up"]).parse_args(["up"])) == ([], [])
    # Each forwarded option is the child's own declaration, not a copy with its own default.
    for option in up.TO_REPLICAS:
        assert router_config.option(option.name).type is option.type


def test_up_forwards_the_tenant_flags_to_its_replicas() -> None:
    args = build_parser(["up"]).parse_args(["up", "--api-keys-file", "/k.yaml", "--tenant-header",
                                            "x-tenant-id", "--no-tenant-fair-queue",
                                            "--router-queue-threshold", "0.5",
                                            "--tenant-headroom", "0.25"])
    router, worker = up.forwarded_args(args)
    assert router == ["--api-keys-file=/k.yaml", "--tenant-header=x-tenant-id",
                      "--router-queue-threshold=0.5", "--no-tenant-fair-queue",
                      "--tenant-headroom=0.25"]
    assert worker == []


def test_an_option_and_an_alias_are_one_line_each() -> None:
    groups = (Group("g", Option("port", int, 8000, "listen port", above=0,
                                aliases=("--http-port",)),
                      Option("tag", repeat=True), Option("fast", bool)),)
    parser = OneLineParser(prog="t")
    add_options(parser, groups, environ={"JETROUTER_TAG": "a 'b c'"})
    assert parser.parse_args(["--http-port", "9"]).port == 9
    args = parser.parse_args(["--tag", "d", "--fast"])
    assert args.tag == ["a", "b c", "d"] and args.fast
    assert forward_argv(args, options_of(groups)) == ["--port=8000", "--tag=a", "--tag=b c",
                                                      "--tag=d", "--fast"]
    assert defaults(groups, environ={"JETROUTER_PORT": "7"}).port == 7
    with pytest.raises(CliError, match="JETROUTER_PORT='0': must be positive"):
        defaults(groups, environ={"JETROUTER_PORT": "0"})


def test_build_fills_a_dataclass_by_option_name() -> None:
    from workers.bridge.config import BridgeSettings

    args = build_parser(["bridge"]).parse_args(["bridge", *BRIDGE_OK, "--load-interval", "3"])
    settings = build(BridgeSettings, args)
    assert (settings.worker_id, settings.load_interval, settings.max_num_batched_tokens) == (
        "w1", 3.0, 8192)
    assert isinstance(args, argparse.Namespace)
