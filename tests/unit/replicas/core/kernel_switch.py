"""Run a block of a test with the compact index's compiled kernel on or off, and put the switch
back as it was after it (the kernel tests and ``conftest.py``'s both-codes fixture)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from replicas.core import index_kernel


@contextmanager
def kernel(enabled: bool) -> Iterator[None]:
    was = index_kernel.active() is not None
    index_kernel.use_compiled(enabled)
    try:
        yield
    finally:
        index_kernel.use_compiled(was)
