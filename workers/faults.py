"""Fault injection for tests (``POST /fault``): crash, hang, slow down, wrong output."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

CRASH_EXIT_CODE = 86  # recognisable in a supervisor's log: "died of an injected crash"

ACTIONS = ("crash", "crash_after_tokens", "hang", "slow", "wrong_output", "clear")


def crash_now() -> None:
    """Die at once, like a segfaulting engine: no shutdown, no WorkerRetired, sockets reset."""
    print("jetrouter worker: injected crash", file=sys.stderr, flush=True)
    os._exit(CRASH_EXIT_CODE)


@dataclass
class FaultState:
    hang: bool = False
    slow_factor: float = 1.0
    wrong_output: bool = False
    crash_after_tokens: int | None = None  # armed for the next request that starts
    on_change: list[Callable[[], None]] = field(default_factory=list)

    def apply(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """Apply one action (raises ValueError on a bad one); returns the resulting state."""
        action = body.get("action")
        if action not in ACTIONS:
            raise ValueError(f"action must be one of {', '.join(ACTIONS)}")
        if action == "crash":
            crash_now()
        elif action == "crash_after_tokens":
            n = body.get("n")
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                raise ValueError("crash_after_tokens needs an integer n >= 0")
            self.crash_after_tokens = n
        elif action == "hang":
            self.hang = True
        elif action == "slow":
            factor = body.get("factor")
            if not isinstance(factor, int | float) or isinstance(factor, bool) or factor <= 0:
                raise ValueError("slow needs a number factor > 0")
            self.slow_factor = float(factor)
        elif action == "wrong_output":
            self.wrong_output = True
        else:
            self.hang, self.slow_factor, self.wrong_output = False, 1.0, False
            self.crash_after_tokens = None
        log.warning("fault injected: %s", dict(body))
        for callback in self.on_change:
            callback()
        return self.describe()

    def claim_crash_budget(self) -> int | None:
        """Disarm and return ``crash_after_tokens`` (the request that calls this carries it)."""
        n, self.crash_after_tokens = self.crash_after_tokens, None
        return n

    def describe(self) -> dict[str, Any]:
        return {"hang": self.hang, "slow_factor": self.slow_factor,
                "wrong_output": self.wrong_output, "crash_after_tokens": self.crash_after_tokens}
