"""Static check of compose.yaml and the deploy/ files it mounts: ``python -m cluster.checkconfig``.

No Docker engine runs in CI, so instead of starting the stack this finds what would break it:
every ``jetrouter <verb> ...`` command line goes through the real CLI parser (with the service's
``JETROUTER_*`` environment, as the container would see it); health checks, published ports, the
HAProxy backends, Prometheus targets and NATS routes must name services and the ports those
services listen on; ``depends_on`` targets and conditions, named volumes and bind-mounted files
must exist; the Dockerfile's ENTRYPOINT must be ``jetrouter``. ``check_compose`` returns one line
per problem (empty = consistent). PyYAML is needed to read the file; without it the CLI skips.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import os
import re
import shlex
import sys
import tomllib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from eventlog.errors import JetrouterError

DEPENDS_CONDITIONS = ("service_started", "service_healthy", "service_completed_successfully")
HEALTH_PATHS = {"serve": "/ready", "worker": "/health"}
LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1", "0.0.0.0")
ANY_HOST = ("0.0.0.0", "::", "")
# Metrics the dashboard may show before api/metrics.py exports them (the lead adds them).
PENDING_METRICS: set[str] = set()  # metrics the dashboard may name before they are exported
_VAR = re.compile(r"\$\$|\$\{([A-Za-z_]\w*)(?:(:?[-?+])([^}]*))?\}|\$([A-Za-z_]\w*)")
_SECRET_FLAG = re.compile(r"--[\w-]*(token|password|secret)[\w-]*")
_URL = re.compile(r"https?://(\[[^\]]+\]|[\w.\-]+)(?::(\d+))?(/[^\s'\"]*)?")


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


class YamlUnavailable(JetrouterError, RuntimeError):
    """PyYAML is not installed, so compose.yaml cannot be read."""


# --- parsers of the files compose.yaml refers to ----------------------------------------------

def dockerfile_instructions(text: str) -> dict[str, list[str]]:
    """ENTRYPOINT, CMD (exec or shell form) and USER of the Dockerfile's last stage."""
    found: dict[str, list[str]] = {}
    for line in re.sub(r"\\\n", " ", text).splitlines():
        word, _, rest = line.strip().partition(" ")
        word, rest = word.upper(), rest.strip()
        if word == "FROM":
            found = {}
        elif word in ("ENTRYPOINT", "CMD"):
            try:
                found[word] = [str(x) for x in json.loads(rest)]
            except json.JSONDecodeError:
                found[word] = ["/bin/sh", "-c", rest]
        elif word == "USER":
            found[word] = [rest.split(":")[0]]
    return found


def dockerfile_copied(text: str) -> set[str]:
    """Build-context paths the Dockerfile copies in (COPY/ADD without --from), every stage."""
    copied: set[str] = set()
    for line in re.sub(r"\\\n", " ", text).splitlines():
        word, _, rest = line.strip().partition(" ")
        if word.upper() not in ("COPY", "ADD"):
            continue
        words = rest.split()
        if any(w.startswith("--from") for w in words):
            continue                            # from another stage, not from the context
        rest = " ".join(w for w in words if not w.startswith("--"))
        try:
            args = [str(x) for x in json.loads(rest)] if rest.startswith("[") else rest.split()
        except json.JSONDecodeError:
            continue
        copied.update(a.strip("/").removeprefix("./") or "." for a in args[:-1])
    return copied


def pyproject_packages(path: Path) -> set[str]:
    """Top-level packages pyproject.toml's `[tool.setuptools.packages.find] include` ships."""
    try:
        doc = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return set()
    found = doc.get("tool", {}).get("setuptools", {}).get("packages", {}).get("find", {})
    return {p.split(".")[0].rstrip("*") for p in found.get("include", [])} - {""}


# nats-server's flags (2.10), from `nats-server --help`; the boolean ones take no value.
_NATS_BOOL = {"-js": "jetstream", "--jetstream": "jetstream", "-T": "logtime",
              "--logtime": "logtime", "--logtime_utc": "logtime_utc", "-s": "syslog",
              "--syslog": "syslog", "--tls": "tls", "--tlsverify": "tlsverify",
              "--no_advertise": "no_advertise", "-t": "test", "-sl": "signal", "-D": "debug",
              "--debug": "debug", "-V": "trace", "--trace": "trace", "-VV": "trace",
              "-DV": "trace", "-DVV": "trace"}
_NATS_VALUE = {"-a": "addr", "--addr": "addr", "-p": "port", "--port": "port", "-n": "server_name",
               "--name": "server_name", "--server_name": "server_name", "-P": "pid", "--pid": "pid",
               "-m": "http_port", "--http_port": "http_port", "-ms": "https_port",
               "-c": "config", "--config": "config", "--client_advertise": "client_advertise",
               "--ports_file_dir": "ports_file_dir", "-l": "log", "--log": "log",
               "-r": "remote_syslog", "--remote_syslog": "remote_syslog",
               "--log_size_limit": "log_size_limit", "--max_traced_msg_len": "max_traced",
               "-sd": "store_dir", "--store_dir": "store_dir", "--user": "user", "--pass": "pass",
               "--auth": "auth", "--tlscert": "tlscert", "--tlskey": "tlskey",
               "--tlscacert": "tlscacert", "--routes": "routes", "--cluster": "cluster",
               "--cluster_name": "cluster_name", "--cluster_advertise": "cluster_advertise",
               "--connect_retries": "connect_retries", "--cluster_listen": "cluster_listen",
               "--profile": "profile"}


def parse_nats_flags(argv: list[str]) -> tuple[dict[str, Any], list[str]]:
    """nats-server flags as {name: value or True}, and the flags nats-server does not know."""
    flags: dict[str, Any] = {}
    unknown: list[str] = []
    words = iter(argv)
    for word in words:
        flag, eq, value = word.partition("=")
        if flag in _NATS_BOOL:
            flags[_NATS_BOOL[flag]] = value.lower() != "false" if eq else True
        elif flag in _NATS_VALUE:
            flags[_NATS_VALUE[flag]] = value if eq else next(words, "")
        else:
            unknown.append(word)
    return flags, unknown


@dataclass
class HAProxyConfig:
    bind_ports: list[int] = field(default_factory=list)
    servers: list[tuple[str, int]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def _haproxy_seconds(value: str) -> float:
    m = re.fullmatch(r"(\d+)(us|ms|s|m|h|d)?", value)
    if m is None:
        return 0.0
    unit = {"us": 1e-6, "ms": 1e-3, None: 1e-3, "s": 1, "m": 60, "h": 3600, "d": 86400}
    return int(m.group(1)) * unit[m.group(2)]


# 200 ready, 404 alive but not taking new requests (api/app.py): a balancer drains on 404 and
# can then cut the sessions of a replica that does not answer at all.
BALANCER_CHECK = "/ready/balancer"


def parse_haproxy(text: str) -> HAProxyConfig:
    """Bind ports and backend servers of an HAProxy config, and what breaks the brief's needs:
    health check on /ready/balancer (a draining replica kept, a paused one cut), connect
    failures retried elsewhere, streams not held back."""
    cfg = HAProxyConfig()
    sections: list[tuple[str, list[list[str]]]] = []
    for raw in text.splitlines():
        words = re.split(r"(?:^|\s)#", raw, maxsplit=1)[0].split()
        if not words:
            continue
        if not raw[:1].isspace():
            sections.append((words[0], []))
        elif sections:
            sections[-1][1].append(words)
    defaults: list[list[str]] = []
    for kind, lines in sections:
        if kind == "defaults":
            defaults = lines
            continue
        if kind not in ("frontend", "backend", "listen"):
            continue
        for words in lines:
            if words[0] == "bind" and len(words) > 1:
                cfg.bind_ports.append(int(words[1].rpartition(":")[2]))
        servers = [w for w in lines if w[0] == "server" and len(w) > 2]
        if not servers:
            continue
        scope = defaults + lines          # a backend inherits the last defaults section
        # Directive -> its last occurrence ("option x" and "timeout x" keyed by their name).
        last = {" ".join(w[:2]) if w[0] in ("option", "timeout") else w[0]: w for w in scope}
        default_server = [w for w in scope if w[0] == "default-server"]
        for w in servers:
            host, _, port = w[2].rpartition(":")
            cfg.servers.append((host, int(port) if port.isdigit() else 0))
            if "check" not in w and not any("check" in d for d in default_server):
                cfg.problems.append(f"server {w[1]} is not health-checked (add `check`)")
        check = last.get("option httpchk", [])
        send = next((w for w in reversed(scope) if w[:2] == ["http-check", "send"]), [])
        uris = [x for x in check[2:] if x.startswith("/")]
        if "uri" in send:
            uris.append(send[send.index("uri") + 1])
        if not uris or uris[-1] != BALANCER_CHECK:
            cfg.problems.append(f"backend health check does not GET {BALANCER_CHECK} "
                                "(option httpchk)")
        elif not any(w[:2] == ["http-check", "disable-on-404"] for w in scope):
            cfg.problems.append("a draining or starting replica answers its check 404 and is "
                                "marked down: add `http-check disable-on-404`")
        retries = last.get("retries", ["retries", "3"])
        retry_on = last.get("retry-on", ["retry-on", "conn-failure"])
        if int(retries[1]) < 1 or "conn-failure" not in retry_on[1:]:
            cfg.problems.append("requests whose connection failed are not retried")
        if "option redispatch" not in last:
            cfg.problems.append("retries stay on the failed replica (add `option redispatch`)")
        if "empty-response" not in retry_on[1:]:
            cfg.problems.append("a request that reached a replica as it died fails (add "
                                "`empty-response` to retry-on)")
        l7 = {"empty-response", "response-timeout"} & set(retry_on[1:]) or any(
            c.endswith("xx") or c.isdigit() for c in retry_on[1:])
        if l7 and "option http-buffer-request" not in last and not any(
                "wait-for-body" in w for w in scope):
            cfg.problems.append("retry-on beyond conn-failure never fires while request bodies "
                                "stream through: add `option http-buffer-request`")
        if l7 and not any(w[:2] == ["http-request", "disable-l7-retry"] for w in scope):
            cfg.problems.append("admin writes may be retried after reaching a replica (two "
                                "resets): add `http-request disable-l7-retry` for them")
        connect = _haproxy_seconds(last.get("timeout connect", ["timeout", "connect", "5s"])[2])
        if connect > 0.5:
            cfg.problems.append(f"`timeout connect` {connect:g} s holds requests to a vanished "
                                "replica that long (want <= 500ms)")
        for w in servers:
            words = [x for d in default_server for x in d[1:]] + w[3:]
            opts = {k: v for k, v in zip(words, [*words[1:], ""], strict=True)}
            inter = _haproxy_seconds(opts.get("inter", "2s"))
            fall = int(opts.get("fall", "3") or 3)
            if inter * fall > 1.5:
                cfg.problems.append(f"server {w[1]}: a dead replica stays in rotation "
                                    f"~{inter * fall:g} s (inter x fall; want <= 1.5 s)")
            # A paused replica accepts the check's connect and never answers: each failed check
            # costs inter + `timeout check` (inter alone when that is unset).
            check = last.get("timeout check")
            paused = (inter + (_haproxy_seconds(check[2]) if check else inter)) * fall
            if paused > 2.0:
                cfg.problems.append(f"server {w[1]}: a paused replica is marked down only after "
                                    f"~{paused:g} s ((inter + timeout check) x fall; want <= 2 s)")
            if opts.get("on-marked-down") != "shutdown-sessions":
                cfg.problems.append(f"server {w[1]}: requests on a paused replica hang until "
                                    "`timeout server`: add `on-marked-down shutdown-sessions`")
        server_timeout = last.get("timeout server", ["timeout", "server", "0"])
        if _haproxy_seconds(server_timeout[2]) < 60:
            cfg.problems.append("`timeout server` under 60 s cuts long streamed generations")
        if any(w[0] in ("compression", "filter") for w in scope):
            cfg.problems.append("compression/filters buffer streamed responses")
    return cfg


@dataclass
class Service:
    name: str
    spec: dict[str, Any]
    kind: str                                   # jetrouter | nats | haproxy | prometheus | ...
    argv: list[str] = field(default_factory=list)
    args: argparse.Namespace | None = None      # parsed `jetrouter <verb>` flags
    verb: str | None = None
    nats: dict[str, Any] = field(default_factory=dict)
    ports: set[int] | None = None               # container ports it listens on; None = unknown

    def mounts(self) -> Iterator[tuple[str, str]]:
        """(source, target) of every volume entry, short or long syntax."""
        for v in self.spec.get("volumes") or []:
            if isinstance(v, str):
                parts = v.split(":")
                if len(parts) >= 2:
                    yield parts[0], parts[1]
            elif isinstance(v, dict) and v.get("target"):
                yield str(v.get("source", "")), str(v["target"])


def _load_yaml(path: Path) -> Any:
    try:
        import yaml
    except ImportError as exc:
        raise YamlUnavailable("PyYAML is not installed (pip install pyyaml)") from exc
    return yaml.safe_load(path.read_text())


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


# Lists Compose merges across files (`-f a.yaml -f b.yaml`) instead of replacing: volumes by
# their container path, the others by value.
_MERGED_BY_TARGET = ("volumes", "devices", "secrets", "configs")
_CONCATENATED = ("ports", "expose", "dns", "dns_search", "external_links", "tmpfs")


def _target(entry: Any) -> str:
    if isinstance(entry, dict):
        return str(entry.get("target") or entry.get("source"))
    text = str(entry)
    return text.split(":")[1] if ":" in text else text


def merge_compose(base: Any, override: Any, key: str = "") -> Any:
    """``override`` applied to ``base`` the way ``docker compose -f base -f override`` does
    for what this checker reads: mappings merge key by key, ``command``/``entrypoint`` and
    other scalars or lists are replaced, volumes/secrets merge by target, ports concatenate."""
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for k, v in override.items():
            out[k] = merge_compose(base[k], v, k) if k in base else v
        return out
    if isinstance(base, list) and isinstance(override, list):
        if key in _MERGED_BY_TARGET:
            merged = {_target(e): e for e in base}
            merged.update({_target(e): e for e in override})
            return list(merged.values())
        if key in _CONCATENATED:
            return base + [e for e in override if e not in base]
    return override


class ComposeChecker:
    def __init__(self, path: Path, environ: Mapping[str, str],
                 overrides: tuple[Path, ...] = ()) -> None:
        self.path = path
        self.overrides = overrides  # later `-f` files, merged over `path`
        self.root = path.parent
        self.environ = environ
        self.problems: list[str] = []
        self.services: dict[str, Service] = {}
        self.doc: dict[str, Any] = {}
        self.dockerfiles: dict[Path, dict[str, list[str]]] = {}
        # `${VAR:?message}`: the user must set VAR to start the stack (a secret with no default).
        # Unset here, it becomes a placeholder: required is not wrong.
        self.required: dict[str, str] = {}             # name -> value or placeholder

    def rel(self, path: Path) -> str:
        return os.path.relpath(path, self.root)

    def problem(self, where: str, message: str) -> None:
        self.problems.append(f"{where}: {message}")

    # --- loading ----------------------------------------------------------------------------

    def interpolate(self, value: Any, where: str) -> Any:
        """Compose's ``${VAR:-default}`` substitution, from ``environ`` (not the caller's env)."""
        if isinstance(value, dict):
            return {k: self.interpolate(v, f"{where}.{k}") for k, v in value.items()}
        if isinstance(value, list):
            return [self.interpolate(v, where) for v in value]
        if not isinstance(value, str):
            return value

        def sub(m: re.Match[str]) -> str:
            if m.group(0) == "$$":
                return "$"
            name, op, arg = m.group(1) or m.group(4), m.group(2) or "", m.group(3) or ""
            val = self.environ.get(name)
            unset = val is None or (op.startswith(":") and val == "")
            if op.endswith("-"):
                return arg if unset else str(val)
            if op.endswith("+"):
                return "" if unset else arg
            if op.endswith("?"):
                self.required[name] = f"<{name}>" if unset else str(val)
                return self.required[name]
            if unset:
                self.problem(where, f"variable {name} is not set and has no default"
                             + (f" ({arg})" if op.endswith("?") else ""))
                return ""
            return str(val)
        return _VAR.sub(sub, value)

    def load(self) -> bool:
        raw = _load_yaml(self.path)
        for extra in self.overrides:
            raw = merge_compose(raw, _load_yaml(extra))
        if not isinstance(raw, dict) or not isinstance(raw.get("services"), dict):
            self.problem(self.path.name, "no `services:` mapping")
            return False
        self.doc = {k: (v if k.startswith("x-") else self.interpolate(v, k))
                    for k, v in raw.items()}
        if "name" in raw:
            self.problem(self.path.name, "top-level `name:` makes docker-compose 1.29 (Debian's "
                         "package) reject the whole file: leave the project name to the "
                         "directory or `-p`")
        for name, spec in self.doc["services"].items():
            if isinstance(spec or {}, dict):
                self.services[name] = self.classify(name, spec or {})
            else:
                self.problem(f"service {name}", "is not a mapping")
        return True

    def classify(self, name: str, spec: dict[str, Any]) -> Service:
        image = str(spec.get("image", ""))
        entrypoint = spec.get("entrypoint")
        default_cmd: list[str] = []
        if "build" in spec or any("build" in s and s.get("image") == image and image
                                  for s in self.doc["services"].values()):
            entry, default_cmd = self.dockerfile_entry(name, spec)
            entrypoint = entrypoint if entrypoint is not None else entry
        if isinstance(entrypoint, str):
            entrypoint = shlex.split(entrypoint)
        command = spec.get("command")
        if isinstance(command, list):
            bad = [c for c in command if not isinstance(c, str)]
            if bad:
                self.problem(f"service {name}", f"command items {bad} are not strings "
                             "(compose rejects them): quote them")
            command = [str(c) for c in command]
        elif isinstance(command, str):
            command = shlex.split(command)
        argv = list(entrypoint or []) + (command if command is not None else default_cmd)
        program = Path(argv[0]).name if argv else ""
        repo = re.split(r"[:@]", image.rsplit("/", 1)[-1])[0]    # "nats" of "nats:2.10-alpine"
        if program == "jetrouter":
            kind = "jetrouter"
        elif program == "nats-server" or (repo == "nats" and spec.get("entrypoint") is None):
            kind = "nats"
        else:
            kind = next((k for k in ("haproxy", "prometheus", "grafana") if k in repo), "other")
        if kind == "nats" and argv and not argv[0].startswith("-"):
            argv = argv[1:]                     # the nats images prepend nats-server to flags
        return Service(name, spec, kind, argv=argv[1:] if kind == "jetrouter" else argv)

    def dockerfile_entry(self, name: str, spec: dict[str, Any]) -> tuple[list[str], list[str]]:
        build = spec.get("build")
        if build is None:                       # uses an image another service builds
            build = next(s["build"] for s in self.doc["services"].values()
                         if "build" in s and s.get("image") == spec.get("image"))
        context = build if isinstance(build, str) else build.get("context", ".")
        dockerfile = "Dockerfile" if isinstance(build, str) else build.get("dockerfile",
                                                                            "Dockerfile")
        path = self.root / context / dockerfile
        if not path.is_file():
            self.problem(f"service {name}", f"Dockerfile {self.rel(path)} does not exist")
            return [], []
        ins = self.dockerfiles.get(path)
        if ins is None:                         # checked once, however many services use it
            text = path.read_text()
            ins = self.dockerfiles[path] = dockerfile_instructions(text)
            if ins.get("ENTRYPOINT") != ["jetrouter"]:
                self.problem(self.rel(path),
                             f'ENTRYPOINT is {ins.get("ENTRYPOINT")}, want ["jetrouter"]')
            if ins.get("USER") in (None, ["root"], ["0"]):
                self.problem(self.rel(path), "the image runs as root: add a non-root USER")
            copied = dockerfile_copied(text)
            missing = pyproject_packages(self.root / context / "pyproject.toml") - copied
            if "." not in copied and missing:
                self.problem(self.rel(path), f"packages {', '.join(sorted(missing))} of "
                             "pyproject.toml are not copied into the image: `jetrouter` "
                             "imports every verb's module and fails with ModuleNotFoundError")
        return ins.get("ENTRYPOINT") or [], ins.get("CMD") or []

    # --- per service ------------------------------------------------------------------------

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

    def environment(self, svc: Service) -> dict[str, str]:
        env = svc.spec.get("environment") or {}
        if isinstance(env, list):
            env = dict(e.split("=", 1) if "=" in e else (e, "") for e in env)
        return {str(k): "" if v is None else str(v) for k, v in env.items()
                if str(k).startswith("JETROUTER_")}

    def check_nats(self, svc: Service) -> None:
        where = f"service {svc.name}"
        svc.nats, unknown = parse_nats_flags(svc.argv)
        for flag in unknown:
            self.problem(where, f"nats-server has no flag {flag}")
        n = svc.nats
        cluster_port = urlsplit(n["cluster"]).port if n.get("cluster") else None
        svc.ports = {int(n.get("port", 4222))} | {int(p) for p in (n.get("http_port"),
                                                                   cluster_port) if p}
        if not n.get("jetstream"):
            self.problem(where, "JetStream is off: add --jetstream")
        store = n.get("store_dir")
        if not store or not any(store == t or store.startswith(t.rstrip("/") + "/")
                                for _, t in svc.mounts()):
            self.problem(where, f"JetStream store {store!r} is not on a volume")
        image = str(svc.spec.get("image", ""))
        test = (svc.spec.get("healthcheck") or {}).get("test")
        official = re.match(r"(docker\.io/)?(library/)?nats([:@]|$)", image)
        if test and official and "alpine" not in image:
            self.problem(where, f"{image} is FROM scratch: no shell or wget for the healthcheck "
                         "(use the -alpine variant)")

    def check_nats_cluster(self) -> None:
        nats = [s for s in self.services.values() if s.kind == "nats"]
        names = {s.name for s in nats}
        if len({s.nats.get("cluster_name") for s in nats}) > 1:
            self.problem("nats", "servers disagree on --cluster_name")
        if len({s.nats.get("server_name") or s.name for s in nats}) < len(nats):
            self.problem("nats", "--server_name values are not unique")
        for s in nats if len(nats) > 1 else []:
            where = f"service {s.name}"
            if not s.nats.get("cluster"):
                self.problem(where, "no --cluster listen URL in a multi-server cluster")
            routed: set[str] = set()
            for route in filter(None, str(s.nats.get("routes", "")).split(",")):
                u = urlsplit(route.strip())
                target = self.services.get(u.hostname or "")
                if target is None or target.kind != "nats":
                    self.problem(where, f"route {route} names no NATS service")
                    continue
                routed.add(target.name)
                tport = urlsplit(target.nats.get("cluster") or "").port
                if u.port != tport:
                    self.problem(where, f"route {route}: {target.name} listens for routes "
                                 f"on {tport}")
            missing = names - routed - {s.name}
            if missing:
                self.problem(where, f"--routes miss {sorted(missing)}")

    def container_files(self, svc: Service) -> list[tuple[str, str]]:
        """(container path, host source) of every bind mount and secret of ``svc``."""
        out = [(t, src) for src, t in svc.mounts()]
        declared = self.doc.get("secrets") or {}
        for entry in svc.spec.get("secrets") or []:
            source = entry.get("source") if isinstance(entry, dict) else str(entry)
            target = (entry.get("target") if isinstance(entry, dict) else None) or source
            if source not in declared:
                self.problem(f"service {svc.name}", f"secret {source} is not declared under "
                             "top-level `secrets:`")
                continue
            out.append((target if str(target).startswith("/") else f"/run/secrets/{target}",
                        str((declared[source] or {}).get("file", ""))))
        return out

    def nats_server_config(self) -> tuple[Path, str] | None:
        """The nats-server configuration file the NATS services load (`--config`), if any."""
        for svc in self.services.values():
            conf = svc.nats.get("config") if svc.kind == "nats" else None
            if not conf:
                continue
            for target, source in self.container_files(svc):
                if (conf == target or conf.startswith(target.rstrip("/") + "/")) and \
                        source.startswith("."):
                    path = self.root / source / os.path.relpath(conf, target)
                    if path.is_file():
                        return path, path.read_text()
            self.problem(f"service {svc.name}", f"--config {conf} is not a mounted file")
            return None
        return None

    def check_nats_security(self, svc: Service) -> None:
        """Credential/TLS files exist in the container; users and TLS match the server config."""
        where = f"service {svc.name}"
        args = svc.args
        files = self.container_files(svc)
        for flag in ("nats_creds", "nats_nkey", "nats_password_file", "nats_token_file",
                     "nats_tls_ca", "nats_tls_cert", "nats_tls_key"):
            path = getattr(args, flag, None)
            if path and not any(path == t or path.startswith(t.rstrip("/") + "/")
                                for t, _ in files):
                self.problem(where, f"--{flag.replace('_', '-')} {path} is not mounted into the "
                             "container (volume or secret)")
        found = self.nats_server_config()
        if found is None:
            return
        path, text = found
        blocks = dict(re.findall(r'user:\s*"([^"]+)"(.*?)(?=user:|nkey:|\Z)', text, re.S))
        user = getattr(args, "nats_user", None)
        if not (user or args.nats_creds or args.nats_nkey or args.nats_token_file):
            self.problem(where, f"{self.rel(path)} requires credentials; give --nats-user ...")
        elif user and user not in blocks:
            self.problem(where, f"--nats-user {user} is not a user in {self.rel(path)}")
        elif user and "permissions" in blocks[user]:
            own = (".router.*" if svc.verb == "serve"
                   else f".kv.{getattr(args, 'worker_id', '')}\"")
            if own not in blocks[user]:
                self.problem(where, f"NATS user {user} lacks the {svc.verb} permissions "
                             f"(no {own.strip(chr(34))} in {self.rel(path)})")
        if re.search(r"^tls\s*\{", text, re.M) and not args.nats_tls_ca:
            # Its certificate comes from a private CA, which no system trust store holds.
            self.problem(where, f"{self.rel(path)} turns TLS on: give --nats-tls-ca (and "
                         "tls:// URLs)")

    def check_nats_urls(self, svc: Service) -> None:
        url = getattr(svc.args, "nats_url", None)
        if not url:
            self.problem(f"service {svc.name}", "no --nats-url")
            return
        for one in url.split(","):
            u = urlsplit(one.strip())
            target = self.services.get(u.hostname or "")
            if target is None or target.kind != "nats":
                self.problem(f"service {svc.name}", f"--nats-url {one} names no NATS service")
            elif (u.port or 4222) != int(target.nats.get("port", 4222)):
                self.problem(f"service {svc.name}", f"--nats-url {one}: {target.name} listens "
                             f"for clients on {target.nats.get('port', 4222)}")

    # --- cross-service ----------------------------------------------------------------------

    def check_healthcheck(self, svc: Service) -> None:
        where = f"service {svc.name}"
        hc = svc.spec.get("healthcheck") or {}
        test = hc.get("test")
        if hc.get("disable") or not test or test == ["NONE"]:
            # A bridge listens on no port; its restart policy is what keeps it there.
            if svc.kind in ("nats", "jetrouter") and svc.verb != "bridge":
                self.problem(where, "no healthcheck")
            return
        words = shlex.split(test) if isinstance(test, str) else [str(t) for t in test]
        if words[0] in ("CMD", "CMD-SHELL"):
            words = words[1:] if words[0] == "CMD" else shlex.split(" ".join(words[1:]))
        elif not isinstance(test, str):
            self.problem(where, f"healthcheck test must start with CMD or CMD-SHELL: {test}")
        if svc.kind == "jetrouter" and Path(words[0]).name not in ("python", "python3",
                                                                   "jetrouter"):
            self.problem(where, f"healthcheck runs {words[0]!r}, which python:3.11-slim lacks")
        for m in _URL.finditer(" ".join(words)):
            host, port, path = m.group(1), int(m.group(2) or 80), m.group(3) or "/"
            if host not in LOCAL_HOSTS:
                self.problem(where, f"healthcheck probes {host}, not the container itself")
            if svc.ports is not None and port not in svc.ports:
                self.problem(where, f"healthcheck probes port {port}, but {svc.name} listens "
                             f"on {sorted(svc.ports)}")
            want = HEALTH_PATHS.get(svc.verb or "")
            if want and path.split("?")[0] != want:
                self.problem(where, f"healthcheck probes {path}, want {want}")
        if svc.kind in ("nats", "jetrouter") and svc.spec.get("restart") in (None, "no"):
            self.problem(where, "no restart policy")

    def check_ports(self, svc: Service) -> None:
        for p in svc.spec.get("ports") or []:
            target = p.get("target") if isinstance(p, dict) else str(p).split(":")[-1]
            port = int(str(target).split("/")[0].split("-")[0])
            if svc.ports is not None and port not in svc.ports:
                self.problem(f"service {svc.name}", f"publishes container port {port}, but "
                             f"it listens on {sorted(svc.ports)}")

    def check_depends_on(self) -> None:
        graph: dict[str, list[str]] = {}
        for svc in self.services.values():
            deps = svc.spec.get("depends_on") or {}
            if isinstance(deps, list):
                deps = {d: {"condition": "service_started"} for d in deps}
            graph[svc.name] = list(deps)
            for dep, opts in deps.items():
                where = f"service {svc.name}"
                target = self.services.get(dep)
                cond = (opts or {}).get("condition", "service_started")
                if target is None:
                    self.problem(where, f"depends_on {dep}, which is not a service")
                    continue
                if cond not in DEPENDS_CONDITIONS:
                    self.problem(where, f"depends_on {dep}: unknown condition {cond!r}")
                if cond == "service_healthy" and not (target.spec.get("healthcheck") or {}).get(
                        "test"):
                    self.problem(where, f"depends_on {dep} being healthy, but it has no "
                                 "healthcheck")
                if target.spec.get("profiles") and not svc.spec.get("profiles"):
                    self.problem(where, f"depends_on {dep}, which only runs in profiles "
                                 f"{target.spec['profiles']}")
        state: dict[str, int] = {}

        def visit(n: str, trail: list[str]) -> None:
            if state.get(n) == 1:
                self.problem("depends_on", f"cycle {' -> '.join([*trail, n])}")
            if state.get(n):
                return
            state[n] = 1
            for d in graph.get(n, []):
                visit(d, [*trail, n])
            state[n] = 2
        for n in graph:
            visit(n, [])

    def check_volumes(self, svc: Service) -> None:
        declared = self.doc.get("volumes") or {}
        for source, _target in svc.mounts():
            if not source:
                continue
            if source.startswith((".", "/", "~")):
                if source.startswith(".") and not (self.root / source).exists():
                    self.problem(f"service {svc.name}", f"bind mount {source} does not exist")
            elif source not in declared:
                self.problem(f"service {svc.name}", f"volume {source} is not declared under "
                             "top-level `volumes:`")

    def mounted_file(self, svc: Service, suffix: str) -> Path | None:
        """Host path of the bind mount whose container path ends with ``suffix``."""
        for source, target in svc.mounts():
            if target.rstrip("/").endswith(suffix) and source.startswith("."):
                path = self.root / source
                return path if path.exists() else None
        self.problem(f"service {svc.name}", f"no bind mount for {suffix}")
        return None

    def by_verb(self, verb: str) -> dict[str, Service]:
        return {s.name: s for s in self.services.values() if s.verb == verb}

    def check_haproxy(self, svc: Service) -> None:
        path = self.mounted_file(svc, "haproxy.cfg")
        if path is None:
            return
        cfg: HAProxyConfig = parse_haproxy(path.read_text())
        svc.ports = set(cfg.bind_ports)
        where = self.rel(path)
        for message in cfg.problems:
            self.problem(where, message)
        replicas = self.by_verb("serve")
        hosts = {host for host, _ in cfg.servers}
        for host in sorted(set(replicas) - hosts):
            self.problem(where, f"replica {host} is not a backend server")
        for host in sorted(hosts & set(replicas)):
            self.check_stable_address(replicas[host])
        for host, port in cfg.servers:
            if host not in replicas:
                self.problem(where, f"backend server {host} is not a replica service")
            elif replicas[host].ports is not None and port not in replicas[host].ports:
                self.problem(where, f"backend server {host}:{port}, but {host} listens on "
                             f"{sorted(replicas[host].ports or [])}")

    def check_stable_address(self, svc: Service) -> None:
        """A balanced replica's address must outlive its process. An address owned by the
        replica's container vanishes when that container exits: connects to it hang until
        `timeout connect`, and those still pending when HAProxy marks the replica down are cut
        by `on-marked-down shutdown-sessions` without a retry (measured: 2 of 304 requests,
        none of which had reached the replica). Joined to an always-running service's network,
        the address stays and a connect to a dead replica is refused at once, then retried."""
        where = f"service {svc.name}"
        mode = str(svc.spec.get("network_mode", ""))
        if not mode.startswith("service:"):
            self.problem(where, "behind the balancer its address dies with its container "
                         "(connects hang, then are cut without a retry): join the network of "
                         f"a service that only sleeps (`network_mode: service:{svc.name}-net`)")
            return
        anchor = self.services.get(mode.removeprefix("service:"))
        if anchor is None:
            self.problem(where, f"network_mode {mode}: no such service")
            return
        networks = anchor.spec.get("networks") or {}
        aliases = {str(a) for n in (networks.values() if isinstance(networks, dict) else [])
                   for a in ((n or {}).get("aliases") or [])}
        if svc.name not in aliases:
            self.problem(f"service {anchor.name}", f"{svc.name} runs in its network, but no "
                         f"alias {svc.name} points there: the balancer cannot resolve it")
        if anchor.spec.get("restart") in (None, "no"):
            self.problem(f"service {anchor.name}", "no restart policy")
        for key in ("ports", "networks"):
            if svc.spec.get(key):
                self.problem(where, f"`{key}` with network_mode {mode} (compose rejects it; "
                             f"put it on {anchor.name})")

    def check_prometheus(self, svc: Service) -> None:
        svc.ports = {9090}
        path = self.mounted_file(svc, "prometheus.yml")
        if path is None:
            return
        where = self.rel(path)
        doc = _load_yaml(path) or {}
        targets: set[tuple[str, int]] = set()
        for job in doc.get("scrape_configs") or []:
            if job.get("metrics_path", "/metrics") != "/metrics":
                self.problem(where, f"job {job.get('job_name')} scrapes {job['metrics_path']}")
            for sc in job.get("static_configs") or []:
                for t in sc.get("targets") or []:
                    host, _, port = str(t).rpartition(":")
                    targets.add((host, int(port)))
        for host, port in sorted(targets):
            target = self.services.get(host)
            if target is None:
                self.problem(where, f"target {host}:{port} is not a service")
            elif target.ports is not None and port not in target.ports:
                self.problem(where, f"target {host}:{port}, but {host} listens on "
                             f"{sorted(target.ports)}")
        for s in [*self.by_verb("serve").values(), *self.by_verb("worker").values()]:
            if not any(h == s.name for h, _ in targets):
                self.problem(where, f"{s.name} is not scraped")

    def check_grafana(self, svc: Service) -> None:
        svc.ports = {3000}
        env = svc.spec.get("environment") or {}
        if isinstance(env, list):
            env = dict(e.split("=", 1) if "=" in e else (e, "") for e in env)
        password = env.get("GF_SECURITY_ADMIN_PASSWORD")
        no_login = (str(env.get("GF_AUTH_DISABLE_LOGIN_FORM", "")).lower() == "true"
                    and str(env.get("GF_AUTH_BASIC_ENABLED", "")).lower() == "false")
        if not no_login and (password is None or str(password) not in self.required.values()):
            self.problem(f"service {svc.name}", "Grafana's admin password has a default "
                         "(admin/admin when unset): disable the login (GF_AUTH_DISABLE_LOGIN_FORM"
                         ", GF_AUTH_BASIC_ENABLED=false) or require ${GRAFANA_ADMIN_PASSWORD:?}")
        prov = self.mounted_file(svc, "/etc/grafana/provisioning")
        if prov is None:
            return
        uids: set[str] = set()
        for f in sorted((prov / "datasources").glob("*.y*ml")):
            for ds in (_load_yaml(f) or {}).get("datasources") or []:
                uids.add(str(ds.get("uid")))
                u = urlsplit(str(ds.get("url", "")))
                target = self.services.get(u.hostname or "")
                if target is None or target.kind != "prometheus" or u.port != 9090:
                    self.problem(self.rel(f), f"datasource url {ds.get('url')}"
                                 " is not the prometheus service on 9090")
        for f in sorted((prov / "dashboards").glob("*.y*ml")):
            for provider in (_load_yaml(f) or {}).get("providers") or []:
                folder = (provider.get("options") or {}).get("path", "")
                host_dir = self.mounted_file(svc, folder)
                for dash in sorted(host_dir.glob("*.json")) if host_dir else []:
                    self.check_dashboard(dash, uids)

    def check_dashboard(self, path: Path, uids: set[str]) -> None:
        where = self.rel(path)
        try:
            panels = json.loads(path.read_text()).get("panels", [])
        except json.JSONDecodeError as exc:
            self.problem(where, f"not JSON: {exc}")
            return
        known = known_metric_names()
        for panel in panels:
            for t in panel.get("targets", []):
                uid = (t.get("datasource") or panel.get("datasource") or {}).get("uid")
                if uid not in uids:
                    self.problem(where, f"panel {panel.get('title')!r}: datasource {uid!r} "
                                 "is not provisioned")
                for name in set(re.findall(r"\bjetrouter_\w+", t.get("expr", ""))) - known:
                    self.problem(where, f"panel {panel.get('title')!r}: no metric {name}")

    def guarded(self, where: str, check: Callable[..., None], *args: Any) -> None:
        """Run one check; a value of an unexpected shape becomes a problem, not a traceback."""
        try:
            check(*args)
        except (ValueError, TypeError, KeyError, AttributeError, IndexError,
                StopIteration) as exc:
            self.problem(where, f"could not be checked ({type(exc).__name__}: {exc})")

    def check_image_builds(self) -> None:
        """One build per image: several services building one tag run parallel builds that each
        produce an image id, and a later plain `up -d` recreates every service whose id changed.
        Services using an image another service builds must not pull it (no registry has it)."""
        builders: dict[str, list[str]] = {}
        for svc in self.services.values():
            if "build" in svc.spec:
                builders.setdefault(str(svc.spec.get("image", "")), []).append(svc.name)
        for image, names in builders.items():
            if len(names) > 1:
                self.problem(self.path.name, f"services {', '.join(names)} all build {image!r}: "
                             "let one build it and the others use `image:` only")
        for svc in self.services.values():
            image = str(svc.spec.get("image", ""))
            if "build" not in svc.spec and image in builders and svc.spec.get(
                    "pull_policy") not in ("never",):
                self.problem(f"service {svc.name}", f"runs {image!r}, built by "
                             f"{builders[image][0]}, without `pull_policy: never` (compose "
                             "would try to pull it)")

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

    def run(self) -> list[str]:
        if not self.load():
            return self.problems
        services = list(self.services.values())
        # Order matters: NATS ports first (jetrouter URLs refer to them), then every service's
        # listen ports (health checks, the balancer and Prometheus refer to those).
        for svc in services:
            if svc.kind == "nats":
                self.guarded(f"service {svc.name}", self.check_nats, svc)
        for svc in services:
            if svc.kind == "jetrouter":
                self.guarded(f"service {svc.name}", self.check_jetrouter, svc)
        self.guarded("nats", self.check_nats_cluster)
        for svc in services:
            if svc.verb in (*HEALTH_PATHS, "bridge") and svc.args is not None:
                self.guarded(f"service {svc.name}", self.check_nats_urls, svc)
                self.guarded(f"service {svc.name}", self.check_nats_security, svc)
            if svc.verb == "bridge" and svc.args is not None:
                self.guarded(f"service {svc.name}", self.check_bridge, svc)
        checks = {"haproxy": self.check_haproxy, "prometheus": self.check_prometheus,
                  "grafana": self.check_grafana}
        for svc in services:
            if svc.kind in checks:
                self.guarded(f"service {svc.name}", checks[svc.kind], svc)
        if not any(s.kind == "haproxy" for s in services):
            self.problem(self.path.name, "no HAProxy load balancer in front of the replicas")
        self.check_ids_and_block_sizes()
        self.check_image_builds()
        for svc in services:
            for check in (self.check_healthcheck, self.check_ports, self.check_volumes):
                self.guarded(f"service {svc.name}", check, svc)
        self.guarded("depends_on", self.check_depends_on)
        return self.problems


def known_metric_names() -> set[str]:
    """Every sample name the replicas and simulated workers export (plus PENDING_METRICS)."""
    from api.metrics import RouterMetrics
    from api.replica_metrics import families as replica_families
    # Imported by name like api.cli does: the checker reads the worker's metric names only.
    worker_metrics = importlib.import_module("workers.metrics")
    registries = [RouterMetrics().registry, worker_metrics.WorkerMetrics([], "check").registry]
    suffixes = {"counter": ("_total", "_created"), "gauge": ("",),
                "histogram": ("_bucket", "_sum", "_count", "_created")}
    names = set(PENDING_METRICS)
    # The replica's own figures are exported by a collector read at scrape time.
    for family in [f for r in registries for f in r.collect()] + replica_families():
        names.update(family.name + s for s in suffixes.get(family.type, ("",)))
    return names


def check_compose(path: str | os.PathLike[str],
                  environ: Mapping[str, str] | None = None,
                  overrides: tuple[str | os.PathLike[str], ...] = ()) -> list[str]:
    """Problems found in the compose file and the deploy/ files it uses; empty = consistent.

    ``environ`` feeds ``${VAR}`` interpolation (default: none set, so defaults apply);
    ``overrides`` are further ``-f`` files merged over ``path`` (e.g. compose.secure.yaml).
    Raises :class:`YamlUnavailable` without PyYAML.
    """
    return ComposeChecker(Path(path).resolve(), environ or {},
                          tuple(Path(o).resolve() for o in overrides)).run()


def required_variables(path: str | os.PathLike[str]) -> list[str]:
    """The ``${VAR:?...}`` variables the file needs set to start (secrets without defaults)."""
    checker = ComposeChecker(Path(path).resolve(), {})
    checker.load()
    return sorted(checker.required)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of a `jetrouter check-config` verb (api/cli.py VERBS entry, if the lead adds one)."""
    parser.add_argument("compose", nargs="?", default="compose.yaml",
                        help="compose file; deploy/ files are found through its mounts")
    parser.add_argument("overrides", nargs="*", default=[],
                        help="override files merged over it, as `docker compose -f A -f B` "
                             "(e.g. compose.secure.yaml)")


def run(args: argparse.Namespace) -> int:
    """Print one line per problem; exit status 1 if any, 0 if consistent or PyYAML is missing."""
    try:
        problems = check_compose(args.compose, overrides=tuple(args.overrides))
    except YamlUnavailable as exc:
        print(f"checkconfig: skipped, {exc}")
        return 0
    for line in problems:
        print(line)
    required = required_variables(args.compose)
    print(f"checkconfig: {' + '.join([args.compose, *args.overrides])}: "
          + (f"{len(problems)} problem(s)" if problems else "ok")
          + (f" (to start it, set {', '.join(required)})" if required else ""), file=sys.stderr)
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cluster.checkconfig",
                                     description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
