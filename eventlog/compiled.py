"""Whether prompt hashing runs its compiled code (``eventlog/_fasthash.c``) or its Python code.

The compiled module is an optional build (setup.py): where it is missing, or where the variable
``JETROUTER_PURE_PYTHON`` is set to anything but ``""``/``0``, ``eventlog.hashing`` runs the
pure-Python code, which stays the reference implementation (the property tests check the two
give equal hashes on random input, and every test can run either way). ``use_compiled`` switches
at run time, so one benchmark process can time both (``jetrouter bench core --hashing both``).

The compiled module never carries its own copy of xxhash: it is bound here to the xxhash
package's ``XXH3_64bits_withSeed`` when the package's extension exports it, else to its Python
``xxh3_64_intdigest`` (design.md §4).
"""

from __future__ import annotations

import os
import sys
from types import ModuleType

import xxhash

try:
    from eventlog import _fasthash  # type: ignore[attr-defined]
except ImportError:  # not built here: the Python code runs
    _fasthash = None

PURE_ENV = "JETROUTER_PURE_PYTHON"


def _bind() -> bool:
    """Point the compiled module at the xxhash package's own xxh3; True if at its C function."""
    if _fasthash is None:
        return False
    library = getattr(sys.modules.get(xxhash.xxh3_64_intdigest.__module__ or ""), "__file__", None)
    return bool(_fasthash.bind(library, xxhash.xxh3_64_intdigest))


DIRECT_XXH3 = _bind()
"""The compiled module calls xxhash's C function directly (else its Python function)."""



def pure_requested() -> bool:
    """``JETROUTER_PURE_PYTHON`` asks for the Python code (the prefix index's compiled kernel,
    ``replicas/core/index_kernel.py``, follows it too)."""
    return os.environ.get(PURE_ENV, "") not in ("", "0")


_active: ModuleType | None = None if pure_requested() else _fasthash


def available() -> bool:
    """The compiled module was built and imports."""
    return _fasthash is not None


def active() -> ModuleType | None:
    """The compiled module when hashing should use it, else None (run the Python code)."""
    return _active


def use_compiled(enabled: bool) -> bool:
    """Switch hashing to the compiled code (when built) or to the Python code; returns whether
    the compiled code now runs."""
    global _active
    _active = _fasthash if enabled else None
    return _active is not None
