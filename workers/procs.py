"""Run a simulated worker as a child process (for tests, benchmarks and chaos scenarios).

A child process, not an in-process server, because several faults (``crash``,
``crash_after_tokens``) end the whole process, and SIGTERM handling is only real in a process of
its own. Start-up waits for the worker's "listening on URL" line (``--port 0`` picks a free port),
polling with a deadline.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

_LISTENING = re.compile(r"listening on (http://\S+)")


class WorkerProcess:
    def __init__(self, args: Sequence[str] = (), *, log_path: Path | None = None) -> None:
        self.args = list(args)
        if log_path is None:
            fd, name = tempfile.mkstemp(prefix="jetrouter-worker-", suffix=".log")
            os.close(fd)
            log_path = Path(name)
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""

    def start(self, timeout: float = 60.0) -> Self:
        argv = [sys.executable, "-m", "api.cli", "worker", "--port", "0", *self.args]
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = _LISTENING.search(self.log())
            if match:
                self.url = match.group(1)
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited with {self.proc.returncode}:\n{self.log()}")
            time.sleep(0.02)  # polling a condition with a deadline
        self.kill()
        raise RuntimeError(f"worker did not start within {timeout}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def terminate(self) -> None:
        if self.running():
            assert self.proc is not None
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float = 30.0) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.running():
            assert self.proc is not None
            self.proc.kill()
            self.proc.wait(10)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.kill()
        self.log_path.unlink(missing_ok=True)
