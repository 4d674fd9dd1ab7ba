"""The compiled pieces: prompt hashing (``eventlog/_fasthash.c``, design.md §4), reading a KV
event's blocks into u64 words (``eventlog/_kvwire.c``) and the compact prefix index's KV-event
apply (``replicas/core/_fastindex.c``).

Everything else is in pyproject.toml. Both extensions are optional and need nothing beyond the
Python headers (no numpy headers, no sources fetched from elsewhere): where one does not build
(no C compiler), the install still succeeds and its Python code runs, which is the reference
implementation the compiled one is tested against.
"""

import sys

from setuptools import Extension, setup

setup(ext_modules=[
    Extension(
        "eventlog._fasthash",
        sources=["eventlog/_fasthash.c"],
        libraries=["dl"] if sys.platform.startswith("linux") else [],
        optional=True,
    ),
    # A BlocksStored's blocks read from msgpack into u64 words (eventlog/kv_decode.py).
    Extension("eventlog._kvwire", sources=["eventlog/_kvwire.c"], optional=True),
    # The compact prefix index's KV-event apply (replicas/core/index_kernel.py); plain C over
    # the index's arrays through the buffer protocol, no numpy headers needed to build it.
    Extension("replicas.core._fastindex",
              sources=["replicas/core/_fastindex.c", "replicas/core/_fastindex_state.c",
                       "replicas/core/_fastindex_table.c",
                       "replicas/core/_fastindex_match.c"],
              depends=["replicas/core/_fastindex.h", "replicas/core/_fastindex_state.h"],
              optional=True),
])
