"""The one compiled piece: prompt hashing (``eventlog/_fasthash.c``, design.md §4).

Everything else is in pyproject.toml. The extension is optional: where it does not build (no C
compiler), the install still succeeds and ``eventlog.hashing`` runs its pure-Python code, which is
the reference implementation the compiled one is tested against.
"""

import sys

from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "eventlog._fasthash",
    sources=["eventlog/_fasthash.c"],
    libraries=["dl"] if sys.platform.startswith("linux") else [],
    optional=True,
)])
