"""A fresh interpreter with the compiled code turned off from its start
(``JETROUTER_PURE_PYTHON=1``, eventlog/compiled.py), for the tests of each compiled module's
switch."""

from __future__ import annotations

import os
import subprocess
import sys

from eventlog import compiled


def printed_with_pure_python(probe: str) -> list[str]:
    """What the Python code ``probe`` prints in such an interpreter, split into words."""
    env = {**os.environ, compiled.PURE_ENV: "1"}
    return subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                          text=True, check=True, timeout=60).stdout.split()
