"""The package layers in pyproject.toml's import-linter contracts hold, transitively.

`make lint` runs the same check; running it here puts it in every CI run."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_import_contracts_are_kept() -> None:
    lint_imports = Path(sys.executable).parent / "lint-imports"
    done = subprocess.run([str(lint_imports), "--no-cache"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout


def test_the_bridge_contract_names_every_module_of_the_simulated_engine() -> None:
    """A new module of workers/ is the simulated engine's unless it is the shared engine link;
    the bridge's forbidden contract must name it, or the bridge could start importing it."""
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"][
        "contracts"]
    (bridge,) = [c for c in contracts if c.get("source_modules") == ["workers.bridge"]]
    workers = ROOT / "workers"
    modules = {f"workers.{p.stem}" for p in workers.glob("*.py")} | {
        f"workers.{p.parent.name}" for p in workers.glob("*/__init__.py")}
    shared = {"workers.__init__", "workers.engine_link", "workers.bridge"}
    assert sorted(modules - shared - set(bridge["forbidden_modules"])) == []
