"""Every exception class jetrouter defines descends from ``errors.root.JetrouterError``.

Read from the source (no imports), so modules with optional dependencies are checked too: a class
whose bases name a built-in exception must also name ``JetrouterError``; classes built on those
inherit it."""

from __future__ import annotations

import ast
import builtins
import tomllib
from pathlib import Path

from errors.root import JetrouterError

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = tuple(
    tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["root_packages"])
BUILTIN_EXCEPTIONS = {name for name, value in vars(builtins).items()
                      if isinstance(value, type) and issubclass(value, BaseException)}


def _base_names(node: ast.ClassDef) -> set[str]:
    return {b.id if isinstance(b, ast.Name) else b.attr for b in node.bases
            if isinstance(b, ast.Name | ast.Attribute)}


def test_every_exception_class_has_the_one_root() -> None:
    strays = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                if not isinstance(node, ast.ClassDef) or node.name == JetrouterError.__name__:
                    continue
                bases = _base_names(node)
                if bases & BUILTIN_EXCEPTIONS and "JetrouterError" not in bases:
                    strays.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert not strays, "exceptions outside the JetrouterError root:\n" + "\n".join(strays)


def test_the_rule_sees_a_stray() -> None:
    tree = ast.parse("class Oops(ValueError):\n    pass\n")
    node = tree.body[0]
    assert isinstance(node, ast.ClassDef) and _base_names(node) & BUILTIN_EXCEPTIONS
