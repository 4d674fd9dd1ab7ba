"""The pure core does no I/O, reads no clock and draws no random numbers of its own (design §1).

Checked on the source, so a violation fails here rather than in review."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Every module of replicas/core/ (found, not listed), plus the pure modules outside it; what they
# import transitively is checked by the import-linter contracts in pyproject.toml (`make lint`).
PURE_OUTSIDE_CORE = ["eventlog/events.py", "eventlog/hashing.py", "eventlog/binding.py",
                     "eventlog/names.py", "eventlog/log.py", "tokenization/tokens.py",
                     "errors/root.py", "workers/bridge/decode.py", "workers/bridge/translate.py"]
CORE = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "replicas/core").glob("*.py")) + \
    PURE_OUTSIDE_CORE
FORBIDDEN_MODULES = {"nats", "sqlalchemy", "fastapi", "starlette", "prometheus_client", "httpx",
                     "asyncio", "time", "datetime", "socket", "os", "subprocess", "uvicorn",
                     "aiosqlite", "threading", "secrets", "uuid"}
# `random.Random` may be named (a source is passed in); module-level draws may not.
FORBIDDEN_RANDOM_ATTRS = {"random", "randint", "choice", "choices", "shuffle", "uniform",
                          "getrandbits", "sample", "seed", "randrange", "gauss"}


def imported_roots(tree: ast.AST) -> set[str]:
    roots: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.mark.parametrize("path", CORE)
def test_core_module_is_pure(path: str) -> None:
    tree = ast.parse((ROOT / path).read_text(), filename=path)
    bad = imported_roots(tree) & FORBIDDEN_MODULES
    assert not bad, f"{path} imports {sorted(bad)}: the core must stay free of I/O and clocks"
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id == "random" and node.attr in FORBIDDEN_RANDOM_ATTRS):
            pytest.fail(f"{path}:{node.lineno} draws from the global random source")
        if isinstance(node, ast.ImportFrom) and node.module == "random":
            names = {a.name for a in node.names}
            assert names <= {"Random"}, f"{path} imports {names} from random"


def test_checker_catches_a_clock_read(tmp_path: Path) -> None:
    tree = ast.parse("import time\nx = time.time()\n")
    assert imported_roots(tree) & FORBIDDEN_MODULES == {"time"}
