"""The jetrouter services of a compose file: every ``jetrouter <verb> ...`` command line through
the real CLI parser with the service's own ``JETROUTER_*`` environment, and what each verb needs
(a replica id, a reachable host, a bridge pointing at its engine's ports, one block size)."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import os
import re
from collections.abc import Iterator, Mapping
from urllib.parse import urlsplit

from cluster.checkconfig.compose import HEALTH_PATHS, ComposeFile, Service

ANY_HOST = ("0.0.0.0", "::", "")
_SECRET_FLAG = re.compile(r"--[\w-]*(token|password|secret)[\w-]*")


def engine_flags(argv: list[str]) -> dict[str, str]:
    """``--flag value`` / ``--flag=value`` pairs of an engine's command (a bare flag maps to "")."""
    out: dict[str, str] = {}
    i = 0
    while i < len(argv):
        word = argv[i]
        if word.startswith("--"):
            if "=" in word:
                key, value = word.split("=", 1)
                out[key] = value
            elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                out[word] = argv[i + 1]
                i += 1
            else:
                out[word] = ""
        i += 1
    return out


def _masked(argv: list[str]) -> str:
    """The command line for a problem message, values of secret flags replaced by ***."""
    shown: list[str] = []
    hide_next = False
    for word in argv:
        flag, eq, _ = word.partition("=")
        secret = _SECRET_FLAG.fullmatch(flag) is not None
        shown.append("***" if hide_next else f"{flag}=***" if secret and eq else word)
        hide_next = secret and not eq
    return " ".join(shown)


@contextlib.contextmanager
def _jetrouter_env(env: Mapping[str, str]) -> Iterator[None]:
    """Only the service's own JETROUTER_* variables, as inside its container."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("JETROUTER_")}
    for k in saved:
        del os.environ[k]
    os.environ.update(env)
    try:
        yield
    finally:
        for k in env:
            os.environ.pop(k, None)
        os.environ.update(saved)


class JetrouterChecks(ComposeFile):
    def check_jetrouter(self, svc: Service) -> None:
        from api.cli import VERBS, build_parser, env_name
        where = f"service {svc.name}"
        if not svc.argv or svc.argv[0] not in VERBS:
            self.problem(where, f"`jetrouter {' '.join(svc.argv)}` has no known verb")
            return
        svc.verb = verb = svc.argv[0]
        env = self.environment(svc)
        err = io.StringIO()
        try:
            with _jetrouter_env(env), contextlib.redirect_stderr(err):
                parser = build_parser([verb])
                svc.args = parser.parse_args(svc.argv)
                module = importlib.import_module(svc.args._module)
                # The verb's own post-parse validation, without starting anything.
                for hook in ("check_args", "build_config", "settings_from_args"):
                    if callable(getattr(module, hook, None)):
                        getattr(module, hook)(svc.args)
                        break
        except (SystemExit, ValueError, argparse.ArgumentTypeError) as exc:
            lines = [ln for ln in err.getvalue().splitlines() if ln.strip()]
            detail = lines[-1] if lines else str(exc)
            self.problem(where, f"`jetrouter {_masked(svc.argv)}` is rejected: {detail}")
            svc.args = None
            return
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        known = {env_name(o) for a in sub.choices[verb]._actions for o in a.option_strings
                 if o.startswith("--")}
        for var in sorted(set(env) - known):
            self.problem(where, f"environment {var} matches no `jetrouter {verb}` flag")
        args = svc.args
        svc.ports = {args.port} if verb in HEALTH_PATHS else set()
        if verb in HEALTH_PATHS and args.host not in ANY_HOST:
            self.problem(where, f"--host {args.host} is unreachable from other containers; "
                         "use 0.0.0.0")
        if verb == "serve" and not args.replica_id:
            self.problem(where, "no --replica-id: each restart would join as a new replica")
        if verb == "serve" and args.admin_token is not None and (
                args.admin_token not in self.required.values()):
            self.problem(where, "the admin token has a fixed or default value (anyone who reads "
                         "this file can reset the cluster): use ${JETROUTER_ADMIN_TOKEN:?...}")
        if verb == "worker":
            url = urlsplit(args.advertise_url or "")
            names = {svc.name, svc.spec.get("hostname"), svc.spec.get("container_name")}
            if url.hostname not in names or url.port != args.port:
                self.problem(where, f"--advertise-url {args.advertise_url!r} should be "
                             f"http://{svc.name}:{args.port}")

    def check_bridge(self, svc: Service) -> None:
        """A bridge names an engine service of this file: its OpenAI port, its ZMQ KV-event and
        replay ports (from the engine's --kv-events-config), the same block size, and a profile
        that starts together with it."""
        where = f"service {svc.name}"
        args = svc.args
        url = urlsplit(args.engine_url)
        engine = self.services.get(url.hostname or "")
        if engine is None:
            self.problem(where, f"--engine-url {args.engine_url} names no service")
            return
        flags = engine_flags(engine.argv)
        if (url.port or 80) != int(flags.get("--port", "8000")):
            self.problem(where, f"--engine-url {args.engine_url}: {engine.name} serves on "
                         f"{flags.get('--port', '8000')}")
        if "--enable-prefix-caching" not in flags:
            self.problem(f"service {engine.name}", "no --enable-prefix-caching: the engine "
                         "reuses nothing, so KV-aware routing cannot help")
        try:
            config = json.loads(flags.get("--kv-events-config", "{}"))
        except json.JSONDecodeError as exc:
            self.problem(f"service {engine.name}", f"--kv-events-config is not JSON: {exc}")
            return
        if not config.get("enable_kv_cache_events"):
            self.problem(f"service {engine.name}", "KV events are off (--kv-events-config "
                         "enable_kv_cache_events)")
        for flag, key in (("--kv-events", "endpoint"), ("--kv-replay", "replay_endpoint")):
            mine = urlsplit(getattr(args, flag[2:].replace("-", "_")) or "")
            theirs = urlsplit(str(config.get(key) or "").replace("*", "0.0.0.0"))
            if mine.hostname and mine.hostname != engine.name:
                self.problem(where, f"{flag} names {mine.hostname}, not {engine.name}")
            elif mine.port is not None and mine.port != theirs.port:
                self.problem(where, f"{flag} port {mine.port}, but {engine.name} binds "
                             f"{config.get(key) or 'nothing'}")
        engine_block = flags.get("--block-size")
        if args.block_size is not None and engine_block and int(engine_block) != args.block_size:
            self.problem(where, f"--block-size {args.block_size}, but {engine.name} runs "
                         f"--block-size {engine_block}")
        if set(engine.spec.get("profiles") or []) != set(svc.spec.get("profiles") or []):
            self.problem(where, f"profiles differ from {engine.name}'s")
        if args.role != "both" and "vllm" in str(engine.spec.get("image", "")):
            self.check_vllm_handoff(engine, flags, args.role)

    def check_vllm_handoff(self, engine: Service, flags: dict[str, str], role: str) -> None:
        """A vLLM engine registered as prefill or decode: routers hand its KV over with vLLM's
        kv_transfer_params, which needs a KV connector; NixlConnector's handshake must listen
        where the other engine reaches it (its service name, not the default localhost) on a
        port no other engine of this file uses (engines sharing a host network would clash)."""
        where = f"service {engine.name}"
        try:
            connector = json.loads(flags.get("--kv-transfer-config") or "{}").get("kv_connector")
        except (json.JSONDecodeError, AttributeError) as exc:
            self.problem(where, f"--kv-transfer-config is not a JSON object: {exc}")
            return
        if not connector:
            self.problem(where, f"registered as {role} but no --kv-transfer-config "
                         "kv_connector: every hand-off would fall back to aggregated serving")
        if connector != "NixlConnector":
            return
        env = engine.spec.get("environment") or {}
        env = env if isinstance(env, dict) else dict(e.split("=", 1) for e in env if "=" in e)
        host, port = env.get("VLLM_NIXL_SIDE_CHANNEL_HOST"), env.get("VLLM_NIXL_SIDE_CHANNEL_PORT")
        if host != engine.name:
            self.problem(where, f"VLLM_NIXL_SIDE_CHANNEL_HOST is {host or 'unset (localhost)'}: "
                         f"the other engine must reach this one's NIXL handshake at {engine.name}")
        other = self.nixl_ports.setdefault(str(port), engine.name)
        if port is None or other != engine.name:
            self.problem(where, f"VLLM_NIXL_SIDE_CHANNEL_PORT {port or 'unset'}"
                         + (f" is also {other}'s" if port is not None else "")
                         + ": each engine needs a port of its own")

    def check_ids_and_block_sizes(self) -> None:
        for verb, attr in (("serve", "replica_id"), ("worker", "worker_id")):
            ids = [getattr(s.args, attr) for s in self.by_verb(verb).values() if s.args]
            if len(set(ids)) < len(ids):
                self.problem(self.path.name, f"`jetrouter {verb}` services share a {attr}")
        sizes = {s.args.kv_cache_block_size for s in self.services.values() if s.args is not None
                 and s.verb in HEALTH_PATHS}
        sizes |= {s.args.block_size for s in self.by_verb("bridge").values()
                  if s.args is not None and s.args.block_size is not None}
        if len(sizes) > 1:
            self.problem(self.path.name, f"--kv-cache-block-size differs: {sorted(sizes)}")
