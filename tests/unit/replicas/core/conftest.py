"""Fixtures shared by the prefix index's tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from replicas.core import index_kernel
from tests.unit.replicas.core.kernel_switch import kernel


@pytest.fixture(scope="module", params=["python", "compiled"])
def each_index_kernel(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run a module's tests with the compact index's Python code, then with its compiled kernel
    (``_fastindex.c``; skipped where it is not built). Module-scoped, so hypothesis tests may
    use it."""
    if request.param == "compiled" and not index_kernel.available():
        pytest.skip("the compiled index kernel is not built here")
    with kernel(request.param == "compiled"):
        yield request.param
