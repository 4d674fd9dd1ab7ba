"""What the checks read from the Dockerfile: its last stage's ENTRYPOINT, CMD and USER, the
build-context paths it copies, and the packages pyproject.toml ships (each must be copied in)."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path


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
