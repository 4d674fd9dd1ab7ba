"""`jetrouter up`: a whole local cluster in one command (design.md §10).

An embedded nats-server with JetStream (or an existing NATS via ``--nats-url``), N router replicas
(`jetrouter serve`) and M simulated engines (`jetrouter worker`) as child processes, each logging
to ``<data-dir>/logs/<name>.log``. A child that dies is restarted with exponential backoff unless
``--no-restart``. ``<data-dir>/cluster.json`` always describes the running cluster (URLs, pids,
admin token), so scripts and tests can find it. Ctrl-C / SIGTERM stops the children first, then
nats-server, and exits 0.

This module is the verb: its options, what it forwards to the children, the banner. The cluster
itself is `launch.local_cluster.LocalCluster`, which the bench, the demos and the chaos harness
start too.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from api.config import SERVE
from eventlog.connect import NAMESPACE, NATS_SECURITY, NatsOptions, options_from_args
from launch.local_cluster import ClusterStartError, LocalCluster, check_model_path
from natsops import server as nats_server
from natsops.pki import CertificateNotMade
from settings.flags import Group, Option, add_options, find, forward_argv, options_of, unset
from workers.config import WORKER

log = logging.getLogger("jetrouter.up")

DEFAULT_MODEL = "jetrouter-sim"


UP = Group(
    "cluster",
    Option("replicas", int, 2, "router replicas", at_least=1),
    Option("workers", int, help="simulated workers (default 4, or 0 with --prefill-workers/"
                                "--decode-workers; 0: real engines only, via bridges)",
           at_least=0),
    Option("prefill-workers", int, 0,
           "disaggregated serving: simulated prefill engines p0.. (--role prefill)", at_least=0),
    Option("decode-workers", int, 0,
           "disaggregated serving: simulated decode engines d0.. (--role decode)", at_least=0),
    Option("base-port", int, 8000, "first replica port; 0 = free ports", at_least=0),
    Option("data-dir", Path, Path(".jetrouter"),
           "logs, nats store, replica data, cluster.json"),
    Option("nats-url", help="use this NATS (JetStream enabled) instead of an embedded "
                            "nats-server"),
    Option("nats-cluster", int, 1, "embedded nats-server cluster size (1 or 3)", at_least=1),
    NAMESPACE,
    Option("no-restart", bool, help="do not restart a replica or worker that dies"),
    Option("no-standby", bool, help="keep no pre-imported standby process (by default one waits "
                                    "to take a dead replica's place at once, without paying "
                                    "the start-up imports; ~90 MB of memory)"),
    Option("admin-token", help="admin bearer token (default: a fresh random one)"),
    Option("ready-timeout", float, 60.0, "seconds to wait for every child to be ready",
           above=0),
    Option("secure", bool, help="secure the embedded nats-server: TLS with a generated CA, one "
                                "user per replica/engine with only the subjects its role needs, "
                                "an admin user; files under <data-dir>/secure/"),
)

# `serve` / `worker` options `up` takes itself and hands to the children that have them; left
# out, each child keeps its own default. Forwarding another one is one more name here.
FORWARDED = ("router-mode", "kv-cache-block-size", "num-gpu-blocks", "speedup-ratio",
             "model",  # the engines' served model name (also --served-model-name)
             "otlp-traces-endpoint", "api-keys-file", "tenant-header", "router-queue-threshold",
             "no-tenant-fair-queue", "tenant-headroom")


def _names(groups: tuple[Group, ...]) -> set[str]:
    return {o.name for o in options_of(groups)}


def _forwarded_option(name: str) -> Option:
    to = [who for who, groups in (("replicas", SERVE), ("workers", WORKER))
          if name in _names(groups)]
    if not to:
        raise KeyError(f"{name}: neither a `serve` nor a `worker` option")
    source = find(SERVE, name) if "replicas" in to else find(WORKER, name)
    return unset(source, help=f"{' and '.join(to)}: {source.help}")


CHILDREN = Group(
    "forwarded to the children",
    *(_forwarded_option(name) for name in FORWARDED),
    Option("router-arg", repeat=True, metavar="ARG",
           help="extra raw argument for every replica (repeatable)"),
    Option("worker-arg", repeat=True, metavar="ARG",
           help="extra raw argument for every worker (repeatable)"),
    Option("model-path", help="replicas and workers: one HuggingFace model folder "
                              "(tokenizer.json, tokenizer_config.json) so both tokenize alike "
                              "(default: byte tokens)"),
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = (
        "Ports: replicas listen on BASE..BASE+N-1, workers on BASE+100..; --base-port 0 picks\n"
        "free ports. <data-dir>/cluster.json lists URLs, pids and the admin token (also in\n"
        "<data-dir>/admin-token); logs go to <data-dir>/logs/<name>.log. Other flags reach the\n"
        "children with --router-arg=--flag=value / --worker-arg=--flag=value (repeatable).\n"
        "Every flag can also be set as JETROUTER_<FLAG>, e.g. JETROUTER_REPLICAS=3.")
    # NATS security: credentials/TLS of an existing NATS (--nats-url), for every child.
    add_options(p, (UP, NATS_SECURITY, CHILDREN))


TO_REPLICAS = [o for o in CHILDREN.options if o.name in FORWARDED and o.name in _names(SERVE)]
TO_WORKERS = [o for o in CHILDREN.options if o.name in FORWARDED and o.name in _names(WORKER)]


def forwarded_args(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """(router_args, worker_args) from the forwarding flags; unset flags are left to the child."""
    return (forward_argv(args, TO_REPLICAS) + list(args.router_arg),
            forward_argv(args, TO_WORKERS) + list(args.worker_arg))


def served_model(worker_args: Sequence[str]) -> str:
    """The model name the workers serve: the last --model / --served-model-name among their
    arguments (how --served-model-name and --worker-arg=--model=... both reach them)."""
    name = DEFAULT_MODEL
    args = list(worker_args)
    for i, arg in enumerate(args):
        for flag in ("--model", "--served-model-name"):
            if arg == flag and i + 1 < len(args):
                name = args[i + 1]
            elif arg.startswith(flag + "="):
                name = arg.split("=", 1)[1]
    return name


def _plain_workers(args: argparse.Namespace) -> int:
    if args.workers is not None:
        return int(args.workers)
    return 0 if args.prefill_workers or args.decode_workers else 4


def banner(cluster: LocalCluster) -> str:
    url = cluster.router_urls[0]
    model = served_model(cluster.worker_args)
    token = cluster.admin_token_path
    lines = [
        "jetrouter cluster is up",
        f"  routers : {' '.join(cluster.router_urls)}",
        f"  workers : {' '.join(cluster.worker_urls)}",
        f"  model   : {model}",
        *([f"  roles   : disaggregated serving, "
           f"{', '.join(f'{n} {r}' for n, r in sorted(cluster._roles.items()))}"]
          if cluster._roles else []),
        f"  nats    : {cluster.nats_url}  (namespace {cluster.namespace})",
        *([f"  secured : TLS CA {cluster.secure_setup.ca_file}; users' password files in "
           f"{cluster.secure_setup.directory / 'users'} (admin: admin.password); server "
           f"config {cluster.secure_setup.config_file}"] if cluster.secure_setup else []),
        f"  admin   : token in {token} (and {cluster.cluster_json_path})",
        f"  logs    : {cluster.data_dir / 'logs'}",
        "try:",
        f"  curl -s {url}/v1/completions -H 'content-type: application/json' \\",
        f"    -d '{{\"model\": \"{model}\", \"prompt\": \"Hello\", \"max_tokens\": 16}}'",
        f"  curl -s -H \"Authorization: Bearer $(cat {token})\" {url}/admin/state",
        f"  OPENAI_BASE_URL={url}/v1 OPENAI_API_KEY=unused python -c \"import openai; "
        f"print(openai.OpenAI().completions.create(model='{model}', prompt='Hi', "
        "max_tokens=8).choices[0].text)\"",
        "Ctrl-C stops everything.",
    ]
    return "\n".join(lines)


async def _serve_until_signalled(cluster: LocalCluster) -> None:
    """Start the cluster, print the banner, run until SIGINT/SIGTERM (even mid start-up)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    starting = asyncio.create_task(cluster.start())
    stopping = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if starting.done():
            starting.result()  # start-up errors propagate
            print(banner(cluster), flush=True)
            await stopping
        log.info("stopping")
    finally:
        for task in (starting, stopping):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await cluster.stop()
        log.info("stopped")
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def run(args: argparse.Namespace) -> int:
    from api.cli import CliError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s up: %(message)s",
                        datefmt="%H:%M:%S")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # no line per readiness poll
    if args.api_keys_file:  # the replicas run in the repository root: give them the full path
        from api.tenancy import KeysFileInvalid, load_keys

        args.api_keys_file = str(Path(args.api_keys_file).resolve())
        try:
            load_keys(args.api_keys_file)
        except KeysFileInvalid as exc:
            raise CliError(str(exc)) from None
    router_args, worker_args = forwarded_args(args)
    check_model_path(args.model_path)
    if args.secure and args.nats_url:
        raise CliError("--secure sets up the embedded nats-server; for an existing NATS give "
                       "its credentials with the --nats-* flags instead")
    try:
        nats_options = options_from_args(args, url="")
    except ValueError as exc:
        raise CliError(str(exc)) from None
    try:
        cluster = _cluster_from_args(args, router_args, worker_args, nats_options)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    try:
        asyncio.run(_serve_until_signalled(cluster))
    except nats_server.NatsServerNotFound as exc:
        raise CliError(str(exc)) from None
    except CertificateNotMade as exc:
        raise CliError(f"--secure: {exc}") from None
    except ClusterStartError as exc:
        print(f"jetrouter up: error: {exc}", file=sys.stderr)
        return 1
    return 0


def _cluster_from_args(args: argparse.Namespace, router_args: list[str], worker_args: list[str],
                       nats_options: NatsOptions) -> LocalCluster:
    return LocalCluster(
        replicas=args.replicas, workers=_plain_workers(args),
        prefill_workers=args.prefill_workers, decode_workers=args.decode_workers,
        base_port=args.base_port or None,
        data_dir=args.data_dir, router_args=router_args, worker_args=worker_args,
        nats_url=args.nats_url, restart=not args.no_restart, namespace=args.namespace,
        standby=not args.no_standby,
        nats_cluster=args.nats_cluster, admin_token=args.admin_token,
        ready_timeout=args.ready_timeout, model_path=args.model_path, secure=args.secure,
        nats_options=nats_options)
