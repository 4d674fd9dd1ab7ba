"""A compose file as the checks see it: loaded (with override files merged the way ``docker
compose -f A -f B`` does), ``${VAR}`` interpolated from a given environment, each service
classified (jetrouter verb, NATS, HAProxy, ...) with its command line, and the problems found.
The checks themselves live beside this module and build on :class:`ComposeFile`.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cluster.checkconfig.dockerfile import (
    dockerfile_copied,
    dockerfile_instructions,
    pyproject_packages,
)
from errors.root import JetrouterError

HEALTH_PATHS = {"serve": "/ready", "worker": "/health"}
_VAR = re.compile(r"\$\$|\$\{([A-Za-z_]\w*)(?:(:?[-?+])([^}]*))?\}|\$([A-Za-z_]\w*)")


class YamlUnavailable(JetrouterError, RuntimeError):
    """PyYAML is not installed, so compose.yaml cannot be read."""


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


def load_yaml(path: Path) -> Any:
    try:
        import yaml
    except ImportError as exc:
        raise YamlUnavailable("PyYAML is not installed (pip install pyyaml)") from exc
    return yaml.safe_load(path.read_text())


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


class ComposeFile:
    """The loaded file, its services and the problems found so far."""

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
        self.nixl_ports: dict[str, str] = {}           # NIXL handshake port -> engine

    def rel(self, path: Path) -> str:
        return os.path.relpath(path, self.root)

    def problem(self, where: str, message: str) -> None:
        self.problems.append(f"{where}: {message}")

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
        raw = load_yaml(self.path)
        for extra in self.overrides:
            raw = merge_compose(raw, load_yaml(extra))
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

    def environment(self, svc: Service) -> dict[str, str]:
        env = svc.spec.get("environment") or {}
        if isinstance(env, list):
            env = dict(e.split("=", 1) if "=" in e else (e, "") for e in env)
        return {str(k): "" if v is None else str(v) for k, v in env.items()
                if str(k).startswith("JETROUTER_")}

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

    def guarded(self, where: str, check: Callable[..., None], *args: Any) -> None:
        """Run one check; a value of an unexpected shape becomes a problem, not a traceback."""
        try:
            check(*args)
        except (ValueError, TypeError, KeyError, AttributeError, IndexError,
                StopIteration) as exc:
            self.problem(where, f"could not be checked ({type(exc).__name__}: {exc})")
