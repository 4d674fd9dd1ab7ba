"""Whether the compact index applies KV events and matches prompts with its compiled kernel
(``_fastindex.c``).

The kernel is an optional build (``setup.py``, beside the compiled prompt hashing): where it is
missing, or where ``JETROUTER_PURE_PYTHON`` asks for the Python code (``eventlog/compiled.py``
reads it), ``PrefixIndex.store``/``remove``/``apply_run`` and ``find_matches``/``match_columns``
run their Python code, which stays the reference implementation
(``tests/unit/replicas/core/test_index_kernel.py`` checks the two leave the same state,
``test_index_match_kernel.py`` that they match alike). ``use_compiled`` switches at run time,
so one process can time both (``python -m bench.core_tail --kernel both``)."""

from __future__ import annotations

from types import ModuleType

from eventlog import compiled

try:
    from replicas.core import _fastindex  # type: ignore[attr-defined]
except ImportError:  # not built here: the Python code runs
    _fastindex = None

_active: ModuleType | None = None if compiled.pure_requested() else _fastindex


def available() -> bool:
    """The kernel was built and imports."""
    return _fastindex is not None


def active() -> ModuleType | None:
    """The kernel when the index should use it, else None (run the Python code)."""
    return _active


def use_compiled(enabled: bool) -> bool:
    """Switch the index to the kernel (when built) or to the Python code; returns whether the
    kernel now runs."""
    global _active
    _active = _fastindex if enabled else None
    return _active is not None
